"""dev.probe_gemm_rows' tile on the CPU: its shared-memory layout, ldmatrix addresses and mma.sync fragments
emulated lane by lane from the PTX ISA's fragment tables (ldmatrix .m8n8.x4: lanes 8i..8i+7 give matrix i's row
addresses, lane l receives row l / 4, elements 2 (l % 4) and +1 of each matrix; mma .m16n8k16 .row.col: A's
registers {a0 a1} rows g, {a2 a3} rows g + 8, {a4 a5} row g at k + 8, {a6 a7} row g + 8 at k + 8, B's {b0 b1} k 2t,
{b2 b3} k 2t + 8 at column g, D's d0 d1 row g, d2 d3 row g + 8, columns 2t and 2t + 1; g = l / 4, t = l % 4), with
the kernel's index formulas copied from its source: one 64-wide k step of a block gives x . w^T."""

from __future__ import annotations

import torch


def swz(row: int, chunk: int) -> int:
    return row * 128 + ((chunk ^ (row & 7)) << 4)


def store_tile(tile: torch.Tensor) -> torch.Tensor:
    """A [64, 64] tile as the kernel's cp.asyncs lay it out: 128-byte rows of eight swizzled 16-byte chunks
    (thread c copies row c / 8, chunk c % 8), as halves indexed by byte offset / 2."""
    smem = torch.full((64 * 64,), float("nan"), dtype=torch.float64)
    for c in range(512):
        r, ch = c >> 3, c & 7
        off = swz(r, ch) // 2
        smem[off:off + 8] = tile[r, ch * 8:ch * 8 + 8]
    return smem


def ldmatrix_x4(smem: torch.Tensor, addrs: list[int]) -> list[list[tuple[float, float]]]:
    """regs[lane][i] = the two halves lane receives of matrix i; addrs[lane]: the byte address lane supplies."""
    regs = [[None] * 4 for _ in range(32)]
    for i in range(4):
        rows = [smem[addrs[8 * i + r] // 2: addrs[8 * i + r] // 2 + 8] for r in range(8)]
        for lane in range(32):
            row = rows[lane // 4]
            regs[lane][i] = (row[2 * (lane % 4)].item(), row[2 * (lane % 4) + 1].item())
    return regs


def mma(acc, a, b0, b1):
    """acc[lane][0..3] += the m16n8k16 product of the lanes' A registers a[lane][0..3] and B registers b0, b1."""
    A = torch.zeros(16, 16, dtype=torch.float64)
    B = torch.zeros(16, 8, dtype=torch.float64)
    for lane in range(32):
        g, t = lane // 4, lane % 4
        for reg, (row, k) in enumerate(((g, 2 * t), (g + 8, 2 * t), (g, 2 * t + 8), (g + 8, 2 * t + 8))):
            A[row, k], A[row, k + 1] = a[lane][reg]
        B[2 * t, g], B[2 * t + 1, g] = b0[lane]
        B[2 * t + 8, g], B[2 * t + 9, g] = b1[lane]
    D = A @ B
    for lane in range(32):
        g, t = lane // 4, lane % 4
        for i, (row, col) in enumerate(((g, 2 * t), (g, 2 * t + 1), (g + 8, 2 * t), (g + 8, 2 * t + 1))):
            acc[lane][i] += D[row, col].item()


def test_one_k_step_is_the_tile_product():
    gen = torch.Generator().manual_seed(1)
    w = torch.randint(-4, 5, (64, 64), generator=gen).double()  # 64 weight columns x 64 k
    x = torch.randint(-4, 5, (64, 64), generator=gen).double()  # 64 x rows x 64 k
    w_smem, x_smem = store_tile(w), store_tile(x)
    out = torch.full((64, 64), float("nan"), dtype=torch.float64)  # [x row, weight column]
    for warp in range(8):
        mt, nh = warp & 3, warp >> 2
        acc = [[[0.0] * 4 for _ in range(32)] for _ in range(4)]  # [j][lane][i]
        for kk in range(4):
            af = ldmatrix_x4(w_smem, [swz(mt * 16 + (lane & 15), kk * 2 + (lane >> 4)) for lane in range(32)])
            for jp in range(2):
                addrs = []
                for lane in range(32):
                    q = lane >> 3
                    row = nh * 32 + jp * 16 + (q >> 1) * 8 + (lane & 7)
                    addrs.append(swz(row, kk * 2 + (q & 1)))
                bf = ldmatrix_x4(x_smem, addrs)
                mma(acc[2 * jp], af, [bf[lane][0] for lane in range(32)], [bf[lane][1] for lane in range(32)])
                mma(acc[2 * jp + 1], af, [bf[lane][2] for lane in range(32)], [bf[lane][3] for lane in range(32)])
        for j in range(4):
            for lane in range(32):
                for i in range(4):
                    row = nh * 32 + j * 8 + (lane & 3) * 2 + (i & 1)
                    col = mt * 16 + (lane >> 2) + (i >> 1) * 8
                    assert torch.isnan(out[row, col]), (row, col)  # each output written once
                    out[row, col] = acc[j][lane][i]
    assert torch.equal(out, x @ w.t())


def test_swizzle_spreads_an_ldmatrix_phase_over_the_banks():
    """The eight rows one ldmatrix matrix reads (same chunk) land in eight different 16-byte bank groups."""
    for chunk in range(8):
        for base in range(0, 64, 8):
            groups = {(swz(base + r, chunk) % 128) // 16 for r in range(8)}
            assert len(groups) == 8
