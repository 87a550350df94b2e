"""The mp-spawn test suite, bound to a start method by ``test_spawn_<method>.py``.

Ports every scenario of torch's ``test/test_multiprocessing_spawn.py`` (with
assertions that can fail) and adds the ones mp-spawn promises beyond torch:
no descendant survives its supervisor, errors of any kind and size arrive,
every failure is reported, error files are removed.

Everything that waits has a deadline: joins go through :func:`join_within`
or :func:`time_limit`, queue reads through ``get(timeout=...)``.
"""

from __future__ import annotations

import contextlib
import errno
import glob
import itertools
import json
import logging
import multiprocessing
import os
import pickle
import pty
import re
import select
import signal
import subprocess
import sys
import textwrap
import time

import _spawn_targets as targets
import mp_spawn
import pytest
from mp_spawn import ProcessContext, ProcessExitedException, ProcessRaisedException

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
WAIT_S = 60.0  # generous deadline for anything that should take a second
DEATH_DEADLINE_S = 2.0  # the promise: no descendant alive 2 s after its parent died


class JoinTimeout(Exception):
    pass


@contextlib.contextmanager
def time_limit(seconds: float):
    """Interrupt a blocking call in the main thread after ``seconds``."""

    def on_alarm(signum, frame):
        raise JoinTimeout(f"still waiting after {seconds} s")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def join_within(ctx: ProcessContext, seconds: float = WAIT_S, grace_period: float | None = None) -> None:
    """Join until done; kill everything and fail after ``seconds``."""
    deadline = time.monotonic() + seconds
    while not ctx.join(timeout=max(0.0, deadline - time.monotonic()), grace_period=grace_period):
        if time.monotonic() >= deadline:
            for process in ctx.processes:
                process.kill()
            pytest.fail(f"processes still running after {seconds} s")


def proc_state(pid: int) -> tuple[str, int] | None:
    """(state letter, start time) from /proc, None when the pid is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            data = fh.read()
    except OSError:
        return None
    fields = data[data.rindex(b")") + 2 :].split()
    return fields[0].decode(), int(fields[19])


def alive(pid: int, started: int | None = None) -> bool:
    state = proc_state(pid)
    if state is None or state[0] in ("Z", "X"):
        return False
    return started is None or state[1] == started


def still_alive_after(pids_started: dict[int, int], seconds: float) -> list[int]:
    """Poll until all are dead or ``seconds`` passed; return those alive."""
    deadline = time.monotonic() + seconds
    while True:
        living = [pid for pid, started in pids_started.items() if alive(pid, started)]
        if not living or time.monotonic() >= deadline:
            return living
        time.sleep(0.02)


def descendants_of(root: int) -> list[int]:
    parents = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat", "rb") as fh:
                    data = fh.read()
            except OSError:
                continue
            parents[int(name)] = int(data[data.rindex(b")") + 2 :].split()[1])
    found, frontier = [], [root]
    while frontier:
        pid = frontier.pop()
        kids = [child for child, parent in parents.items() if parent == pid]
        found += kids
        frontier += kids
    return found


def wait_for(predicate, seconds: float = WAIT_S, what: str = "condition"):
    deadline = time.monotonic() + seconds
    while not predicate():
        if time.monotonic() >= deadline:
            pytest.fail(f"timed out after {seconds} s waiting for {what}")
        time.sleep(0.02)


def kill_all(pids):
    for pid in pids:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


def announced_descendants(directory, count: int) -> dict[int, int]:
    """{pid: start time} of the grandchildren and great-grandchildren that ``count``
    children of ``targets.popen_descendants`` announced."""
    pattern = os.path.join(directory, "descendants-*.json")
    wait_for(lambda: len(glob.glob(pattern)) == count, what=f"{count} children to announce their descendants")
    started = {}
    for path in glob.glob(pattern):
        with open(path) as fh:
            for pid in json.load(fh):
                state = proc_state(int(pid))
                assert state is not None, f"descendant {pid} died before the test began"
                started[int(pid)] = state[1]
    assert len(started) == 2 * count
    return started


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return fh.read()
    except OSError:
        return b""


def error_dirs(tmp) -> list[str]:
    """The mp_spawn error directories in ``tmp``."""
    return [p.name for p in tmp.iterdir() if p.name.startswith("mp_spawn-")]


def kill_survivors(started: dict[int, int]) -> None:
    """SIGKILL those of ``started`` still alive (and still the same processes)."""
    kill_all(pid for pid, start in started.items() if alive(pid, start))


class SpawnSuite:
    start_method: str = ""

    def start(self, fn, args=(), nprocs=2, join=True, daemon=False):
        if not join:
            return mp_spawn.start_processes(
                fn, args=args, nprocs=nprocs, join=False, daemon=daemon, start_method=self.start_method
            )
        with time_limit(WAIT_S):
            return mp_spawn.start_processes(
                fn, args=args, nprocs=nprocs, join=True, daemon=daemon, start_method=self.start_method
            )

    # -- torch's scenarios

    def test_success(self, tmp_path, no_leftover_children):
        assert self.start(targets.success, args=(str(tmp_path),), nprocs=2) is None
        assert sorted(p.name for p in tmp_path.iterdir()) == ["ran-0", "ran-1"]

    def test_success_non_blocking(self):
        ctx = self.start(targets.success, nprocs=2, join=False)
        assert isinstance(ctx, ProcessContext)
        pids = ctx.pids()
        assert len(set(pids)) == 2 and os.getpid() not in pids
        join_within(ctx)
        assert [p.exitcode for p in ctx.processes] == [0, 0]
        # Joining again after success keeps returning True.
        assert ctx.join(timeout=None) is True
        assert ctx.join(timeout=0) is True

    def test_join_returns_false_while_running(self, tmp_path):
        release = tmp_path / "release"
        ctx = self.start(targets.wait_for_file, args=(str(release),), nprocs=2, join=False)
        assert ctx.join(timeout=0.2) is False
        assert all(p.is_alive() for p in ctx.processes)
        release.touch()
        join_within(ctx)
        assert ctx.join() is True

    def test_first_argument_index(self):
        queue = multiprocessing.get_context(self.start_method).SimpleQueue()
        self.start(targets.put_index, args=(queue, "extra"), nprocs=3)
        got = sorted(queue.get() for _ in range(3))
        assert got == [(0, "extra"), (1, "extra"), (2, "extra")]

    def test_start_method_is_used(self):
        queue = multiprocessing.get_context(self.start_method).Queue()
        old, targets.MARK = targets.MARK, "changed in the parent"
        try:
            self.start(targets.report_mark, args=(queue,), nprocs=1)
        finally:
            targets.MARK = old
        expected = "changed in the parent" if self.start_method == "fork" else "module default"
        assert queue.get(timeout=WAIT_S) == expected

    @pytest.mark.parametrize("i", [0, 1])
    def test_exception_single(self, i, no_leftover_children):
        ctx = self.start(targets.exception_single, args=(i,), nprocs=2, join=False)
        with pytest.raises(
            ProcessRaisedException, match=rf"\nValueError: legitimate exception from process {i}$"
        ) as info:
            join_within(ctx)
        exc = info.value
        assert exc.error_index == i
        assert exc.error_pid == ctx.pids()[i]
        assert exc.exc_type == "ValueError"
        assert exc.exc_message == f"legitimate exception from process {i}"
        assert "Traceback (most recent call last)" in exc.msg
        assert "in exception_single" in exc.msg
        assert isinstance(exc.original, ValueError)
        assert exc.other_failures == []  # the other process was terminated, not failed
        assert ctx.processes[1 - i].exitcode == -signal.SIGTERM

    def test_exception_all(self, no_leftover_children):
        with pytest.raises(ProcessRaisedException, match=r"\nValueError: legitimate exception from process (0|1)$"):
            self.start(targets.exception_all, nprocs=2)

    def test_exception_all_every_failure_reported(self):
        ctx = self.start(targets.exception_all_now, nprocs=2, join=False)
        with pytest.raises(ProcessRaisedException) as info:
            join_within(ctx, grace_period=WAIT_S)
        exc = info.value
        assert "legitimate exception from process 0" in str(exc)
        assert "legitimate exception from process 1" in str(exc)
        assert "2 processes failed" in str(exc)
        assert [e.error_index for e in exc.other_failures] == [1 - exc.error_index]
        # The first failure's traceback still ends the message.
        assert re.search(rf"\nValueError: legitimate exception from process {exc.error_index}$", str(exc))

    def test_terminate_signal(self):
        ctx = self.start(targets.terminate_signal, nprocs=2, join=False)
        with pytest.raises(ProcessExitedException, match="process 0 terminated with signal (SIGABRT|SIGIOT)") as info:
            join_within(ctx)
        exc = info.value
        assert exc.exit_code == -signal.SIGABRT
        assert exc.signal_name == "SIGABRT"
        assert (exc.error_index, exc.error_pid) == (0, ctx.pids()[0])
        # faulthandler caught the Python stack at the signal.
        assert "Python stack of process 0" in str(exc)
        assert "terminate_signal" in str(exc)

    def test_terminate_exit(self):
        ctx = self.start(targets.terminate_exit, args=(123,), nprocs=2, join=False)
        with pytest.raises(ProcessExitedException, match="^process 0 terminated with exit code 123$") as info:
            join_within(ctx)
        assert info.value.exit_code == 123
        assert info.value.signal_name is None
        assert info.value.error_pid == ctx.pids()[0]

    def test_terminate_exit_no_grace_period_logs_sigterm(self, caplog):
        ctx = self.start(targets.terminate_exit, args=(123, targets.LONG_SLEEP_S), nprocs=2, join=False)
        pid1 = ctx.pids()[1]
        with caplog.at_level(logging.WARNING, logger="mp_spawn"):
            with pytest.raises(ProcessExitedException, match="process 0 terminated with exit code 123"):
                join_within(ctx)
        messages = [r.getMessage() for r in caplog.records if r.name == "mp_spawn"]
        assert messages == [f"Terminating process {pid1} via signal SIGTERM"]
        assert ctx.processes[1].exitcode == -signal.SIGTERM

    def test_terminate_exit_grace_period_lets_others_finish(self, caplog):
        ctx = self.start(targets.terminate_exit, args=(123, 1.0), nprocs=2, join=False)
        with caplog.at_level(logging.WARNING, logger="mp_spawn"):
            with pytest.raises(ProcessExitedException, match="process 0 terminated with exit code 123"):
                join_within(ctx, grace_period=WAIT_S)
        assert [r for r in caplog.records if r.name == "mp_spawn"] == []
        assert ctx.processes[1].exitcode == 0  # it finished on its own

    def test_sigterm_ignored_gets_sigkill(self, tmp_path, caplog):
        marker = tmp_path / "ignoring"
        ctx = self.start(targets.ignore_sigterm_then_wait, args=(str(marker), 7), nprocs=2, join=False)
        pid1 = ctx.pids()[1]
        with caplog.at_level(logging.WARNING, logger="mp_spawn"):
            with pytest.raises(ProcessExitedException, match="process 0 terminated with exit code 7"):
                join_within(ctx, grace_period=0.5)
        messages = [r.getMessage() for r in caplog.records if r.name == "mp_spawn"]
        assert messages == [
            f"Terminating process {pid1} via signal SIGTERM",
            f"Unable to shutdown process {pid1} via SIGTERM, forcefully exiting via SIGKILL",
        ]
        assert ctx.processes[1].exitcode == -signal.SIGKILL

    def test_success_first_then_exception(self):
        ctx = self.start(targets.success_first_then_exception, args=(123,), nprocs=2, join=False)
        with pytest.raises(ProcessRaisedException, match="ValueError: legitimate exception") as info:
            join_within(ctx)
        assert info.value.error_index == 1
        assert ctx.processes[0].exitcode == 0

    def test_exception_raises(self):
        with pytest.raises(ProcessRaisedException):
            self.start(targets.success_first_then_exception, nprocs=2)

    def test_signal_raises(self):
        ctx = self.start(targets.infinite, nprocs=1, join=False)
        for pid in ctx.pids():
            os.kill(pid, signal.SIGTERM)
        with pytest.raises(ProcessExitedException, match="process 0 terminated with signal SIGTERM") as info:
            join_within(ctx)
        assert info.value.signal_name == "SIGTERM"
        assert info.value.exit_code == -signal.SIGTERM

    def test_process_exited(self):
        with pytest.raises(ProcessExitedException) as info:
            self.start(targets.process_exit, nprocs=1)
        assert info.value.exit_code == 12
        assert info.value.error_index == 0

    @pytest.mark.parametrize("how_to_die", ["SIGTERM", "SIGKILL"])
    def test_nested_children_die_with_parent(self, tmp_path, how_to_die):
        ctx = self.start(targets.middle, args=(str(tmp_path), self.start_method, how_to_die), nprocs=1, join=False)
        pids_file = tmp_path / "pids-0.json"
        wait_for(pids_file.exists, what="the grandchildren to start")
        grandchildren = json.loads(pids_file.read_text())["grandchildren"]
        started = {pid: proc_state(pid)[1] for pid in grandchildren}
        (tmp_path / "go").touch()
        try:
            # Watch the middle's pid, not its sentinel: with fork, the
            # grandchildren inherit the sentinel's write end and keep it open.
            middle = ctx.pids()[0]
            wait_for(lambda: not alive(middle), what="the middle process to die")
            # The middle process is dead now; its children must follow within 2 s.
            assert still_alive_after(started, DEATH_DEADLINE_S) == []
            with pytest.raises(ProcessExitedException, match=f"process 0 terminated with signal {how_to_die}"):
                join_within(ctx)
        finally:
            kill_all(grandchildren)

    # -- beyond torch: the supervisor's death

    def test_parent_sigkill_leaves_no_descendant(self, tmp_path):
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([TESTS_DIR, os.environ.get("PYTHONPATH", "")]))
        code = f"import _spawn_targets as t; t.driver({str(tmp_path)!r}, {self.start_method!r}, 2)"
        driver = subprocess.Popen([sys.executable, "-c", code], env=env)
        everyone: list[int] = []
        try:
            wait_for(
                lambda: len(glob.glob(str(tmp_path / "pids-*.json"))) == 2, what="two middles and four grandchildren"
            )
            for path in glob.glob(str(tmp_path / "pids-*.json")):
                with open(path) as fh:
                    info = json.load(fh)
                everyone += [info["middle"], *info["grandchildren"]]
            everyone = sorted(set(everyone) | set(descendants_of(driver.pid)))
            started = {pid: proc_state(pid)[1] for pid in everyone if proc_state(pid)}
            assert len(started) >= 6
            driver.kill()
            driver.wait(timeout=WAIT_S)
            assert still_alive_after(started, DEATH_DEADLINE_S) == []
        finally:
            driver.kill()
            driver.wait(timeout=WAIT_S)
            kill_all(everyone)

    def test_parent_sigkill_leaves_no_popen_descendant(self, tmp_path):
        # Grandchildren and great-grandchildren started with subprocess.Popen,
        # which neither PR_SET_PDEATHSIG nor any watchdog of ours was set in.
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([TESTS_DIR, os.environ.get("PYTHONPATH", "")]))
        code = f"import _spawn_targets as t; t.popen_driver({str(tmp_path)!r}, {self.start_method!r}, 2)"
        driver = subprocess.Popen([sys.executable, "-c", code], env=env)
        started: dict[int, int] = {}
        try:
            started = announced_descendants(tmp_path, 2)
            driver.kill()
            driver.wait(timeout=WAIT_S)
            assert still_alive_after(started, DEATH_DEADLINE_S) == []
        finally:
            driver.kill()
            driver.wait(timeout=WAIT_S)
            kill_survivors(started)

    @pytest.mark.parametrize("then", ["return", "raise"])
    def test_popen_descendants_die_with_their_child(self, tmp_path, then, no_leftover_children):
        # "return": both children return; "raise": process 0 raises and
        # process 1 is terminated by the supervisor.
        ctx = self.start(targets.popen_descendants, args=(str(tmp_path), then), nprocs=2, join=False)
        started: dict[int, int] = {}
        try:
            started = announced_descendants(tmp_path, 2)
            (tmp_path / "go").touch()
            if then == "raise":
                with pytest.raises(ProcessRaisedException, match="failed, leaving descendants"):
                    join_within(ctx)
            else:
                join_within(ctx)
            assert still_alive_after(started, DEATH_DEADLINE_S) == []
        finally:
            kill_survivors(started)

    def test_resource_tracker_outlives_the_group(self, tmp_path):
        # A fork child with no resource tracker to inherit starts its own, in
        # its process group; the group reaper must let it clean up. (spawn and
        # forkserver children use the supervisor's.)
        name = f"mp_spawn_test_{os.getpid()}_{tmp_path.name}"
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([TESTS_DIR, os.environ.get("PYTHONPATH", "")]))
        code = f"import _spawn_targets as t; t.shared_memory_driver({name!r}, {self.start_method!r})"
        driver = subprocess.Popen([sys.executable, "-c", code], env=env, stderr=subprocess.PIPE, text=True)
        try:
            _, stderr = driver.communicate(timeout=WAIT_S)
            assert driver.returncode == 0, stderr
            wait_for(lambda: not os.path.exists(f"/dev/shm/{name}"), what="the resource tracker to unlink the segment")
        finally:
            driver.kill()
            driver.wait(timeout=WAIT_S)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(f"/dev/shm/{name}")

    def test_resource_tracker_cleans_up_behind_a_slow_grandchild(self, tmp_path):
        # The child leaves a psm_* segment to the resource tracker (under fork,
        # one it started in its own group) and a grandchild that inherited the
        # tracker's pipe and takes 2 s to handle SIGTERM. When the supervisor is
        # killed, the group reaper SIGKILLs what is left of the group after 1 s:
        # not the tracker, which must see the grandchild go and unlink the segment.
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([TESTS_DIR, os.environ.get("PYTHONPATH", "")]))
        code = (
            "import _spawn_targets as t; "
            f"t.shared_memory_slow_grandchild_driver({str(tmp_path)!r}, {self.start_method!r})"
        )
        with open(tmp_path / "stderr.txt", "w") as stderr:  # the tracker warns about what it cleaned
            driver = subprocess.Popen([sys.executable, "-c", code], env=env, stderr=stderr)
        segment = None
        grandchild: dict[int, int] = {}
        try:
            wait_for((tmp_path / "ready").exists, what="the child to leave a segment and a grandchild")
            info = json.loads((tmp_path / "ready").read_text())
            segment = f"/dev/shm/{info['segment']}"
            grandchild = {info["grandchild"]: proc_state(info["grandchild"])[1]}
            assert info["segment"].startswith("psm_") and os.path.exists(segment)
            driver.kill()
            driver.wait(timeout=WAIT_S)
            wait_for(lambda: not os.path.exists(segment), 10.0, f"the resource tracker to unlink {segment}")
            assert still_alive_after(grandchild, DEATH_DEADLINE_S) == []
        finally:
            driver.kill()
            driver.wait(timeout=WAIT_S)
            kill_survivors(grandchild)
            if segment is not None:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(segment)

    @pytest.mark.parametrize("pidfds", [True, False], ids=["pidfd", "no-pidfd"])
    def test_join_does_not_wait_for_a_double_forked_daemon(self, tmp_path, monkeypatch, pidfds):
        # The child starts a daemon (fork, setsid, fork) that lives 60 s and
        # returns. The daemon holds a copy of every descriptor of the child,
        # the write end of its sentinel pipe included; join must return when
        # the child is gone, as Process.join does, and leave the daemon (in a
        # session of its own) alive.
        if not pidfds:

            def no_pidfd_open(pid, flags=0):
                raise OSError(errno.ENOSYS, "pidfd_open is not available")

            monkeypatch.setattr(os, "pidfd_open", no_pidfd_open)
        path = tmp_path / "daemon.pid"
        daemon: dict[int, int] = {}
        try:
            with time_limit(10.0):
                mp_spawn.start_processes(
                    targets.double_fork_daemon, args=(str(tmp_path),), nprocs=1, start_method=self.start_method
                )
            pid = int(path.read_text())
            daemon = {pid: proc_state(pid)[1]}
            assert alive(pid), "the group reaper killed a daemon that left the group"
        finally:
            if not daemon and path.exists():
                pid = int(path.read_text())
                daemon = {pid: proc_state(pid)[1]} if proc_state(pid) else {}
            kill_survivors(daemon)

    @contextlib.contextmanager
    def _session_daemon_run(self, tmp_path):
        """A supervisor (``driver``) of one child that started a session daemon, with a TMPDIR of its own (``tmp``),
        its error directory made: yields (driver, tmp, the child's {pid: start time}, the daemon's); ends them all."""
        tmp = tmp_path / "tmp"
        tmp.mkdir()
        env = dict(os.environ, TMPDIR=str(tmp),
                   PYTHONPATH=os.pathsep.join([TESTS_DIR, os.environ.get("PYTHONPATH", "")]))
        code = f"import _spawn_targets as t; t.session_daemon_driver({str(tmp_path)!r}, {self.start_method!r})"
        driver = subprocess.Popen([sys.executable, "-c", code], env=env)
        daemon: dict[int, int] = {}
        try:
            path = tmp_path / "session.json"
            wait_for(path.exists, what="the child and its session daemon")
            pids = json.loads(path.read_text())
            daemon = {pids["daemon"]: proc_state(pids["daemon"])[1]}
            child = {pids["child"]: proc_state(pids["child"])[1]}
            assert error_dirs(tmp), "no error directory was made"
            yield driver, tmp, child, daemon
        finally:
            driver.kill()
            driver.wait(timeout=WAIT_S)
            kill_survivors(daemon)

    def test_a_killed_supervisor_spares_a_daemon_that_left_the_group_and_leaves_no_error_directory(self, tmp_path):
        # One rule under every start method (Note [process groups]): what leaves the child's group is never killed,
        # whether PR_SET_PDEATHSIG (fork, spawn) or the watchdog (forkserver) ends the child. And the children's group
        # reapers remove the supervisor's error directory (the next run in the same TMPDIR would, too late for a user
        # who looks at /tmp after a killed job).
        with self._session_daemon_run(tmp_path) as (driver, tmp, child, daemon):
            driver.kill()
            driver.wait(timeout=WAIT_S)
            assert still_alive_after(child, DEATH_DEADLINE_S) == []
            assert still_alive_after(daemon, 0.5) == list(daemon), "a daemon that left the group was killed"
            wait_for(lambda: not error_dirs(tmp), seconds=10, what="the error directory to go")

    def test_a_supervisor_that_dies_just_after_its_child_leaves_no_error_directory(self, tmp_path):
        # The kernel kills the child (PR_SET_PDEATHSIG) when the supervisor's forking thread exits, before its main
        # thread has: the group reaper can find the supervisor alive and dying. Here the supervisor is stopped (it
        # cannot clean up) when its child dies, and killed a second later: the reaper must still remove the directory.
        with self._session_daemon_run(tmp_path) as (driver, tmp, child, daemon):
            (pid,) = child
            reaper = {p: proc_state(p)[1] for p in descendants_of(pid) if b"_deathsig.py" in _cmdline(p)}
            assert reaper, "no group reaper found"
            os.kill(driver.pid, signal.SIGSTOP)
            kill_all(child)
            assert still_alive_after(child, DEATH_DEADLINE_S) == []
            # The reaper finds its supervisor alive: it leaves at once, the directory kept (the bug), or waits for
            # the supervisor to die (well within _SUPERVISOR_EXIT_S: the supervisor is killed after this).
            still_alive_after(reaper, 2.5)
            assert error_dirs(tmp), "the stopped supervisor's error directory went while it lived"
            driver.kill()
            driver.wait(timeout=WAIT_S)
            wait_for(lambda: not error_dirs(tmp), seconds=10, what="the error directory to go")

    @pytest.mark.parametrize("payload", [0, 4 * 1024 * 1024], ids=["small-args", "args-larger-than-a-pipe"])
    def test_script_without_main_guard_is_told_so(self, tmp_path, payload):
        # spawn and forkserver children import the main module again: a script
        # that calls spawn at its top level calls it again in each child. The
        # parent's exception must say the script needs the guard.
        if payload and self.start_method == "spawn":
            pytest.skip(
                "the stdlib's spawn start holds the child's end of the pipe while it writes the arguments: "
                "a child that dies before it read them hangs Process.start"
            )
        script = tmp_path / "unguarded.py"
        if self.start_method == "spawn":
            call = "mp.spawn(fn, args=(payload,), nprocs=2)"
        else:
            call = f"mp.start_processes(fn, args=(payload,), nprocs=2, start_method={self.start_method!r})"
        error_path = tmp_path / "error.txt"
        script.write_text(
            textwrap.dedent(
                f"""\
                import mp_spawn as mp


                def fn(i, payload):
                    pass


                payload = b"x" * {payload}
                try:
                    {call}
                except (mp.ProcessException, RuntimeError) as exc:
                    with open({str(error_path)!r}, "w") as fh:
                        fh.write(f"{{type(exc).__name__}}: {{exc}}")
                    raise
                print("done")
                """
            )
        )
        result = subprocess.run(
            [sys.executable, str(script)], capture_output=True, text=True, timeout=WAIT_S, cwd=tmp_path
        )
        if self.start_method == "fork":  # fork children do not import the main module
            assert (result.returncode, result.stdout) == (0, "done\n"), result.stderr
            return
        assert result.returncode == 1, result.stderr
        message = error_path.read_text()
        assert 'The script needs `if __name__ == "__main__":`' in message
        where = f'File "{script}", line 10, in <module>'  # where the script starts processes
        if message.startswith("RuntimeError: the fork server exited") and self.start_method == "forkserver":
            # the fork server imports the main module itself, and died there before any child started (3.13.x and
            # 3.14 authenticate the connection to it, which then breaks; on 3.11 the children fail instead, and say so)
            assert where in result.stderr, result.stderr
        else:
            assert message.startswith("ProcessRaisedException: "), message
            assert where in message
        assert "could not unpickle" not in message

    def test_ctrl_c_reaches_children_and_descendants(self, tmp_path):
        # On a terminal, `while not ctx.join(...)` and Ctrl-C: the children lead
        # sessions of their own, so only the supervisor gets the terminal's
        # SIGINT; unless join relays it, the program hangs at exit joining them.
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([TESTS_DIR, os.environ.get("PYTHONPATH", "")]))
        code = f"import _spawn_targets as t; t.ctrl_c_driver({str(tmp_path)!r}, {self.start_method!r})"
        master, slave = pty.openpty()
        driver = subprocess.Popen(
            [sys.executable, "-c", code], stdin=slave, stdout=slave, stderr=slave, env=env, start_new_session=True
        )
        os.close(slave)
        started: dict[int, int] = {}
        output = b""
        try:
            started = announced_descendants(tmp_path, 2)
            os.write(master, b"\x03")
            deadline = time.monotonic() + WAIT_S
            while driver.poll() is None and time.monotonic() < deadline:
                if select.select([master], [], [], 0.1)[0]:
                    try:
                        output += os.read(master, 65536)
                    except OSError:  # EIO: the terminal's last user is gone
                        break
            with contextlib.suppress(subprocess.TimeoutExpired):
                driver.wait(timeout=max(0.1, deadline - time.monotonic()))
            assert driver.returncode == -signal.SIGINT, f"{driver.returncode=}\n{output.decode(errors='replace')}"
            assert b"KeyboardInterrupt" in output
            assert still_alive_after(started, DEATH_DEADLINE_S) == []
        finally:
            driver.kill()
            driver.wait(timeout=WAIT_S)
            os.close(master)
            kill_survivors(started)

    def test_interrupted_join_terminates_children(self):
        with pytest.raises(JoinTimeout):
            with time_limit(1.0):
                mp_spawn.start_processes(targets.infinite, nprocs=2, start_method=self.start_method)
        assert multiprocessing.active_children() == []

    def test_daemon_flag(self):
        ctx = self.start(targets.success, nprocs=2, join=False, daemon=True)
        assert [p.daemon for p in ctx.processes] == [True, True]
        join_within(ctx)

    # -- beyond torch: errors of every kind arrive

    def test_error_files_removed(self):
        ctx = self.start(targets.exception_all_now, nprocs=2, join=False)
        error_dir = os.path.dirname(ctx.error_files[0])
        assert os.path.isdir(error_dir)
        assert (os.stat(error_dir).st_mode & 0o777) == 0o700
        with pytest.raises(ProcessRaisedException):
            join_within(ctx, grace_period=WAIT_S)
        assert not any(os.path.exists(path) for path in ctx.error_files)
        assert not os.path.exists(error_dir)

    def test_error_dir_removed_after_success(self):
        ctx = self.start(targets.success, nprocs=2, join=False)
        error_dir = os.path.dirname(ctx.error_files[0])
        join_within(ctx)
        assert not os.path.exists(error_dir)

    def test_join_after_failure_raises_again(self):
        ctx = self.start(targets.process_exit, nprocs=1, join=False)
        with pytest.raises(ProcessExitedException) as first:
            join_within(ctx)
        with pytest.raises(ProcessExitedException) as second:
            ctx.join()
        assert second.value is first.value

    def test_keyboard_interrupt_is_a_failure(self):
        with pytest.raises(ProcessRaisedException, match=r"\nKeyboardInterrupt$") as info:
            self.start(targets.raise_keyboard_interrupt, nprocs=1)
        assert info.value.exc_type == "KeyboardInterrupt"

    def test_sigint_is_a_failure(self):
        with pytest.raises(ProcessRaisedException, match=r"\nKeyboardInterrupt$"):
            self.start(targets.sigint_self, nprocs=1)

    def test_base_exception_subclass(self):
        with pytest.raises(
            ProcessRaisedException, match=r"\n_spawn_targets.CustomBase: a BaseException subclass from process 0$"
        ) as info:
            self.start(targets.raise_base_exception, nprocs=1)
        assert info.value.exc_type == "_spawn_targets.CustomBase"
        assert isinstance(info.value.original, targets.CustomBase)

    def test_unpicklable_exception(self):
        with pytest.raises(ProcessRaisedException, match=r"\n_spawn_targets.Unpicklable: cannot pickle me 0$") as info:
            self.start(targets.raise_unpicklable, nprocs=1)
        exc = info.value
        assert exc.exc_type == "_spawn_targets.Unpicklable"
        assert exc.exc_message == "cannot pickle me 0"
        assert "in raise_unpicklable" in exc.child_traceback
        assert exc.original is None

    def test_exception_that_does_not_unpickle(self):
        with pytest.raises(ProcessRaisedException, match=r"NeedsTwoArgs: x-0$") as info:
            self.start(targets.raise_needs_two_args, nprocs=1)
        assert info.value.original is None

    def test_original_exception_arrives(self):
        with pytest.raises(ProcessRaisedException) as info:
            self.start(targets.raise_with_payload, nprocs=1)
        original = info.value.original
        assert isinstance(original, targets.WithPayload)
        assert original.payload == {"index": 0, "data": [1, 2, 3]}

    def test_huge_traceback(self):
        nbytes = 5 * 1024 * 1024
        with pytest.raises(ProcessRaisedException) as info:
            self.start(targets.raise_huge, args=(nbytes,), nprocs=2)
        msg = str(info.value)
        assert len(msg) > nbytes
        assert msg.rstrip().endswith("x-end")
        assert "ValueError: start-xxx" in msg

    def test_failed_child_with_lingering_thread_still_exits(self, monkeypatch):
        # Without the exit backstop the child would wait on its non-daemon
        # thread for a minute; the error must arrive well before that.
        monkeypatch.setenv(mp_spawn.ENV_VAR_FAILED_EXIT_TIMEOUT, "0.5")
        with pytest.raises(ProcessRaisedException, match="raised with a non-daemon thread running"):
            with time_limit(targets.LONG_SLEEP_S - 5):
                mp_spawn.start_processes(
                    targets.leave_non_daemon_thread_and_raise, nprocs=1, start_method=self.start_method
                )

    def test_mixed_failures_all_reported(self):
        ctx = self.start(targets.fail_and_raise, nprocs=2, join=False)
        with pytest.raises(mp_spawn.ProcessException) as info:
            join_within(ctx, grace_period=WAIT_S)
        msg = str(info.value)
        assert "process 0 terminated with exit code 3" in msg
        assert "RuntimeError: second failure from process 1" in msg
        assert len(info.value.other_failures) == 1

    @pytest.mark.parametrize(
        ("signum", "hint"),
        # SIGKILL: where the memory cgroup's OOM count can be read (Note [OOM kills]) it says none was counted (the
        # test sent it), else the usual hint
        [(signal.SIGKILL, "out-of-memory killer|counted no OOM kill"), (signal.SIGBUS, "/dev/shm full"),
         (signal.SIGSEGV, "native code")],
    )
    def test_signal_hints(self, signum, hint):
        name = signal.Signals(signum).name
        with pytest.raises(ProcessExitedException, match=f"^process 0 terminated with signal {name} ") as info:
            self.start(targets.terminate_signal, args=(signum,), nprocs=1)
        assert re.search(hint, str(info.value))
        assert info.value.signal_name == name

    def test_raised_exceptions_pickle(self):
        with pytest.raises(ProcessRaisedException) as info:
            self.start(targets.raise_with_payload, nprocs=1)
        exc = info.value
        copy = pickle.loads(pickle.dumps(exc))
        assert type(copy) is ProcessRaisedException
        assert str(copy) == str(exc)
        assert (copy.error_index, copy.error_pid, copy.exc_type) == (exc.error_index, exc.error_pid, exc.exc_type)
        assert copy.original.payload == exc.original.payload

    def test_spawn_api(self):
        queue = multiprocessing.get_context("spawn").Queue()
        old, targets.MARK = targets.MARK, "changed in the parent"
        try:
            with time_limit(WAIT_S):
                if self.start_method == "spawn":
                    mp_spawn.spawn(targets.report_mark, args=(queue,), nprocs=1)
                else:
                    with pytest.warns(FutureWarning, match="only supports start_method=spawn"):
                        mp_spawn.spawn(targets.report_mark, args=(queue,), nprocs=1, start_method=self.start_method)
        finally:
            targets.MARK = old
        # spawn() always spawns, whatever start_method says.
        assert queue.get(timeout=WAIT_S) == "module default"


class ParallelStartSuite:
    """For the start methods that start in parallel (spawn, forkserver)."""

    start_method: str = ""

    def test_parallel_start_overlaps_the_children(self, monkeypatch, tmp_path):
        # Each child spends SLEEP_S unpickling its arguments before it reads the
        # rest of a payload larger than a pipe; a sequential start waits for
        # each child in turn, a parallel one for all of them at once. Compared
        # as the children's unpickling windows (CLOCK_MONOTONIC is system-wide),
        # not as wall-clock times, so a loaded machine cannot fail it.
        nprocs, sleep_s = 4, 1.0

        def windows(parallel: str) -> list[tuple[float, float]]:
            directory = tmp_path / parallel
            directory.mkdir()
            monkeypatch.setenv(mp_spawn.ENV_VAR_PARALLEL_START, parallel)
            args = (targets.SlowToUnpickle(sleep_s, str(directory)), b"x" * (4 * 1024 * 1024))
            with time_limit(WAIT_S):
                mp_spawn.start_processes(
                    targets.noop_with_args, args=args, nprocs=nprocs, start_method=self.start_method
                )
            found = sorted(tuple(map(float, f.read_text().split())) for f in directory.iterdir())
            assert len(found) == nprocs
            return found

        def overlaps(found):  # each child's window, with the one started after it
            return [nxt_start < end for (_, end), (nxt_start, _) in itertools.pairwise(found)]

        sequential = windows("0")
        assert not any(overlaps(sequential)), sequential  # one at a time, by construction
        parallel = windows("1")
        assert all(overlaps(parallel)), parallel

    def test_start_failure_leaves_no_child(self, no_leftover_children):
        import threading

        with pytest.raises(TypeError, match="pickle"):
            mp_spawn.start_processes(
                targets.noop_with_args, args=(threading.Lock(),), nprocs=2, start_method=self.start_method
            )
        assert multiprocessing.active_children() == []
