"""The workers' own task queues ("slots"), the tasks each holds, and the deaths to settle: how the pool knows
which tasks a dead worker took, so that it fails the one it ran and loses no other.

Note [lost tasks]
~~~~~~~~~~~~~~~~~
Invariant: every task sent is, whatever is killed when, finished, failed, or queued for a live or starting worker; a
dead worker fails at most the one task it was running.

How: the parent sends slot k a message (one task, or a batch: Note [batches]) only while it holds fewer than ``DEPTH``
unfinished ones (results not all read, loss not settled), recording each and its size in bytes under the slots' lock; it
keeps a reading end of every slot's queue. A worker takes its messages in order, so those still queued are the last
sent, and their total size (SIOCINQ) says how many. The worker handler, reaping worker k (dead: it sent all it will),
reads that total under the lock before the replacement (the only other reader) starts: recording those taken, leaving
those queued to the replacement. The result handler settles the record once it has read the short socket and the
outqueue (where all the dead worker's messages are by then): its first task still unfinished fails with WorkerLostError
(or TaskTimeoutError: watchdog Note [task timeouts]), the others are ready again, first in line. With no task ready, an
idle slot takes, unchanged, another slot's message not taken yet (told by its bytes; a receive that finds nothing moves
nothing), even one a starting worker would hold (see ``_send_ready``). Stop sentinels go only once no task is
unfinished (close), or at terminate, which drains the slots' messages (each unpickled, to give back the shared memory
it names).

Note [batches]
~~~~~~~~~~~~~~
Invariant: a message holds one task, or several plain ones (naming no shared memory: _channel Note [plain
messages]) that make about ``BATCH_TIME`` of work by the workers' own measure (each result says how long its task
ran; ``per_task`` is their moving average), at most ``BATCH_MAX``, no more than a fair share of the ready ones,
within one message. A task holding shared memory, a task of a call that wants each result as soon as its task ends
(its result's ``alone``: ``apply_async(alone=True)``; joblib's ``return_as="generator_unordered"``), and every
task of a pool whose workers retire after ``maxtasksperchild`` tasks, go alone; tasks that run long are never
batched, so none waits behind a long one while another worker idles. (A batch's tasks are short on average, not
each: one long task among them holds those after it until it ends.) A worker runs a batch in order and sends each
result before it starts the next, so Note [lost tasks] holds per task: in the message a dead worker was running,
its first unfinished task is the one it ran, and those after it are ready again.

Note [start failures]
~~~~~~~~~~~~~~~~~~~~~
Invariant: a pool whose workers die ``processes`` times in a row before they could run a task fails every
unfinished and later task with WorkerStartError and starts no more workers. A worker sends ``STARTED`` once its
initializer returned, or ``START_FAILED`` with the initializer's exception before it exits; one that exits with
an error (a non-zero code, or a signal other than SIGKILL / SIGTERM, which come from outside) before
``STARTED`` failed to start. The result handler sees a dead worker's messages before it settles its death, so
it knows (the stdlib's Pool respawns such workers forever). The executor breaks at the first (``fail_fast``),
as the stdlib's does.
"""

from __future__ import annotations

import collections
import os
import pickle
import socket
import threading
from typing import Any

import shm_core
import shm_manager

from .. import _stats
from .._channel import INLINE, Packet, recv_fds
from .._message import MAX_FDS
from .._queues import SimpleQueue
from .clock import Clock
from .wire import BATCH_BYTES, BATCH_MAX, BATCH_TIME, DEPTH, drain, message, message_bytes, queued, queued_bytes


class Slots:
    """The workers' task queues, the tasks each holds, and the deaths to settle (Note [lost tasks])."""

    def __init__(self, processes: int, cache, batches: bool = True):
        self.cache = cache
        self.lock = threading.Lock()  # taken directly where no one waits: a Condition's with costs more
        self.cond = threading.Condition(self.lock)
        self.queues: list[SimpleQueue[Any]] = [SimpleQueue() for _ in range(processes)]
        self.short: SimpleQueue[Any] = SimpleQueue()  # the workers' short results (Note [batches])
        self.workers: list = [None] * processes  # the Process serving each slot, None while it has none
        self.active = processes  # slots in use: the first ones (the executor's grow on demand)
        # per slot, its unfinished messages in the order sent: [the (job, i)s not finished yet, bytes, its ready
        # entries (a batch's, to send again those a dead worker never started: Note [batches])]
        self.sent: list[collections.deque] = [collections.deque() for _ in range(processes)]
        self.owner: dict[tuple, int] = {}  # unfinished (job, i) -> its slot
        self.deaths: list[tuple] = []  # (slot, pid, exitcode, the messages it took, how it died), to settle
        # pickled tasks, sent as slots have room: ((job, i), its Packet made with the head (job, i), the head's
        # length, or None for a task that goes alone); their weight is 1 for one that may be batched, BATCH_MAX
        # for one that goes alone (Note [batches])
        self.ready: collections.deque = collections.deque()
        self.weight, self.ready_max, self.waiting = 0, DEPTH * BATCH_MAX * processes, False
        self.batches = batches  # False: one task per message (workers that retire after maxtasksperchild)
        self.per_task: float | None = None  # seconds a task takes in a worker, as workers report (Note [batches])
        self.n = 1  # tasks a batch is made of: about BATCH_TIME of work
        self.failed: list[tuple] = []  # (job, i, error): a task that could not be sent
        self.closed = self.stopped = False
        self.broken: BaseException | None = None  # every unfinished and later task fails with it
        self.clock = Clock(processes)  # clock Note [task clock]
        self.senders: set[int] = set()  # workers started, not yet done with (_message Note [results told])
        # workers that said STARTED, until their death is settled (the result handler's): tasks go to them first
        self.started: set[int] = set()

    def put(self, task) -> None:
        """Pickle ``task`` (job, i, func, args, kwds) and add it to the ready ones (sent at once if a slot has room,
        else by the result handler as soon as one does), waiting while they weigh ``ready_max``; raises what
        pickling raised (the task's error)."""
        job, i = task[:2]
        result = self.cache.get(job)
        inputs = getattr(result, "call_inputs", None)  # the executor's: one table for the calls of one map
        if inputs is None and getattr(result, "once_per_call", False):
            inputs = self.cache.inputs.setdefault(job, {})
        head = pickle.dumps((job, i))
        # may raise: the task's error (_reductions Note [inputs once per call])
        packet = Packet(task, head=head, inputs=inputs)
        batched = packet.plain and not getattr(result, "alone", False)
        weight = 1 if batched else BATCH_MAX
        with self.lock:
            while not self.closed and self.broken is None and self.weight >= self.ready_max:
                self.waiting = True
                self.cond.wait()
            if self.closed:
                packet.discard()
            elif self.broken is not None:  # checked under the lock: break_ fails the ready tasks once, before
                packet.discard()
                self.failed.append((job, i, self.broken))
            else:
                self.ready.append(((job, i), packet, len(head) if batched else None))
                self.weight += weight
                if min(map(len, self.sent[:self.active])) < DEPTH:  # else no slot takes it now
                    self._send_ready()
        self.settle_failed()

    def stop(self) -> None:
        """A stop sentinel to every slot (once; none after close or terminate began)."""
        with self.lock:
            if not (self.stopped or self.closed):
                self.stopped = True
                head = pickle.dumps(None)
                for q in self.queues:
                    Packet(None, head=head).send(q._writer._sock)

    def _send_ready(self, take_back: bool = True) -> None:
        """Send ready tasks to the active slots holding fewest unfinished messages while they hold fewer than DEPTH
        (the lock held; among those, a started worker's first), each message one task or a batch (Note [batches]);
        with none ready, move to a slot holding none a message queued behind a running one or for a worker that
        takes none (unless ``take_back`` is False: ``balance`` does it later), but not after sending one: it went to
        a slot holding fewest, whose worker takes it at once if idle (moving it then cost every call a round trip:
        a message sent, taken back and sent again before its worker woke; a starting worker's is moved when
        another says STARTED, by ``balance``)."""
        sent_one = False
        while True:
            lengths = list(map(len, self.sent[:self.active]))
            least = min(lengths)
            k = next((i for i, n in enumerate(lengths) if n == least and self._started(i)), lengths.index(least))
            if not self.ready:
                if take_back and not sent_one and not self.sent[k]:
                    self._take_back(k)
                return
            if len(self.sent[k]) >= DEPTH:
                return
            items = self._take_batch(min(self.n, -(-len(self.ready) // self.active)))
            if self.waiting and self.weight <= self.ready_max // 2:
                self.waiting = False
                self.cond.notify()  # the task handler pickles the next ones in a burst, not one by one
            buffers = message(items)
            try:  # never blocks: the queue holds DEPTH messages
                if len(items) == 1:
                    items[0][1].send(self.queues[k]._writer._sock, kept=True)  # _message Note [kept counts]
                else:
                    shm_core.send_fds(self.queues[k]._writer._sock, buffers)
                    for _, packet, _ in items:
                        packet.sent_along()
                    _stats.counts[_stats.MESSAGES_SENT] += 1
            except Exception as e:
                for task, packet, _ in items:
                    packet.discard()
                    self.failed.append((*task, e))
                continue
            sent_one = True
            size = sum(memoryview(b).nbytes for b in buffers)
            tasks = collections.deque(task for task, _, _ in items)
            self.sent[k].append([tasks, size, items])
            for task in tasks:
                self.owner[task] = k

    def _started(self, k: int) -> bool:
        """Slot ``k``'s worker said STARTED."""
        w = self.workers[k]
        return w is not None and w.pid in self.started

    def _take_batch(self, n: int) -> list[tuple]:
        """The ready tasks for the next message (the lock held): one that goes alone, or up to ``n`` that may be
        batched (Note [batches])."""
        first = self.ready.popleft()
        if first[2] is None:
            self.weight -= BATCH_MAX
            return [first]
        items, size = [first], len(first[1].buffers[1])
        while len(items) < n and self.ready and self.ready[0][2] is not None:
            size += len(self.ready[0][1].buffers[1])
            if size > BATCH_BYTES:
                break
            items.append(self.ready.popleft())
        self.weight -= len(items)
        return items

    def settle_failed(self) -> None:
        """Fail the tasks that could not be sent with their error. Each thread that sends calls this after
        sending: it sees its own failures without the lock."""
        if not self.failed:
            return
        with self.lock:
            failed, self.failed = self.failed, []
        for job, i, e in failed:
            result = self.cache.get(job)
            if result is not None:
                result._set(i, (False, e))

    def _take_back(self, k: int) -> None:
        """Move to slot ``k`` the first message not taken yet of another slot (the lock held; Note [lost tasks])."""
        for w, sent in enumerate(self.sent):
            queued_now = queued(sent, queued_bytes(self.queues[w])) if sent else 0
            if not queued_now:
                continue
            try:
                data, fds, _ = recv_fds(self.queues[w]._reader._sock, INLINE + 16, MAX_FDS + 1, socket.MSG_DONTWAIT)
            except OSError:  # its worker took them (BlockingIOError), or no descriptor free: they stay
                continue
            # the first one still queued: its worker may have taken some more meanwhile, in order
            n = next((n for n in range(len(sent) - queued_now, len(sent)) if message_bytes(sent[n][2]) == data),
                     None)
            if n is None:
                for fd in fds:
                    os.close(fd)
                raise AssertionError(f"a message taken back from slot {w} is none of those it was sent")
            moved = sent[n]
            del sent[n]
            try:
                shm_core.send_fds(self.queues[k]._writer._sock, [data], fds)  # unchanged, counts and all
            except OSError as e:
                for task in moved[0]:
                    del self.owner[task]
                    self.failed.append((*task, e))
                continue
            finally:
                for fd in fds:
                    os.close(fd)
            self.sent[k].append(moved)
            for task in moved[0]:
                self.owner[task] = k
            return

    def _finish(self, task, k: int | None) -> bool | None:
        """Mark ``task`` finished if it is unfinished (and in slot ``k`` if given): whether that finished its
        message, None if it was not unfinished (the lock held; the caller sends ready tasks after)."""
        k2 = self.owner.get(task)
        if k2 is None or (k is not None and k2 != k):
            return None
        del self.owner[task]
        sent = self.sent[k2]
        for n, (tasks, _, _) in enumerate(sent):  # a worker runs its tasks in order: the first, as a rule
            if tasks[0] == task:
                tasks.popleft()
            elif task in tasks:
                tasks.remove(task)
            else:
                continue
            if tasks:
                return False
            _settle(sent[n])
            del sent[n]
            return True
        raise AssertionError(f"task {task} owned by slot {k2} is in none of its messages")

    def results(self, done: list[tuple]) -> list[bool]:
        """Mark the tasks whose results came finished, ``done`` holding ((job, i), seconds its worker says it
        took) each (Note [batches]): for each, whether it was unfinished (else it was settled already)."""
        with self.lock:
            known, room, per_task = [], False, self.per_task
            for task, seconds in done:
                finished = self._finish(task, None)
                known.append(finished is not None)
                room = room or bool(finished)
                if finished is not None and type(seconds) is float:
                    per_task = seconds if per_task is None else 0.75 * per_task + 0.25 * seconds
            if self.batches and per_task is not None:
                self.per_task = per_task
                self.n = max(1, min(BATCH_MAX, int(BATCH_TIME / max(per_task, 1e-9))))
            if room:  # a message finished: its slot has room
                self._send_ready(take_back=False)  # (a task may come before the handler's balance: the executor's)
            return known

    def balance(self) -> None:
        """With no task ready, move a message queued behind a running one to a slot left with nothing to do
        (Note [lost tasks]): the result handler's, once it has delivered what it read (a front that sends a task
        as a result arrives, the executor, has sent it to the idle slot by then, and nothing is moved)."""
        if not self.ready and not all(self.sent[:self.active]):
            with self.lock:
                self._send_ready()

    def exited(self, w, how: tuple) -> None:
        """Record the death of ``w`` (reaped, the lock held) with the messages it took (Note [lost tasks]) and
        ``how`` it died (the watchdog's record)."""
        k = self.workers.index(w)
        self.workers[k] = None
        self.clock.reset(k)  # its task is over: the watchdog looks at the slot's next worker only
        taken = list(self.sent[k])
        del taken[len(taken) - queued(taken, queued_bytes(self.queues[k])):]
        self.deaths.append((k, w.pid, w.exitcode, taken, how))

    def lost(self, k: int, taken: list) -> tuple | None:
        """Settle the death of slot ``k``'s worker, which took the messages ``taken``, once every result it sent
        is read: the task it was running (its first unfinished one) is lost, and returned; those after it in its
        batch, never started, are ready again, first in line (Note [batches])."""
        with self.lock:
            items = {item[0]: item for message_ in taken for item in message_[2]}
            unfinished = [task for message_ in taken for task in message_[0]]
            running, again = None, []
            for task in unfinished:
                if self._finish(task, k) is None:
                    continue
                if running is None:
                    running = task
                elif not self.closed and self.broken is None:
                    again.append(items[task])
            self.ready.extendleft(reversed(again))
            self.weight += sum(1 if item[2] is not None else BATCH_MAX for item in again)
            self._send_ready()
            return running

    def break_(self, error: BaseException) -> None:
        """Fail every unfinished task and every later one with ``error`` (Note [start failures]; core Note
        [helper threads])."""
        with self.lock:
            if self.broken is not None:
                return
            self.broken = error
            while self.ready:
                (job, i), packet, _ = self.ready.popleft()
                packet.discard()
                self.failed.append((job, i, error))
            self.weight = 0
            for (job, i) in list(self.owner):
                del self.owner[job, i]
                self.failed.append((job, i, error))
            # no worker starts again to take the messages queued (one still alive that takes one maps it while
            # the caller's array holds it, else fails a task failed already)
            self._settle_sent()
            self.cond.notify_all()
        self.settle_failed()

    def done_with(self, pids) -> None:
        """Every result the workers ``pids`` (dead, or all of them once the pool is joined) sent is read: the
        counts they told the daemon of and the pool never took go back (_message Note [results told])."""
        pids = [pid for pid in pids if pid in self.senders]
        if pids:
            self.senders.difference_update(pids)
            shm_manager.done_with(pids)

    def take_deaths(self) -> list[tuple]:
        """The deaths recorded (none without the lock: the worker handler nudges the result handler after it
        records one, so one missed here is read at its next wake)."""
        if not self.deaths:
            return []
        with self.lock:
            deaths, self.deaths = self.deaths, []
            return deaths

    def close(self) -> None:
        """No more tasks: discard the ready ones, and wake a put waiting for room (its task is discarded)."""
        with self.lock:
            self.closed = True
            while self.ready:
                self.ready.popleft()[1].discard()
            self.weight = 0
            self.cond.notify_all()

    def drain(self) -> None:
        """Give back the shared memory of the tasks left in the slots (the workers are gone)."""
        for q in self.queues:
            drain(q)
        with self.lock:
            self._settle_sent()

    def _settle_sent(self) -> None:
        """Forget every message sent (the lock held): no worker will take one again (Note [kept counts])."""
        for sent in self.sent:
            for message_ in sent:
                _settle(message_)
        self.sent = [collections.deque() for _ in self.sent]

    def close_queues(self) -> None:
        for q in (*self.queues, self.short):
            q.close()
        self.clock.close()


def _settle(sent_message: list) -> None:
    """A message sent to a slot is done with: its packet gives back the counts it kept (Note [kept counts])."""
    items = sent_message[2]
    if len(items) == 1:  # (a batch is of plain tasks: nothing kept)
        items[0][1].settle()
