"""The mutation harness's own contract (the mutations themselves run with python -m tests.mutations)."""

from __future__ import annotations

import pytest

from tests import mutations


def test_every_anchor_matches_exactly_once():
    """A mutation whose anchor moved would plant nothing: the code it targets changed, update it."""
    bad = {m.name: mutations.anchor_count(mutations.ROOT, m) for m in mutations.MUTATIONS}
    assert {k: n for k, n in bad.items() if n != 1} == {}


def test_names_are_unique_and_every_mutation_changes_its_file():
    names = [m.name for m in mutations.MUTATIONS]
    assert len(names) == len(set(names))
    assert all(m.old != m.new and m.tests for m in mutations.MUTATIONS)


def test_apply_refuses_a_missing_or_repeated_anchor(tmp_path):
    (tmp_path / "f.py").write_text("a = 1\na = 1\nb = 2\n")
    with pytest.raises(LookupError, match=r"anchor found 2 times in f.py"):
        mutations.apply(tmp_path, mutations.Mutation("x", "f.py", "a = 1", "a = 3", ("t",)))
    with pytest.raises(LookupError, match=r"anchor found 0 times in f.py"):
        mutations.apply(tmp_path, mutations.Mutation("x", "f.py", "c = 1", "c = 3", ("t",)))
    mutations.apply(tmp_path, mutations.Mutation("x", "f.py", "b = 2", "b = 5", ("t",)))
    assert (tmp_path / "f.py").read_text() == "a = 1\na = 1\nb = 5\n"


def test_a_mutant_builds_its_library_in_its_copy(tmp_path, monkeypatch):
    """A GPU mutant's library must not land in the user's FUSED_ATTN_CACHE: with the same flags it would take the
    checkout's build directory, and a process loading the library meanwhile would run the mutant."""
    seen = {}

    def fake_run(cmd, cwd, env, **kwargs):
        seen.update(cwd=cwd, env=env)
        return mutations.subprocess.CompletedProcess(cmd, 0, "1 passed\n", "")

    monkeypatch.setenv("FUSED_ATTN_CACHE", str(tmp_path / "user-cache"))
    monkeypatch.setattr(mutations.subprocess, "run", fake_run)
    copy = tmp_path / "copy"
    assert mutations.run_tests(copy, ("tests/test_x.py",), 10)[0] == 0
    assert seen["cwd"] == copy and seen["env"]["PYTHONPATH"] == str(copy)
    assert seen["env"]["FUSED_ATTN_CACHE"] == str(copy / ".fused_attn_cache")
