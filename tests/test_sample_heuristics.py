"""sample's blocks a row (csrc/sample/sample_heuristics.h, sample_blocks_per_row), on the host side of nvcc's
compilation: enough blocks to spread a row (4096 columns each), at most 8 (a portable cluster), at most one wave of
blocks at two an SM, and then as many as let every row's cluster be resident at once, given how many clusters of
each size the device holds. The expected counts are the header's rules worked by hand for 132 SMs and the cluster
counts listed with each case. CPU only; skipped without nvcc (CI has it)."""

from __future__ import annotations

import subprocess

import pytest

from tests.host_programs import host_binary

PROGRAM = r"""
#include <cstdio>
#include "sample/sample_heuristics.h"
int main() {
  long long rows, vocab;
  int sms, at_once[9];
  while (std::scanf("%lld %lld %d", &rows, &vocab, &sms) == 3) {
    for (int b = 2; b <= 8; ++b) std::scanf("%d", &at_once[b]);
    std::printf("%d\n", fused_attn::sample_blocks_per_row(rows, vocab, sms, [&](int b) { return at_once[b]; }));
  }
  return 0;
}
"""

SMS = 132
# Clusters of 2..8 blocks held at once: a device whose GPCs leave some SMs out of the larger clusters (62 of 4 is
# what Nsight Compute gave the kernel on an H200), and one that holds every cluster the blocks allow (2 x 132 / b).
GPCS = (132, 84, 62, 48, 42, 34, 32)
FULL = tuple(2 * SMS // b for b in range(2, 9))
NONE = (0,) * 7  # the query failed

CASES = [
    # (rows, vocab, clusters held) -> blocks a row
    ((1, 50257, GPCS), 8),      # 13 by columns, capped at a cluster of 8
    ((16, 50257, GPCS), 8),     # 264 / 16 = 16 by the wave: 8
    ((32, 50257, GPCS), 8),     # 264 / 32 = 8: 32 clusters of 8, all held
    ((33, 50257, GPCS), 7),     # 264 / 33 = 8, but 33 clusters of 8 > 32 held: 7 (34 held)
    ((48, 50257, GPCS), 5),     # 264 / 48 = 5: 48 held
    ((49, 50257, GPCS), 4),     # 49 > 48 of 5: 4 (62 held)
    ((64, 50257, GPCS), 3),     # 264 / 64 = 4: 64 > 62 held, 3 (84 held)
    ((64, 50257, FULL), 4),     # a device that holds 66 clusters of 4
    ((100, 50257, GPCS), 2),    # 264 / 100 = 2
    ((133, 50257, GPCS), 1),    # past a wave of 2-block rows: one block a row, no cluster
    ((1, 4096, GPCS), 1),       # one block's columns
    ((1, 4097, GPCS), 2),
    ((3, 12289, GPCS), 4),      # 4 by columns
    ((64, 50257, NONE), 1),     # no cluster count known: no row split
    ((1, 50257, NONE), 1),
    ((0, 50257, GPCS), 8),      # no rows: the one-row count (nothing is launched)
]


@pytest.fixture(scope="module")
def rule_binary(tmp_path_factory):
    return host_binary(tmp_path_factory.mktemp("sample_heuristics"), "sample_heuristics", PROGRAM)


def test_blocks_per_row_rule(rule_binary):
    lines = "".join(f"{r} {v} {SMS} {' '.join(map(str, held))}\n" for (r, v, held), _ in CASES)
    r = subprocess.run([str(rule_binary)], input=lines, capture_output=True, text=True, check=True)
    got = [int(x) for x in r.stdout.split()]
    wrong = [(case, g, w) for (case, w), g in zip(CASES, got) if g != w]
    assert len(got) == len(CASES) and not wrong, f"(rows, vocab, clusters held), got, want: {wrong}"
