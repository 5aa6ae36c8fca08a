"""The stream check the GPU tests of every op share: an op launches on the current stream and never
synchronizes the host."""

from __future__ import annotations

import torch


def on_side_stream_without_sync(dst: torch.Tensor, src: torch.Tensor, call):
    """Returns ``call()`` run on a new stream right after a 50M-cycle sleep and the copy of ``src``
    into ``dst`` there, with torch's sync debug mode raising on any host synchronization: a launch
    on another stream would read ``dst`` before the copy, one that syncs raises."""
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        torch.cuda.set_sync_debug_mode("error")
        try:
            torch.cuda._sleep(50_000_000)
            dst.copy_(src)
            out = call()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    s.synchronize()
    return out
