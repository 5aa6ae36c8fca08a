"""dev.transformers_gpt2_suite's pure logic: which implementation a request becomes, which call means a model
escaped the forcing, how a test's reports fold into one outcome, and the comparison of two modes (the suite
itself needs transformers' test tree)."""

from __future__ import annotations

import pytest

from dev.transformers_gpt2_suite import compare, escaped_forcing, fold_outcome, forced_implementation


@pytest.mark.parametrize("requested, expected", [
    (None, "fused_attn"), ("sdpa", "fused_attn"), ("flash_attention_2", "fused_attn"),
    ("flex_attention", "fused_attn"), ("kernels-community/flash-attn2", "fused_attn"),
    ("eager", "eager"), ("paged|sdpa", "paged|sdpa"), ("paged|eager", "paged|eager"),
])
def test_forced_implementation_keeps_only_eager_and_paged_requests(requested, expected):
    assert forced_implementation(requested, "fused_attn") == expected


@pytest.mark.parametrize("called, forced, escaped", [
    ("fused_attn", "fused_attn", False), ("eager", "fused_attn", False), ("paged|sdpa", "fused_attn", False),
    ("sdpa", "fused_attn", True), ("flex_attention", "fused_attn", True),
    ("eager", "eager", False), ("sdpa", "eager", True), ("fused_attn", "eager", True),
])
def test_escaped_forcing_flags_any_other_implementation_called(called, forced, escaped):
    assert escaped_forcing(called, forced) is escaped


@pytest.mark.parametrize("phases, expected", [
    ([("setup", "passed", False), ("call", "passed", False), ("teardown", "passed", False)], "passed"),
    ([("setup", "skipped", False), ("teardown", "passed", False)], "skipped"),
    ([("setup", "failed", False), ("teardown", "passed", False)], "error"),
    ([("setup", "passed", False), ("call", "passed", False), ("teardown", "failed", False)], "error"),
    # a failed subtest fails the test even though the test's own call report passed
    ([("setup", "passed", False), ("call", "failed", False), ("call", "passed", False)], "failed"),
    ([("setup", "passed", False), ("call", "skipped", False), ("call", "passed", False)], "passed"),
    ([("setup", "passed", False), ("call", "skipped", True)], "xfailed"),
    ([("setup", "passed", False), ("call", "passed", True)], "xpassed"),
])
def test_fold_outcome(phases, expected):
    assert fold_outcome(phases) == expected


def test_compare_lists_each_test_whose_outcome_differs():
    eager = {"outcomes": {"a": "passed", "b": "failed", "c": "skipped", "d": "passed"}, "messages": {"b": "E1"}}
    fused = {"outcomes": {"a": "passed", "b": "failed", "c": "passed", "e": "passed"}, "messages": {}}
    result = compare({"eager": eager, "fused_attn": fused})
    assert result["counts"] == {"eager": {"passed": 2, "failed": 1, "skipped": 1},
                                "fused_attn": {"passed": 3, "failed": 1}}
    assert [(d["test"], d["eager"], d["fused_attn"]) for d in result["differences"]["fused_attn"]] == [
        ("c", "skipped", "passed"), ("d", "passed", "absent"), ("e", "absent", "passed")]


def test_compare_finds_no_difference_in_equal_outcomes():
    report = {"outcomes": {"a": "passed", "b": "failed"}, "messages": {}}
    assert compare({"eager": report, "fused_attn": report})["differences"] == {}
