"""What a test looks at under an array: the segment it views, whether it is shared on purpose or its receiver's own
(mp_reductions._shared Note [own arrays]: ``segment_of`` and ``is_shared`` see only the first kind)."""

import numpy as np
import shm_core


def segment_under(a: np.ndarray) -> shm_core.Segment | None:
    """The segment ``a`` views (it arrived with no pickled copy), shared or its own; None for process memory."""
    base = a
    while isinstance(base, np.ndarray):
        base = base.base
    base = getattr(base, "obj", base)
    return base if isinstance(base, shm_core.Segment) else None


def via_shared_memory(a: np.ndarray) -> bool:
    return segment_under(a) is not None
