"""What WorkerLostError and its pieces say, without processes (mp_reductions._deaths Note [deaths explained])."""

import pickle
import signal

import mp_reductions as mpr
from mp_reductions import _deaths


def test_the_oom_counter_gives_each_count_to_one_death(tmp_path):
    events = tmp_path / "memory.events"
    events.write_text("low 0\nhigh 0\nmax 3\noom 1\noom_kill 4\n")
    counter = _deaths.OomCounter(str(events))
    assert counter.read() == 4
    assert counter.claim(4) is False  # started after the last count: not the OOM killer
    events.write_text("oom_kill 5\n")
    assert counter.claim(4) is True
    assert counter.claim(4) is False  # a second SIGKILL: that count explained the first
    assert counter.claim(None) is None
    assert _deaths.OomCounter(str(tmp_path / "missing")).claim(0) is None


def test_the_messages_say_what_is_known_and_nothing_else():
    how, why, remedy = _deaths.explain(-signal.SIGKILL, None, None)
    assert how == "died with signal SIGKILL" and why.startswith("`dmesg` says whether")
    assert remedy == "resubmit this one"
    _, why, _ = _deaths.explain(-signal.SIGKILL, False, (31 << 20, 31 << 20, 0.25))
    assert why == ("sent from outside, e.g. `kill -9` or a job scheduler: the memory cgroup counted no OOM kill (its "
                   "resident size was 31 MiB when last measured, 0.2 s before)")
    how, why, _ = _deaths.explain(3, None, None)
    assert how == "exited with code 3" and why.startswith("the task called sys.exit()")
    err = mpr.WorkerLostError(12, -signal.SIGKILL, 4, "map", "f, items 8-9", True, (600 << 20, 700 << 20, 0.1))
    assert str(err) == (
        "worker 12 died with signal SIGKILL while running task 4 of map (f, items 8-9): killed by the kernel's OOM "
        "killer: the memory cgroup counted an OOM kill while it ran (its resident size was 600 MiB, peak 700 MiB, "
        "when last measured, 0.1 s before); the pool replaced it and goes on with the other tasks; give each task "
        "less memory, use fewer processes, or raise the memory limit")
    assert str(pickle.loads(pickle.dumps(err))) == str(err)
    # the stdlib-era prefix stays: "worker PID died with signal SIGKILL while running task 0 of apply"
    assert str(mpr.WorkerLostError(5, -9, 0, "apply")).startswith("worker 5 died with signal SIGKILL while running "
                                                                  "task 0 of apply: ")
