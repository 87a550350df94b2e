import os
import signal

import _targets
import mp_reductions as mpr
import numpy as np
from _suite import QueueSuite


class TestQueuesFork(QueueSuite):
    method = "fork"

    def test_killed_child_gives_back_the_named_segments_it_inherited(self, ctx):
        # the child holds the parent's named segments; the daemon gives its counts back on SIGKILL
        mpr.set_sharing_strategy("file_system")
        try:
            x = mpr.zeros_shared((100_000,), np.float64)
            ready = ctx.Event()
            p = ctx.Process(target=_targets.signal_and_sleep, args=(ready,))
            p.start()
            assert ready.wait(30)
            os.kill(p.pid, signal.SIGKILL)
            p.join(30)
            del x  # the leak check finds the segment gone
        finally:
            mpr.set_sharing_strategy("file_descriptor")
