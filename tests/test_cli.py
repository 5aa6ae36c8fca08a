"""The command-line tools with a newcomer's input: an ordinary mistake gets one line on stderr and exit
code 2 (argparse's convention), `--help` names `python -m <package>.<tool>` and every default, and no
tool writes into the checkout unless told to."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench import bytes as bench_bytes
from bench import ab, gate, history, merge, profile, report
from fused_attn import build
from fused_attn import generate as gen_cli

ROOT = Path(__file__).resolve().parent.parent


def fails_with(main, argv, capsys, message: str) -> str:
    """Runs a CLI's main(argv); it must exit 2 with `message` in one stderr line and no traceback."""
    with pytest.raises(SystemExit) as exc:
        main(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], err
    return lines[0]


# ----------------------------------------------------------------------------------------- generate

@pytest.mark.parametrize("argv, message", [
    (["--batch-size", "0"], "--batch-size must be >= 1, got 0"),
    (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1, got 0"),
    (["--prompt-len", "-3"], "--prompt-len must be >= 1, got -3"),
    (["--temperature", "-1"], "--temperature must be >= 0, got -1.0"),
    (["--prompt-ids", "1,two"], "--prompt-ids must be comma-separated integers, got '1,two'"),
    (["--prompt", "Hello"], "--prompt needs a tokenizer and gpt2-random has none: give token ids with --prompt-ids"),
])
def test_generate_rejects_ordinary_mistakes_before_loading_a_model(argv, message, capsys, monkeypatch):
    import fused_attn.gpt2

    monkeypatch.setattr(fused_attn.gpt2, "load_hf_model", lambda *a: pytest.fail("loaded a model"))
    line = fails_with(gen_cli.main, argv, capsys, message)
    assert line.startswith("python -m fused_attn.generate: error: ")


@pytest.mark.parametrize("argv, message", [
    (["--prompt-len", "1000", "--max-new-tokens", "30"],
     "prompt + left padding + --max-new-tokens must fit in gpt2-random's 1024 positions, got 1000 + 0 + 30 = 1030"),
    (["--prompt-len", "1000", "--max-new-tokens", "20", "--batch-size", "6"],
     "got 1000 + 5 + 20 = 1025"),
    (["--prompt-ids", "1,50257"], "--prompt-ids must be token ids in [0, 50257), got [1, 50257]"),
])
def test_generate_rejects_prompts_the_model_cannot_take(argv, message, capsys):
    pytest.importorskip("transformers")
    fails_with(gen_cli.main, argv, capsys, message)


def test_generate_prompt_text_without_a_tokenizer_is_one_line_from_the_command_line():
    r = subprocess.run([sys.executable, "-m", "fused_attn.generate", "--prompt", "Hello"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip() == ("python -m fused_attn.generate: error: --prompt needs a tokenizer and gpt2-random "
                                "has none: give token ids with --prompt-ids (e.g. --prompt-ids 464,2068,7586) or a "
                                "--model with a tokenizer (e.g. gpt2)")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU label of the graph backend")
def test_generate_on_the_cpu_labels_the_graph_backend_as_what_it_runs(capsys):
    pytest.importorskip("transformers")
    assert gen_cli.main(["--backend", "graph", "--prompt-len", "4", "--max-new-tokens", "2", "--dtype", "float32"]) == 0
    out = capsys.readouterr().out
    assert "graph-eager TTFT" in out and "graph " not in out.replace("graph-eager", ""), out


@pytest.mark.skipif(torch.cuda.is_available(), reason="auto's choice without a GPU")
def test_generate_auto_on_the_cpu_runs_hf_eager_and_says_why(capsys):
    pytest.importorskip("transformers")
    assert gen_cli.main(["--prompt-len", "4", "--max-new-tokens", "2", "--dtype", "float32"]) == 0
    out = capsys.readouterr().out
    assert "--backend auto: hf-eager (no GPU: our model runs the reference PyTorch ops there" in out, out
    assert "hf-eager  TTFT" in out, out


@pytest.mark.skipif(torch.cuda.is_available(), reason="--compare's choice without a GPU")
def test_generate_compare_on_the_cpu_names_each_backend_it_leaves_out(capsys, monkeypatch):
    pytest.importorskip("transformers")
    ran = []

    def fake_run(backend, hf_model, ids, mask, max_new_tokens, *args):
        ran.append(backend)
        return gen_cli.Result(backend, torch.cat([ids, ids[:, :max_new_tokens]], 1), 0.01, [0.01] * (max_new_tokens - 1))

    monkeypatch.setattr(gen_cli, "run_backend", fake_run)
    assert gen_cli.main(["--compare", "--prompt-len", "4", "--max-new-tokens", "2", "--dtype", "float32"]) == 0
    out = capsys.readouterr().out
    for b in gen_cli.GPU_ONLY:
        assert f"--compare: {b} left out, it needs a GPU and there is none" in out, out
    assert set(ran) == set(gen_cli.BACKENDS) - set(gen_cli.GPU_ONLY), ran


def test_generate_help_has_one_line_per_backend(capsys):
    with pytest.raises(SystemExit):
        gen_cli.main(["--help"])
    out = capsys.readouterr().out
    for name in ("auto", *gen_cli.BACKENDS):
        assert sum(line.startswith(f"  {name} ") for line in out.splitlines()) == 1, out
    assert "graph-fused" in out.split("use this one")[0].splitlines()[-1], out


# ---------------------------------------------------------------------------------- bench tools

def test_report_on_a_missing_file(tmp_path, capsys):
    fails_with(report.main, [str(tmp_path / "nope.json"), "--out", str(tmp_path / "r")], capsys,
               f"{tmp_path / 'nope.json'} must be a readable file, got no such file or directory")
    assert not (tmp_path / "r").exists()


def test_report_on_a_file_that_is_not_json(tmp_path, capsys):
    (tmp_path / "run.json").write_text("not json")
    fails_with(report.main, [str(tmp_path / "run.json"), "--out", str(tmp_path / "r")], capsys,
               "each run must be a pytest-benchmark JSON file, got invalid JSON (Expecting value at line 1)")


def test_report_on_json_that_is_not_a_run(tmp_path, capsys):
    (tmp_path / "run.json").write_text(json.dumps({"a": 1}))
    fails_with(report.main, [str(tmp_path / "run.json"), "--out", str(tmp_path / "r")], capsys,
               "run.json must be a pytest-benchmark JSON file (no 'benchmarks' key)")


def test_gate_and_history_on_a_missing_file(tmp_path, capsys):
    fails_with(gate.main, [str(tmp_path / "nope.json")], capsys, "nope.json must be a readable file")
    fails_with(history.main, ["add", str(tmp_path / "nope.json"), "--csv", str(tmp_path / "h.csv")], capsys,
               "nope.json must be a readable file")
    assert not (tmp_path / "h.csv").exists()


@pytest.mark.parametrize("shape, message", [
    ("1,2,x", "--shape must be a comma list of sizes, e.g. 8,12,1024,1024, got '1,2,x'"),
    ("1,0,4,4", "--shape must be a comma list of positive sizes, got '1,0,4,4'"),
])
def test_bytes_rejects_a_bad_shape(shape, message, capsys):
    fails_with(bench_bytes.main, ["--shape", shape], capsys, message)


def test_bytes_rejects_an_unknown_op(capsys):
    fails_with(bench_bytes.main, ["--op", "nope"], capsys, "--op must name a bench/bench_<op>.py, got 'nope'")


@pytest.mark.skipif(torch.cuda.is_available(), reason="what bench.bytes says without a GPU")
def test_bytes_without_a_gpu_says_what_it_needs(capsys):
    fails_with(bench_bytes.main, [], capsys, "bench.bytes needs a CUDA GPU and Nsight Compute (ncu) on PATH, "
                                            "found no CUDA GPU")


def test_build_without_nvcc(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("FUSED_ATTN_CACHE", str(tmp_path))
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.delenv("CUDA_PATH", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    build.find_cuda_home.cache_clear()
    try:
        fails_with(build.main, [], capsys, "fused_attn's CUDA ops need the CUDA toolkit (nvcc) to build")
    finally:
        build.find_cuda_home.cache_clear()


BUILD_PROBE = """
import sys
from pathlib import Path
from fused_attn import build
assert "torch.utils.cpp_extension" not in sys.modules
build.find_cuda_home = lambda: Path(sys.argv[1])
def stop():
    raise build.BuildError("stopped before compiling")
build.sources = stop
try:
    build.library_path()
except build.BuildError:
    pass
from torch.utils import cpp_extension
print(cpp_extension.CUDA_HOME)
"""


def test_build_tells_torchs_extension_builder_the_toolkit_it_uses(tmp_path):
    """torch's cpp_extension reads CUDA_HOME when first imported and, without a GPU, warns with the
    toolkit it found (the nvcc wrapper's folder, say): it must be the toolkit the build uses."""
    toolkit = tmp_path / "cuda-12.9"
    env = {k: v for k, v in os.environ.items() if k not in ("CUDA_HOME", "CUDA_PATH")}
    env["FUSED_ATTN_CACHE"] = str(tmp_path / "cache")
    r = subprocess.run([sys.executable, "-c", BUILD_PROBE, str(toolkit)], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == str(toolkit)
    if not torch.cuda.is_available():
        assert f"No CUDA runtime is found, using CUDA_HOME='{toolkit}'" in r.stderr, r.stderr


# --------------------------------------------------------------------------------------- --help

MAINS = {"fused_attn.generate": gen_cli.main, "fused_attn.build": build.main, "bench.report": report.main,
         "bench.profile": profile.main, "bench.bytes": bench_bytes.main, "bench.history": history.main,
         "bench.gate": gate.main, "bench.ab": ab.main, "bench.merge": merge.main}


@pytest.mark.parametrize("tool", MAINS)
def test_help_names_the_command_and_every_default(tool, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "400")  # argparse wraps at hyphens too
    with pytest.raises(SystemExit) as exc:
        MAINS[tool](["--help"])
    out = capsys.readouterr().out
    assert exc.value.code == 0
    text = " ".join(out.split())  # argparse wraps lines
    assert text.startswith(f"usage: python -m {tool} "), out
    assert "--worker" not in text and "--causal" not in text  # internal flags (bench.bytes, bench.ab) stay hidden
    for action in _parser_actions(MAINS[tool]):
        if action.option_strings and action.default not in (None, False, argparse.SUPPRESS):
            assert f"(default: {action.default})" in text, (action.dest, out)
    if tool == "fused_attn.generate":
        assert "(default: gpt2-random)" in text and "(default: auto)" in text


# ------------------------------------------------------------------------ nothing into the checkout

def tracked_and_untracked() -> str:
    """git's view of the checkout: modified, added and untracked files (ignored ones excluded)."""
    return subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"], cwd=ROOT, capture_output=True,
                          text=True, check=True).stdout


@pytest.fixture
def checkout_unchanged(monkeypatch, tmp_path):
    """Runs a tool from the checkout's root and checks that git sees no new or changed file after it."""
    if subprocess.run(["git", "rev-parse"], cwd=ROOT, capture_output=True).returncode != 0:
        pytest.skip("needs a git checkout")
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    before = tracked_and_untracked()
    yield tmp_path
    assert tracked_and_untracked() == before


def test_report_writes_into_a_temporary_folder_by_default_and_says_so(checkout_unchanged, capsys, monkeypatch):
    out = checkout_unchanged / "report"
    monkeypatch.setattr(report, "DEFAULT_OUT", out)
    stored = sorted((ROOT / "bench" / "results").glob("*/*.json"))[0]
    assert report.main([str(stored), "--no-plots"]) == 0
    assert f"report: {out}" in capsys.readouterr().out
    assert (out / "readme.md").is_file()
    assert report.DEFAULT_OUT.is_relative_to(ROOT) is False


def test_profile_default_out_is_outside_the_checkout_and_is_named():
    import tempfile

    default = next(a.default for a in _parser_actions(profile.main) if a.dest == "out")
    assert default == Path(tempfile.gettempdir()) / "fused_attn_profile" and not default.is_relative_to(ROOT)


def _parser_actions(main):
    """The argparse actions a CLI's main builds (parse_args is stopped before it runs)."""
    seen = []

    def stop(self, *a, **k):
        seen.extend(self._actions)
        raise SystemExit(0)

    orig = argparse.ArgumentParser.parse_args
    argparse.ArgumentParser.parse_args = stop
    try:
        with pytest.raises(SystemExit):
            main([])
    finally:
        argparse.ArgumentParser.parse_args = orig
    return seen


def test_profile_writes_where_it_says(checkout_unchanged, capsys):
    pytest.importorskip("transformers")
    out = checkout_unchanged / "prof"
    assert profile.main(["--backends", "graph", "--prompt-len", "4", "--new-tokens", "2", "--out", str(out)]) == 0
    assert f"profile: {out}" in capsys.readouterr().out and (out / "profile.md").is_file()


def test_history_writes_only_the_csv_it_is_given(checkout_unchanged, capsys):
    stored = sorted((ROOT / "bench" / "results").glob("*/*.json"))[0]
    csv = checkout_unchanged / "h.csv"
    assert history.main(["add", str(stored), "--csv", str(csv)]) == 0
    assert f"{csv}: " in capsys.readouterr().out and csv.is_file()


def test_history_requires_the_csv():
    with pytest.raises(SystemExit) as exc:
        history.main(["add", "x.json"])
    assert exc.value.code == 2


def test_bytes_writes_no_file(checkout_unchanged, capsys):
    """bench.bytes prints its table (or why it cannot run) and writes nothing."""
    with pytest.raises(SystemExit):
        bench_bytes.main(["--shape", "1,2,x"])
    assert not any(checkout_unchanged.iterdir())


def test_generate_writes_no_file(checkout_unchanged, capsys):
    pytest.importorskip("transformers")
    assert gen_cli.main(["--prompt-len", "3", "--max-new-tokens", "2", "--dtype", "float32"]) == 0

