"""fused_attn.profile writes its tables and traces (CPU run; on a GPU it also lists kernels)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")

from fused_attn import profile  # noqa: E402


def test_profile_writes_layer_and_kernel_tables(tmp_path):
    assert profile.main(["--backends", "hf-eager,graph", "--prompt-len", "8", "--new-tokens", "3",
                         "--out", str(tmp_path)]) == 0
    for backend in ("hf-eager", "graph", "graph-eager"):
        assert (tmp_path / f"kernels_{backend}.txt").exists()
        json.loads((tmp_path / f"trace_{backend}.json").read_text())
    for backend in ("hf-eager", "graph-eager"):  # labelled runs: every part got time
        rows = {ln.split()[0]: float(ln.split()[1]) for ln in (tmp_path / f"layers_{backend}.txt").read_text()
                .splitlines()[2:-1]}
        assert set(rows) == set(profile.PARTS)
        assert all(rows[p] > 0 for p in ("ln_1", "attention", "ln_2", "mlp", "lm_head", "residual")), rows
    md = (tmp_path / "profile.md").read_text()
    assert "## hf-eager" in md and "## graph-eager" in md


def test_profile_rejects_an_unknown_backend(tmp_path):
    with pytest.raises(SystemExit, match=r"--backends must name .*, got 'nope'"):
        profile.main(["--backends", "nope", "--out", str(tmp_path)])
