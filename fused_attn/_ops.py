"""Loading the compiled library once per process, and Python-side registrations
(fake implementations, CPU kernels) that run right after it is loaded."""

from __future__ import annotations

from typing import Callable

import torch

_loaded = False
_after_load: list[Callable[[], None]] = []


def after_load(fn: Callable[[], None]) -> Callable[[], None]:
    """Run ``fn`` once the library is loaded (now, if it already is)."""
    _after_load.append(fn)
    if _loaded:
        fn()
    return fn


# torch.compile runs this at trace time instead of tracing the build into the graph.
@torch._dynamo.assume_constant_result
def ensure_loaded() -> bool:
    """Build (first time on this machine) and load the CUDA library; idempotent."""
    global _loaded
    if not _loaded:
        from fused_attn import build

        torch.ops.load_library(str(build.library_path()))
        _loaded = True
        for fn in _after_load:
            fn()
    return True


def is_loaded() -> bool:
    return _loaded
