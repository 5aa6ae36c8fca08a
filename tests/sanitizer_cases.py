"""A small GPU subset for compute-sanitizer (memcheck, racecheck): odd sizes, every
launch-shape class, long rows, fully masked rows, masks, both versions, and the backward.

    compute-sanitizer --tool memcheck  python tests/sanitizer_cases.py
    compute-sanitizer --tool racecheck python tests/sanitizer_cases.py --quick

Exits non-zero if any result differs from the float64 reference.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fused_attn import reference  # noqa: E402
from fused_attn.softmax import scaled_masked_softmax, scaled_masked_softmax_backward  # noqa: E402
from tests.test_softmax import scores_of  # noqa: E402
from tests.tolerances import assert_close, softmax_tolerance  # noqa: E402


def main(argv: list[str]) -> int:
    quick = "--quick" in argv  # racecheck is slow: one dtype, one length per launch class
    g = torch.Generator(device="cuda").manual_seed(0)
    cases = 0
    lengths = (3, 65, 1023, 1025, 2049, 5001, 8193, 32769) if quick else (
        1, 3, 33, 65, 129, 257, 513, 1023, 1025, 2049, 4097, 5001, 8192, 8193, 16385, 32769)
    dtypes = (torch.float16,) if quick else (torch.float32, torch.float16, torch.bfloat16)
    for sk in lengths:
        for dtype in dtypes:
            for version in (0, 1):
                sq = 5 if sk < 4096 else 2
                x = torch.randn(2, 3, sq, sk, device="cuda", generator=g).to(dtype)
                keep = torch.rand(2, 1, sq, sk, device="cuda", generator=g) > 0.3
                keep[0, :, 0] = False  # fully masked row
                add = torch.randn(1, 1, 1, sk, device="cuda", generator=g).to(dtype)
                for causal, mask in ((True, None), (False, keep), (True, add)):
                    out = torch.full_like(x, float("nan"))
                    scaled_masked_softmax(x, 0.3, causal=causal, attn_mask=mask, out=out, version=version)
                    want = reference.scaled_masked_softmax(x, 0.3, causal=causal, attn_mask=mask)
                    assert_close(out, want, softmax_tolerance(want.double(), scores_of(x, 0.3, causal, mask), dtype),
                                 f"sk={sk} {dtype} v{version} causal={causal}")
                    cases += 1
                    if version == 1:  # the backward kernel (its launch classes follow sk too)
                        dy = torch.randn(x.shape, device="cuda", generator=g).to(dtype)
                        dx = scaled_masked_softmax_backward(dy, out, 0.3, causal=causal)
                        want_dx = reference.scaled_masked_softmax_backward(dy, out, 0.3, causal=causal)
                        assert_close(dx, want_dx, 1e-5 + 2e-2 * want_dx.abs().double(),
                                     f"backward sk={sk} {dtype} causal={causal}")
                        cases += 1
    x = torch.randn(4, 7, 5, device="cuda")[..., 1:]  # misaligned, scalar path
    scaled_masked_softmax(x, causal=True)
    torch.cuda.synchronize()
    print(f"sanitizer cases: {cases} passed")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
