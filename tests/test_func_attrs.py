"""FuncAttrTable (csrc/common/func_attrs.h): the launchers' kernel attributes, set once per kernel and device. Its
rule on the host side of nvcc's compilation, with a stand-in for cudaFuncSetAttribute that records every call and
fails where told: a first launch sets, a launch that needs no more does not, one that needs more sets again, a
failed set is not remembered, and kernels, devices and attributes are apart. CPU only; skipped without nvcc (CI
has it)."""

from __future__ import annotations

import subprocess

import pytest

from tests.host_programs import host_binary

# Reads lines "device kernel attr value fail" (attr 0: the shared-memory allowance, 1: large clusters; kernel: an
# index into two stand-in kernels; fail 1: the stand-in set fails) and prints, a line each, the call's result (0 ok,
# 1 failed) and the number of sets so far.
PROGRAM = r"""
#include <cstdio>
#include "common/func_attrs.h"
static char kernels[2];
int main() {
  fused_attn::FuncAttrTable table;
  int device, kernel, attr, value, fail, sets = 0;
  while (std::scanf("%d %d %d %d %d", &device, &kernel, &attr, &value, &fail) == 5) {
    const cudaFuncAttribute a = attr == 0 ? cudaFuncAttributeMaxDynamicSharedMemorySize
                                          : cudaFuncAttributeNonPortableClusterSizeAllowed;
    const cudaError_t err = table.allow(device, &kernels[kernel], a, value, [&](const void*, cudaFuncAttribute, int) {
      ++sets;
      return fail ? cudaErrorInvalidValue : cudaSuccess;
    });
    std::printf("%d %d\n", err == cudaSuccess ? 0 : 1, sets);
  }
  return 0;
}
"""


@pytest.fixture(scope="module")
def table_binary(tmp_path_factory):
    return host_binary(tmp_path_factory.mktemp("func_attrs"), "func_attrs", PROGRAM)


def run(binary, calls: list[tuple[int, int, int, int, int]]) -> list[tuple[int, int]]:
    r = subprocess.run([str(binary)], input="".join(" ".join(map(str, c)) + "\n" for c in calls),
                       capture_output=True, text=True, check=True)
    return [tuple(map(int, line.split())) for line in r.stdout.splitlines()]


def test_sets_once_and_again_only_for_more(table_binary):
    got = run(table_binary, [
        (0, 0, 0, 100_000, 0),  # first launch: set
        (0, 0, 0, 100_000, 0),  # the same: no set
        (0, 0, 0, 60_000, 0),   # less: no set
        (0, 0, 0, 120_000, 0),  # more: set again
        (0, 0, 0, 110_000, 0),  # below the new allowance: no set
    ])
    assert got == [(0, 1), (0, 1), (0, 1), (0, 2), (0, 2)]


def test_kernels_devices_and_attributes_apart(table_binary):
    got = run(table_binary, [
        (0, 0, 0, 100_000, 0),
        (1, 0, 0, 100_000, 0),  # another device: set there too
        (0, 1, 0, 100_000, 0),  # another kernel
        (0, 0, 1, 1, 0),        # another attribute of the same kernel
        (1, 0, 0, 100_000, 0),  # all remembered
        (0, 1, 0, 100_000, 0),
        (0, 0, 1, 1, 0),
    ])
    assert [sets for _, sets in got] == [1, 2, 3, 4, 4, 4, 4]
    assert all(err == 0 for err, _ in got)


def test_a_failed_set_is_returned_and_not_remembered(table_binary):
    got = run(table_binary, [
        (0, 0, 0, 300_000, 1),  # fails (past the device's limit): returned
        (0, 0, 0, 300_000, 1),  # tried again, fails again: not taken for done
        (0, 0, 0, 100_000, 0),  # a size that fits: set
        (0, 0, 0, 150_000, 1),  # more, failing: returned, the 100 KB allowance kept
        (0, 0, 0, 100_000, 0),  # still allowed: no set
    ])
    assert got == [(1, 1), (1, 2), (0, 3), (1, 4), (0, 4)]
