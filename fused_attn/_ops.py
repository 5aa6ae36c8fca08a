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


# torch.compile calls ensure_loaded at trace time and treats the result as a constant
# instead of tracing the build into the graph. This is what
# torch._dynamo.assume_constant_result does; setting the marker directly keeps
# `import fused_attn` from importing torch._dynamo (~3 s).
ensure_loaded._dynamo_marked_constant = True  # type: ignore[attr-defined]
