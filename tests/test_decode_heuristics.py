"""decode_attention's split rules for long caches (csrc/decode_attention/decode_attention_heuristics.h,
decode_long_splits), on the host side of nvcc's compilation: which launches take the wave rule's 16 splits (the
unsplit grid one to two waves of two blocks an SM, 32k+ keys, the cluster merge available), which the long-cache
rule's (from 128k keys: up to six blocks an SM, the count whose last round of blocks is fullest; from 32k keys with
a paged cache: six blocks an SM), and which neither (0: the general rule decides). The expected counts are the
rules' statements in the header's comments worked by hand for an H200 (132 SMs). Also which one-row launches take the
CUDA-core kernel's 256-thread build (decode_wide: batch 16 at caches up to 2048 slots). CPU only; skipped without
nvcc (CI has it)."""

from __future__ import annotations

import subprocess

import pytest

from tests.host_programs import host_binary

PROGRAM = r"""
#include <cstdio>
#include "decode_attention/decode_attention_heuristics.h"
int main() {
  long long work;
  int max_len, sms, cluster_ok, paged;
  while (std::scanf("%lld %d %d %d %d", &work, &max_len, &sms, &cluster_ok, &paged) == 5) {
    std::printf("%d\n", fused_attn::decode_long_splits(work, max_len, sms, cluster_ok != 0, paged != 0));
  }
  return 0;
}
"""

SMS = 132  # an H200
WAVE = 2 * SMS  # two blocks an SM: 264 blocks at a time

CASES = [
    # (work = batch x kv heads x row chunks, max_len, cluster_ok, paged) -> splits
    ((16 * 32, 32768, 1, 0), 16),       # batch 16 MHA 32 heads, 32k: 1.94 waves -> the wave rule
    ((16 * 32, 131072, 1, 0), 16),      # the same at 128k: the wave rule before the 128k rule
    ((WAVE, 32768, 1, 0), 16),          # exactly one wave
    ((2 * WAVE, 65536, 1, 0), 16),      # exactly two waves
    ((2 * WAVE + 1, 32768, 1, 0), 0),   # past two waves: the general rule
    ((16 * 32, 32767, 1, 0), 0),        # below 32k keys
    ((16 * 32, 8192, 1, 0), 0),
    ((16 * 32, 32768, 0, 0), 0),        # no cluster merge
    ((WAVE - 1, 32768, 1, 0), 0),       # below a wave, short of 128k
    ((32, 131072, 1, 0), 20),           # batch 1 MHA 32 heads at 128k: six blocks an SM are 24 splits (past a
    ((32, 131072, 0, 0), 20),           #   cluster); 17..24, the last round fullest at 20: 640 % 132 = 112
    ((33, 131072, 1, 0), 24),           # 33 x 24 = 6 x 132: a full last round at six blocks an SM
    ((40, 131072, 1, 0), 19),           # 17..19: 680 % 132 = 20, 720 % 132 = 60, 760 % 132 = 100
    ((44, 131072, 1, 0), 18),           # 17..18: 748 % 132 = 88, 792 % 132 = 0 (full)
    ((48, 131072, 1, 0), 0),            # six blocks an SM are 16 splits, within a cluster: the general rule
    ((256, 131072, 1, 0), 0),           # batch 8: six blocks an SM are 3 splits, within a cluster: the general rule
    ((32, 65536, 1, 0), 0),             # below 128k keys, below a wave
    ((32, 32768, 1, 1), 20),            # paged: batch 1 MHA at 32k keys takes the long-cache rule, the fullest
    ((32, 131072, 1, 1), 20),           #   last round as a contiguous cache's
    ((40, 32768, 1, 1), 19),
    ((32, 32767, 1, 1), 0),             # paged below 32k keys
    ((128, 32768, 1, 1), 0),            # paged batch 4 MHA: six blocks an SM are 6 splits, within a cluster
    ((16 * 32, 32768, 1, 1), 16),       # paged batch 16: the wave rule first
]


@pytest.fixture(scope="module")
def rule_binary(tmp_path_factory):
    return host_binary(tmp_path_factory.mktemp("decode_heuristics"), "decode_heuristics", PROGRAM)


def test_long_cache_split_rules(rule_binary):
    lines = "".join(f"{w} {n} {SMS} {c} {pg}\n" for (w, n, c, pg), _ in CASES)
    r = subprocess.run([str(rule_binary)], input=lines, capture_output=True, text=True, check=True)
    got = [int(x) for x in r.stdout.split()]
    want = [splits for _, splits in CASES]
    wrong = [(case, g, w) for (case, _), g, w in zip(CASES, got, want) if g != w]
    assert not wrong, f"(work, max_len, cluster_ok, paged), got, want: {wrong}"


WIDE_PROGRAM = r"""
#include <cstdio>
#include "decode_attention/decode_attention_heuristics.h"
int main() {
  long long batch, max_len;
  while (std::scanf("%lld %lld", &batch, &max_len) == 2) {
    std::printf("%d\n", int(fused_attn::decode_wide(batch, max_len)));
  }
  return 0;
}
"""

WIDE_CASES = [
    # (batch, max_len) -> the 256-thread build
    ((16, 192), 1),     # GPT-2 at batch 16: its grid leaves each scheduler 1-2 warps
    ((16, 2048), 1),
    ((16, 2049), 0),    # longer caches stream better on the 128-thread build
    ((15, 192), 0),     # batch 8-15: the 128-thread build
    ((8, 192), 0),
    ((17, 192), 0),     # past kDecodeWideMaxBatch: batches 32-64 measured faster on 128 threads
    ((32, 192), 0),
    ((64, 192), 0),
]


@pytest.fixture(scope="module")
def wide_binary(tmp_path_factory):
    return host_binary(tmp_path_factory.mktemp("decode_wide"), "decode_wide", WIDE_PROGRAM)


def test_wide_build_rule(wide_binary):
    lines = "".join(f"{b} {n}\n" for (b, n), _ in WIDE_CASES)
    r = subprocess.run([str(wide_binary)], input=lines, capture_output=True, text=True, check=True)
    got = [int(x) for x in r.stdout.split()]
    wrong = [(case, g, w) for (case, w), g in zip(WIDE_CASES, got) if g != w]
    assert not wrong, f"(batch, max_len), got, want: {wrong}"
