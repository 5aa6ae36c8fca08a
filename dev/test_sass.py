"""dev.sass_load_order and dev.sass_stats: their SASS and ptxas-log parsing (CPU), and the staged GEMVs'
load order from a real build (needs nvcc and cuobjdump). Run by hand: `python3 -m pytest dev`."""

from __future__ import annotations

import shutil

import pytest


# The staged 16-row tensor-core GEMVs issue every x piece of a group before their first weight read
# (dev/sass_load_order.py; the fence in mma_walk_pieces). A performance property of the compiled code,
# checked from SASS: without the fence ptxas put three of six pieces behind the weights' arrival.
_SASS_STAGED = """
        Function : _ZN10fused_attn6linear17linear_mma_kernelI6__halfLi2ELb1ELb1ELb0ELb0EEEvNS_12LinearParamsE
        /*0100*/  @!P2 LDG.E.NA.LTC256B.128.CONSTANT R16, desc[UR6][R8.64] ;  /* 0x0 */
        /*0110*/  ACQBULK ;  /* 0x0 */
        /*0120*/  LDGSTS.E.128 [R5], desc[UR6][R40.64], P1 ;  /* 0x0 */
        /*0130*/  {between}  /* 0x0 */
        /*0140*/  LDGSTS.E.128 [R5+0x200], desc[UR6][R36.64], P2 ;  /* 0x0 */
        /*0150*/  HMMA.16816.F32 R44, R36, R40, R44 ;  /* 0x0 */
"""


@pytest.mark.parametrize("between, late", [("IMAD.MOV.U32 R38, RZ, RZ, R17 ;", 1),  # reads a weight register
                                           ("IMAD.MOV.U32 R17, RZ, RZ, R2 ;", 0),    # writes one: not a read
                                           ("IMAD.MOV.U32 R38, RZ, RZ, R29 ;", 0)])  # another register
def test_sass_load_order_counts_pieces_behind_a_weight_read(between, late):
    from dev import sass_load_order as order

    funcs = order.functions(_SASS_STAGED.format(between=between))
    (lines,) = funcs.values()
    assert order.issue_order(lines) == (2, late)


# Staged builds: fp16 / bf16 x whole-K / split-K x (twelve plain builds: three activations x bias / residual
# present or not, linear_kernel.cuh's with_build_epilogue).
def test_staged_gemv_issues_x_before_its_first_weight_read(capsys):
    from dev import sass_load_order as order
    if shutil.which("nvcc") is None:
        pytest.skip("needs the CUDA toolkit (nvcc)")
    if order.find_cuobjdump() is None:
        pytest.skip("needs cuobjdump (CUDA toolkit, PATH or Triton's copy)")
    rc = order.main([])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert out.count("staged") == 2 * 2 * 3 * 4, out


_PTXAS_LOG = """ptxas info    : Compiling entry function '_Z1kv' for 'sm_90a'
ptxas info    : Function properties for _Z1kv
    8 bytes stack frame, 8 bytes spill stores, 16 bytes spill loads
ptxas info    : Used 80 registers, used 1 barriers, 8 bytes cumulative stack size, 24576 bytes smem
ptxas info    : Function properties for _Z1jv
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 78 registers, used 1 barriers, 24576 bytes smem
"""
_SASS_COUNTS = """
        Function : _Z1kv
        /*0000*/  STL [R1], R12 ;  /* 0x0 */
        /*0010*/  LDG.E.NA.LTC256B.128.CONSTANT R16, desc[UR6][R8.64] ;  /* 0x0 */
        /*0020*/  ACQBULK ;  /* 0x0 */
        /*0030*/  NOP ;  /* 0x0 */
        /*0040*/  LDG.E.128 R40, desc[UR6][R2.64] ;  /* 0x0 */
        /*0050*/  HMMA.16816.F32 R44, R36, R40, R44 ;  /* 0x0 */
        /*0060*/  HMMA.16816.F32 R44, R36, R40, R44 ;  /* 0x0 */
        /*0070*/  LDL.LU R10, [R1] ;  /* 0x0 */
        /*0080*/  STG.E.U16 desc[UR6][R4.64], R10 ;  /* 0x0 */
        /*0090*/  EXIT ;  /* 0x0 */
"""


def test_sass_stats_reads_ptxas_usage_and_static_counts():
    from dev import sass_load_order as order
    from dev import sass_stats

    assert sass_stats.ptxas_usage(_PTXAS_LOG) == {"_Z1kv": (80, 8, 16), "_Z1jv": (78, 0, 0)}
    (lines,) = order.functions(_SASS_COUNTS).values()
    # 9 without the NOP; 2 before the wait; the wait and a load up to the first MMA; 3 after the last MMA; one
    # STL and one LDL
    assert sass_stats.counts(lines) == (9, 2, 2, 3, 2)
