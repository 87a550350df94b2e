"""Segment lifecycles across processes: a hypothesis state machine (issue 12).

The test process and two long-lived spawn workers (see _machine_targets) make
shared arrays of every size class (arena-carved, one segment each, a
share_memory dict, arrays numpy itself allocated in shared memory and grew
by realloc: _alloc Note [shared allocation]), send, forward, receive back, keep, drop and write them,
re-send an array received before more segments than a process may keep
descriptors for, send unshared arrays (copies through recycled segments), and
SIGKILL a worker (replaced at once). Every process runs under ``ulimit -n
128``. The machine keeps a model: which holder holds which memory, and the
number last written to it.

After every step:
- every held item reads the number last written to it, through whichever
  alias it was written (a worker's write is seen by the test process and the
  other way round; a copy is never overwritten by a recycled segment);
- every process's arrays take at most half its descriptor limit, and its
  arraymp mappings stay within a budget that depends on what it holds, not on
  how many arrays went by (Machine.budget).
At the end of each run: no segment of its processes left in /dev/shm, the test
process's descriptors and mappings back where they started.

ARRAYMP_MACHINE_EXAMPLES raises the number of runs (20 by default, for CI).
"""

import contextlib
import dataclasses
import gc
import itertools
import multiprocessing
import os
import resource
import signal
import time
from multiprocessing import resource_tracker

import _machine_targets as targets
import mp_reductions as mpr
import pytest
import shm_core
from _budget_targets import can_reopen_mappings
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from mp_reductions import _arrays

MiB = 1 << 20
PAGE = 4096
WORKERS = (0, 1)
HOLDERS = ("p", *WORKERS)  # "p": the test process
ARENA_KINDS = ("tiny", "small", "page", "arena_max")
BURST_KINDS = (*ARENA_KINDS, "big", "dict", *targets.BORN_KINDS)
THRESHOLD = mpr.get_inline_threshold()
NOFILE = 128  # every process of the machine runs under ulimit -n 128; its arrays may take half of that
CAN_REOPEN = can_reopen_mappings()
NEEDS_REOPEN = ("past its descriptor budget a process re-sends an old memfd array only by re-opening it from "
                "/proc/self/map_files, which this process may not (CAP_CHECKPOINT_RESTORE); a normal user gets the "
                "error with its remedy (test_unprivileged_resend_past_the_budget_raises_never_copies)")
SLACK = 8 * MiB  # queue counters, a current arena per strategy
DAEMON = 1  # the shm-manager daemon connection a process opens at its first named segment, and keeps
LINGER = float(os.environ["ARRAYMP_RECYCLE_IDLE"]) + 5.0  # a dropped segment's mapping may stay this long (recycling)
STOP_TIMEOUT = 20  # a worker told to stop exits within this, or it is killed
ARENA_MIN_COST = 256  # what one arena-carved array may take of its arena at least (alignment, bookkeeping)


def nfds(pid) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def mappings(pid) -> dict[tuple[str, int], int]:
    """(device, inode) -> bytes of every arraymp segment ``pid`` maps."""
    found: dict[tuple[str, int], int] = {}
    with open(f"/proc/{pid}/maps") as f:
        for line in f:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and ("/memfd:arraymp" in fields[5] or "/" + shm_core.DEFAULT_PREFIX in fields[5]):
                start, end = (int(x, 16) for x in fields[0].split("-"))
                key = (fields[3], int(fields[4]))
                found[key] = found.get(key, 0) + end - start
    return found


def named_segments(pids) -> set[str]:
    return {name for name in os.listdir(shm_core.shm_dir())
            if (parsed := shm_core.parse_name(name)) is not None and parsed[2] in pids}


@dataclasses.dataclass
class Memory:
    """What one item's bytes are: the number last written, and where they live."""

    value: int
    kind: str
    creator: int  # pid of the process that made the segment
    shared: bool  # travels as a handle (else: a copy)

    def footprint(self) -> int:
        """What holding it may cost in mappings (arenas are counted per creator, see Machine.budget)."""
        n = targets.nbytes(self.kind)
        if self.kind in ARENA_KINDS:
            return 2 * n
        if self.kind in targets.UNSHARED_KINDS:  # a received copy: a recycled segment of up to 2n + 1 MiB
            return 2 * n + MiB + 2 * PAGE
        if self.kind in targets.BORN_KINDS:  # a recycled segment, and the one its realloc left, pooled for a while
            return 3 * n + 2 * MiB + 4 * PAGE
        return 2 * n + 2 * PAGE

    def released(self) -> int:
        """What its mapping may cost after being let go, until the recycler's idle time passes."""
        return _arrays.ARENA_SIZE + PAGE if self.kind in ARENA_KINDS else self.footprint()


class Machine(RuleBasedStateMachine):
    strategy: str  # set by each subclass

    def __init__(self):
        super().__init__()
        self.old_strategy = mpr.get_sharing_strategy()
        mpr.set_sharing_strategy(self.strategy)
        resource_tracker.ensure_running()  # the stdlib's, which spawn starts once and keeps (a pipe)
        gc.collect()
        self.fds_before, self.maps_before = nfds(os.getpid()), set(mappings(os.getpid()))
        self.inboxes = {h: mpr.Queue() for h in HOLDERS}
        self.local = targets.Holder("p", self.inboxes)
        self.procs, self.cmds, self.pids_ever = {}, {}, {os.getpid()}
        self.base_fds, self.base_maps = {}, {}
        self.held = {h: {} for h in HOLDERS}  # key -> memory id
        self.received = {h: [] for h in HOLDERS}  # keys in order of arrival
        self.let_go = {h: [] for h in HOLDERS}  # (time, bytes) of memory a holder stopped holding
        self.memory: dict[int, Memory] = {}
        self.arena_used: dict[int, int] = {}  # creator pid -> what its arena-carved arrays may have taken
        self.ids = itertools.count(1)  # keys, memory ids and written numbers
        for slot in WORKERS:
            self.start_worker(slot)
        self.base_fds["p"], self.base_maps["p"] = nfds(os.getpid()), self.maps_before
        self.old_nofile = resource.getrlimit(resource.RLIMIT_NOFILE)  # last: teardown restores it
        resource.setrlimit(resource.RLIMIT_NOFILE, (NOFILE, self.old_nofile[1]))

    # ---------------------------------------------------------------- plumbing
    def pid(self, h) -> int:
        return os.getpid() if h == "p" else self.procs[h].pid

    def start_worker(self, slot) -> None:
        cmds, child_end = multiprocessing.Pipe()
        proc = multiprocessing.get_context("spawn").Process(
            target=targets.worker, args=(child_end, slot, self.inboxes, self.strategy, NOFILE), daemon=True)
        proc.start()
        child_end.close()
        self.procs[slot], self.cmds[slot] = proc, cmds
        self.pids_ever.add(proc.pid)
        assert cmds.poll(targets.TIMEOUT), f"worker {slot} did not start within {targets.TIMEOUT} s"
        assert cmds.recv() == ("ok", None)
        self.base_fds[slot], self.base_maps[slot] = nfds(proc.pid), set(mappings(proc.pid))

    def call(self, h, op, *args):
        if h == "p":
            return getattr(self.local, op)(*args)
        self.cmds[h].send((op, args))
        if not self.cmds[h].poll(targets.TIMEOUT):
            os.kill(self.procs[h].pid, signal.SIGUSR1)  # its stacks, on its stderr
            raise AssertionError(f"worker {h} did not answer {op} within {targets.TIMEOUT} s (stacks on stderr)")
        status, result = self.cmds[h].recv()
        assert status == "ok", f"worker {h}: {op}{args} failed:\n{result}"
        return result

    def new_keys(self, n) -> list[int]:
        return [next(self.ids) for _ in range(n)]

    # ------------------------------------------------------------------- model
    def make_items(self, h, kind, count) -> list[int]:
        keys, values = self.new_keys(count), self.new_keys(count)
        self.call(h, "make", keys, kind, values)
        self.made(h, kind, keys, values)
        return keys

    def made(self, h, kind, keys, values) -> None:
        if kind in ARENA_KINDS:
            self.arena_used[self.pid(h)] = (self.arena_used.get(self.pid(h), 0)
                                            + len(keys) * max(2 * targets.nbytes(kind), ARENA_MIN_COST))
        for key, value in zip(keys, values, strict=True):
            self.held[h][key] = mid = next(self.ids)
            self.memory[mid] = Memory(value, kind, self.pid(h), targets.travels_shared(kind, self.strategy))

    def forget(self, h, key) -> None:
        mid = self.held[h].pop(key)
        if mid not in self.held[h].values():
            self.let_go[h].append((time.monotonic(), self.memory[mid].released()))

    def transfer(self, src, dst, keys, drop) -> list[int]:
        """src sends the items ``keys`` to dst (itself, possibly), which keeps them under new keys."""
        new_keys = self.new_keys(len(keys))
        self.call(src, "send", keys, dst, new_keys, drop)
        self.call(dst, "recv", new_keys)
        self.moved(src, dst, keys, new_keys, drop)
        return new_keys

    def moved(self, src, dst, keys, new_keys, drop) -> None:
        for key, new_key in zip(keys, new_keys, strict=True):
            mid = self.held[src][key]
            sent = self.memory[mid]
            if not sent.shared:  # a copy: new memory, made by the sender, the receiver's own (a copy again when
                # sent on: mp_reductions._shared Note [own arrays])
                self.let_go[src].append((time.monotonic(), sent.footprint()))  # the pooled copy segment
                mid = next(self.ids)
                self.memory[mid] = Memory(sent.value, sent.kind, self.pid(src), False)
            self.held[dst][new_key] = mid
            self.received[dst].append(new_key)
            if drop:
                self.forget(src, key)

    def budget(self, h) -> int:
        """The arraymp mappings process ``h`` may have: twice the bytes it holds; the arenas of each process
        whose arena-carved arrays it holds, and its own (one, plus one for every ARENA_SIZE that process's
        arena-carved arrays took, alive or not: a fragmented arena may be kept for one small array); what it
        let go within LINGER seconds; and SLACK."""
        now = time.monotonic()
        mids = set(self.held[h].values())
        creators = {self.pid(h)} | {self.memory[m].creator for m in mids if self.memory[m].kind in ARENA_KINDS}
        arenas = sum(1 + self.arena_used.get(c, 0) // _arrays.ARENA_SIZE for c in creators)
        return (SLACK + sum(self.memory[m].footprint() for m in mids) + arenas * (_arrays.ARENA_SIZE + PAGE)
                + sum(size for t, size in self.let_go[h] if now - t < LINGER))

    def describe(self, h, key) -> str:
        mid = self.held[h][key]
        holders = sorted((str(g), k) for g in HOLDERS for k, m in self.held[g].items() if m == mid)
        return f"{self.memory[mid]} held as {holders}"

    # ------------------------------------------------------------------- rules
    @rule(h=st.sampled_from(HOLDERS),
          kind=st.sampled_from([*targets.SHARED_KINDS, *targets.UNSHARED_KINDS, *targets.BORN_KINDS]),
          count=st.integers(1, 3))
    def make(self, h, kind, count):
        self.make_items(h, kind, count)

    @precondition(lambda self: any(self.held.values()))
    @rule(data=st.data(), dst=st.sampled_from(HOLDERS), drop=st.booleans())
    def send(self, data, dst, drop):
        """Send, forward (worker to worker), receive back, or a same-process round trip."""
        src = data.draw(st.sampled_from([h for h in HOLDERS if self.held[h]]), label="src")
        key = data.draw(st.sampled_from(sorted(self.held[src])), label="key")
        self.transfer(src, dst, [key], drop)

    @rule(src=st.sampled_from(HOLDERS), dst=st.sampled_from(HOLDERS), kind=st.sampled_from(BURST_KINDS),
          count=st.integers(1, 64), keep=st.booleans())
    def burst(self, src, dst, kind, count, keep):
        self.stream(src, dst, kind, count, keep)

    def stream(self, src, dst, kind, count, keep) -> None:
        """Arrays made and sent one by one (each dropped once sent, or all kept by the sender), all kept by
        the receiver."""
        keys, values, new_keys = self.new_keys(count), self.new_keys(count), self.new_keys(count)
        self.call(src, "burst", keys, kind, values, dst, new_keys, not keep)
        self.call(dst, "recv", new_keys)
        self.made(src, kind, keys, values)
        self.moved(src, dst, keys, new_keys, not keep)

    @rule(src=st.sampled_from(HOLDERS), dst=st.sampled_from(HOLDERS), kind=st.sampled_from(["copy", "copy_large"]),
          count=st.integers(1, 3))
    def recycle(self, src, dst, kind, count):
        """Unshared arrays sent and dropped: copies through recycled segments, which must never overwrite a copy
        still held."""
        self.transfer(src, dst, self.make_items(src, kind, count), drop=True)

    @precondition(lambda self: any(self.held.values()))
    @rule(data=st.data())
    def write(self, data):
        h = data.draw(st.sampled_from([h for h in HOLDERS if self.held[h]]), label="holder")
        key = data.draw(st.sampled_from(sorted(self.held[h])), label="key")
        value = next(self.ids)
        self.call(h, "write", key, value)
        self.memory[self.held[h][key]].value = value

    @precondition(lambda self: any(self.held.values()))
    @rule(data=st.data())
    def drop(self, data):
        h = data.draw(st.sampled_from([h for h in HOLDERS if self.held[h]]), label="holder")
        key = data.draw(st.sampled_from(sorted(self.held[h])), label="key")
        self.call(h, "drop", [key])
        self.forget(h, key)

    def oldest_received(self, h):
        return next((k for k in self.received[h] if k in self.held[h] and self.memory[self.held[h][k]].shared), None)

    @precondition(lambda self: any(self.oldest_received(h) is not None for h in HOLDERS))
    @rule(data=st.data(), dst=st.sampled_from(HOLDERS))
    def resend_old(self, data, dst):
        """Re-send the oldest shared array a holder received, after more segments arrived since than it may keep
        descriptors for; the receiver writes through what it got: the holder must see it. Where the segment
        cannot be re-opened, sending it may raise instead (never a copy)."""
        h = data.draw(st.sampled_from([h for h in HOLDERS if self.oldest_received(h) is not None]), label="holder")
        key = self.oldest_received(h)
        flooder = data.draw(st.sampled_from([g for g in HOLDERS if g != h]), label="flooder")
        for _ in range(NOFILE // 16):  # received as sent: few descriptors in flight (they count against the limit)
            self.stream(flooder, h, "big", 16, keep=False)
        (new_key,) = self.new_keys(1)
        refused = self.call(h, "resend", key, dst, new_key)
        if refused is not None:
            assert not CAN_REOPEN, f"holder {h} could not re-send an old received array: {refused}"
            return
        self.call(dst, "recv", [new_key])
        self.moved(h, dst, [key], [new_key], drop=False)
        value = next(self.ids)
        self.call(dst, "write", new_key, value)
        self.memory[self.held[dst][new_key]].value = value

    @precondition(lambda self: any(self.held[slot] for slot in WORKERS))
    @rule(data=st.data())
    def kill(self, data):
        """SIGKILL a holder (idle between commands), then replace it: what others hold of its memory stays."""
        slot = data.draw(st.sampled_from([slot for slot in WORKERS if self.held[slot]]), label="slot")
        proc = self.procs[slot]
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(targets.TIMEOUT)
        assert proc.exitcode == -signal.SIGKILL
        proc.close()
        self.cmds[slot].close()
        self.held[slot], self.received[slot], self.let_go[slot] = {}, [], []
        self.start_worker(slot)

    # -------------------------------------------------------------- invariants
    @invariant()
    def every_item_reads_its_last_write(self):
        for h in HOLDERS:
            got = self.call(h, "read_all")
            expected = {key: self.memory[mid].value for key, mid in self.held[h].items()}
            wrong = {key: (got.get(key), value) for key, value in expected.items() if got.get(key) != value}
            assert set(got) == set(expected) and not wrong, (
                f"holder {h} (read, expected): " + "; ".join(f"item {key}: {seen}, {value}: {self.describe(h, key)}"
                                                            for key, (seen, value) in wrong.items()))

    @invariant()
    def within_budget(self):
        for h in HOLDERS:
            pid = self.pid(h)
            fds = nfds(pid)
            assert fds - self.base_fds[h] <= NOFILE // 2, (
                f"holder {h} has {fds} descriptors, {self.base_fds[h]} at its start: more than half its limit "
                f"(ulimit -n {NOFILE}) more while holding {len(set(self.held[h].values()))} distinct arrays")
            mapped = sum(size for key, size in mappings(pid).items() if key not in self.base_maps[h])
            budget = self.budget(h)
            assert mapped <= budget, (
                f"holder {h} maps {mapped:,} bytes of arraymp segments, budget {budget:,}, holding "
                + ", ".join(sorted({f"{self.memory[m].kind} from pid {self.memory[m].creator}"
                                    for m in self.held[h].values()})))

    def close_inboxes(self):
        for q in self.inboxes.values():
            q.close()
            q.join_thread()
        del self.local, self.inboxes  # the items held here, and the queues' counters' mappings

    def teardown(self):
        resource.setrlimit(resource.RLIMIT_NOFILE, self.old_nofile)
        for slot, proc in self.procs.items():  # stopped, or killed if stuck, before anything is checked
            with contextlib.suppress(OSError):
                self.cmds[slot].send(("stop", ()))
            proc.join(STOP_TIMEOUT)
            if proc.exitcode is None:
                proc.kill()
                proc.join(targets.TIMEOUT)
            proc.close()
            self.cmds[slot].close()
        self.close_inboxes()
        mpr.set_sharing_strategy(self.old_strategy)
        deadline = time.monotonic() + 10
        while True:
            gc.collect()
            left, fds = named_segments(self.pids_ever), nfds(os.getpid())
            maps = {k: n for k, n in mappings(os.getpid()).items() if k not in self.maps_before}
            if not left and fds <= self.fds_before + DAEMON and len(maps) <= 1 or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert not left, f"segments left in /dev/shm: {sorted(left)}"
        # the current arena may stay, to serve the next small array
        assert len(maps) <= 1 and sum(maps.values()) <= _arrays.ARENA_SIZE + PAGE, (
            f"arraymp mappings left in the test process: {maps}")
        assert fds <= self.fds_before + DAEMON, f"descriptors: {self.fds_before} before, {fds} after"


# No shrinking: every step starts no process but a run starts two, so shrinking a failure takes many minutes;
# the failing run's steps are printed as they are.
SETTINGS = settings(max_examples=int(os.environ.get("ARRAYMP_MACHINE_EXAMPLES", "20")), stateful_step_count=25,
                    deadline=None, database=None, phases=[Phase.explicit, Phase.generate],
                    suppress_health_check=[HealthCheck.too_slow])


class FileDescriptorMachine(Machine):
    strategy = "file_descriptor"


class FileSystemMachine(Machine):
    strategy = "file_system"


TestFileDescriptor = pytest.mark.skipif(not CAN_REOPEN, reason=NEEDS_REOPEN)(FileDescriptorMachine.TestCase)
TestFileDescriptor.settings = SETTINGS
TestFileSystem = FileSystemMachine.TestCase
TestFileSystem.settings = SETTINGS
