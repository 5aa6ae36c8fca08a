"""dev.probe_cluster_pdl's host side (the probe itself needs an sm_90 GPU: run it with
`python -m dev.probe_cluster_pdl` on one)."""

from __future__ import annotations

import argparse

import pytest
import torch

from dev.probe_cluster_pdl import int_list, main, summarize


def test_cluster_sizes_parse_or_name_the_argument():
    assert int_list("1,2,16") == [1, 2, 16]
    for bad in ("", "0", "4,x", "-2"):
        with pytest.raises(argparse.ArgumentTypeError, match=r"must be a comma list of positive integers, got"):
            int_list(bad)


def test_summary_is_relative_to_the_producers_last_block_end():
    ends = torch.tensor([10_000, 30_000, 20_000])  # ns: the last block ends at 30 us
    stamps = torch.tensor([[25_000, 31_000, 32_000], [29_000, 31_500, 32_000], [40_000, 41_000, 42_000]])
    s = summarize(ends, stamps)
    assert s["entry_median"] == pytest.approx(-1.0) and s["entry_latest"] == pytest.approx(10.0)
    assert s["early_pct"] == pytest.approx(200 / 3) and s["wait_median"] == pytest.approx(1.5)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-GPU message")
def test_without_a_gpu_it_says_so():
    with pytest.raises(SystemExit) as e:
        main([])
    assert e.value.code == 2
