"""FastDiv32 and FastDiv (csrc/common/fastdiv.cuh): the kernels' divisions by launch-time counts, as a multiply-high,
an add and a shift (FastDiv: with a 64-bit division past 2^31). Quotients and remainders against Python's divmod, on the host side of nvcc's compilation (the same
inline function the kernels call), at the divisors and dividends where a rounding error would show: powers of two
and their neighbours, the int range's ends, exact multiples and their predecessors, and seeded random pairs. CPU
only; skipped without nvcc (CI has it)."""

from __future__ import annotations

import random
import subprocess

import pytest

from tests.host_programs import host_binary

MAX = 2**31 - 1

PROGRAM = r"""
#include <cstdio>
#include "common/fastdiv.cuh"
int main(int argc, char** argv) {
  if (argc > 1) {  // FastDiv: 64-bit divisor and dividend
    long long d, n;
    while (std::scanf("%lld %lld", &d, &n) == 2) std::printf("%lld\n", (long long)fused_attn::FastDiv(d).div(n));
    return 0;
  }
  int d, n;
  while (std::scanf("%d %d", &d, &n) == 2) {
    fused_attn::FastDiv32 f(d);
    int q, r;
    f.divmod(n, q, r);
    std::printf("%d %d %d\n", q, r, f.mod(n));
  }
  return 0;
}
"""


@pytest.fixture(scope="module")
def fastdiv_binary(tmp_path_factory):
    return host_binary(tmp_path_factory.mktemp("fastdiv"), "fastdiv", PROGRAM)


def pairs() -> list[tuple[int, int]]:
    rng = random.Random(20261130)
    divisors = {1, 2, 3, 5, 7, 12, 16, 17, 31, 32, 33, 48, 64, 96, 100, 127, 128, 129, 255, 256, 257, 4095, 4096,
                4097, 65535, 65536, 65537, MAX - 1, MAX, 2**30 - 1, 2**30, 2**30 + 1}
    divisors |= {rng.randrange(1, MAX) >> rng.randrange(31) or 1 for _ in range(60)}
    out = []
    for d in sorted(divisors):
        dividends = {0, 1, d - 1, d, d + 1, MAX, MAX - 1, 2**30, 2**30 - 1}
        dividends |= {m * d + e for m in (1, 2, 3, 1000, MAX // d) for e in (-1, 0, 1)}
        dividends |= {rng.randrange(0, MAX + 1) for _ in range(40)} | set(range(0, 64))
        out += [(d, n) for n in sorted(dividends) if 0 <= n <= MAX]
    return out


def test_quotient_and_remainder_match_divmod(fastdiv_binary):
    cases = pairs()
    r = subprocess.run([str(fastdiv_binary)], input="".join(f"{d} {n}\n" for d, n in cases), capture_output=True,
                       text=True, check=True)
    got = [tuple(map(int, line.split())) for line in r.stdout.splitlines()]
    assert len(got) == len(cases)
    wrong = [(d, n, g) for (d, n), g in zip(cases, got) if g != (*divmod(n, d), n % d)]
    assert not wrong, f"{len(wrong)} of {len(cases)} wrong, e.g. (d, n, (q, r, mod)) {wrong[:5]}"


def test_a_divisor_below_one_divides_by_one(fastdiv_binary):
    """The launchers build divisors from positive counts; a smaller one is taken as 1 (the constructor's
    contract), never a division by zero or a garbage multiplier."""
    r = subprocess.run([str(fastdiv_binary)], input="0 17\n-5 9\n", capture_output=True, text=True, check=True)
    assert r.stdout.split() == ["17", "0", "0", "9", "0", "0"]


def test_fastdiv_quotient_matches_floor_division(fastdiv_binary):
    """FastDiv (the softmax's): the fast path for 0 <= n < 2^31 and 1 <= d < 2^31, the 64-bit division past
    either end (n and d up to 2^40, where the fast path's 32-bit multiply would be wrong)."""
    cases = pairs()
    cases += [(d, n) for d in (1, 3, 7, 1000, 2**31 - 1, 2**31, 2**31 + 1, 2**35 + 3)
              for n in (0, 5, 2**31 - 1, 2**31, 2**31 + 1, 2**32 + 7, 2**40 + 11)]
    r = subprocess.run([str(fastdiv_binary), "64"], input="".join(f"{d} {n}\n" for d, n in cases),
                       capture_output=True, text=True, check=True)
    got = [int(line) for line in r.stdout.splitlines()]
    assert len(got) == len(cases)
    wrong = [(d, n, g) for (d, n), g in zip(cases, got) if g != n // d]
    assert not wrong, f"{len(wrong)} of {len(cases)} wrong, e.g. (d, n, quotient) {wrong[:5]}"
