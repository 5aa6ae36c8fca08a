"""bench.report on small saved runs: softmax, GPT-2 and an op it has never seen (CPU only)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import report

RUN = Path(__file__).parent / "data" / "bench_softmax_small.json"
GPT2_RUN = Path(__file__).parent / "data" / "bench_gpt2_small.json"
GPT2_COLS = ["batch", "prompt", "dtype", "backend", "tokens/s", "TTFT ms", "TBT p50 ms", "TBT p95 ms", "x hf-eager",
             "same tokens as hf-eager"]


def _kernel_rows(run: dict, family: int = 0) -> list[dict]:
    """The sorted rows of the run's kernel function number ``family`` (0: forward softmax)."""
    return report.families(run, "provider")[family].rows


def test_report_writes_every_file(tmp_path):
    bytes_txt = tmp_path / "bytes.txt"
    bytes_txt.write_text("DRAM bytes per call ...\nTrue    fused_v1        1       302.1     103.8     175.8\n")
    assert report.main([str(RUN), "--out", str(tmp_path / "r"), "--bytes", str(bytes_txt)]) == 0
    out = tmp_path / "r"
    run = json.loads(RUN.read_text())
    v1 = next(b["extra_info"] for b in run["benchmarks"]
              if b["extra_info"]["provider"] == "fused_v1" and b["extra_info"]["causal"])
    micro = (out / "micro.txt").read_text()
    assert "NVIDIA H200" in micro and run["machine_info"]["fused_attn"]["commit"] in micro
    assert f"{v1['p50_us']:.1f}" in micro
    memory = (out / "memory.txt").read_text()
    assert "measured with Nsight Compute" in memory and "302.1" in memory
    assert "No end-to-end model cases" in (out / "gpt2.txt").read_text()
    md = (out / "report.md").read_text()
    assert "| shape [B,H,N,N] |" in md and "![scaled_masked_softmax_8x12_float16_causal]" in md
    png = out / "scaled_masked_softmax_8x12_float16_causal.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_report_speedups_match_the_run(tmp_path):
    report.main([str(RUN), "--out", str(tmp_path), "--no-plots"])
    rows = _kernel_rows(json.loads(RUN.read_text()))
    lines = (tmp_path / "micro.txt").read_text().splitlines()
    for r in rows:
        if "speedup_vs_eager" in r:
            line = next(ln for ln in lines if ln.startswith("x".join(map(str, r["shape"])))
                        and f" {r['provider']} " in ln and (" yes " in ln) == r["causal"])
            assert f"{r['speedup_vs_eager']:.2f}" in line


def test_report_shows_the_same_bytes_copy_and_the_empty_kernel(tmp_path):
    run = json.loads(RUN.read_text())
    for i, b in enumerate(run["benchmarks"]):
        b["extra_info"].update(pct_of_same_bytes_copy=50.0 + i / 10, launch_floor_us=2.34)
    path = tmp_path / "run.json"
    path.write_text(json.dumps(run))
    report.main([str(path), "--out", str(tmp_path / "r"), "--no-plots"])
    lines = (tmp_path / "r" / "micro.txt").read_text().splitlines()
    assert "empty kernel 2.34 us" in lines[0]
    header = next(i for i, ln in enumerate(lines) if ln.startswith("shape"))
    col = lines[header].index("% same-bytes copy") + len("% same-bytes copy")
    by_name = {b["name"]: b["extra_info"] for b in run["benchmarks"]}
    rows = _kernel_rows(run)
    for r, line in zip(rows, lines[header + 1:]):
        assert line[col - 6:col].strip() == f"{by_name[r['name']]['pct_of_same_bytes_copy']:.1f}"


def test_report_rejects_a_file_that_is_not_a_benchmark_run(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    with pytest.raises(SystemExit) as exc:
        report.main([str(bad), "--out", str(tmp_path / "r")])
    assert exc.value.code == 2 and "bad.json must be a pytest-benchmark JSON file" in capsys.readouterr().err


def _table_rows(lines: list[str], after: int = 0) -> list[list[str]]:
    """Whitespace-split rows of the first text table at or after line index `after`."""
    start = next(i for i in range(after, len(lines)) if lines[i].startswith("batch "))
    rows = []
    for ln in lines[start + 1:]:
        if not ln.strip():
            break
        rows.append(ln.split())
    return rows


def test_gpt2_table_columns_order_and_values(tmp_path):
    assert report.main([str(GPT2_RUN), "--out", str(tmp_path)]) == 0
    lines = (tmp_path / "gpt2.txt").read_text().splitlines()
    header = next(ln for ln in lines if ln.startswith("batch "))
    pos = [header.index(c) for c in GPT2_COLS]
    assert pos == sorted(pos)
    rows = _table_rows(lines)
    assert [(r[0], r[1], r[3]) for r in rows] == [("1", "128", "hf-eager"), ("1", "128", "hf-fused"),
                                                  ("1", "128", "graph"), ("16", "128", "graph"),
                                                  ("16", "512", "hf-sdpa")]
    e = next(b["extra_info"] for b in json.loads(GPT2_RUN.read_text())["benchmarks"]
             if b["name"] == "bench_gpt2[graph-b1-p128-float16]")
    assert rows[2] == ["1", "128", "float16", "graph", f"{e['tokens_per_s']:.1f}", f"{e['ttft_ms']:.3f}",
                       f"{e['tbt_p50_ms']:.3f}", f"{e['tbt_p95_ms']:.3f}", f"{e['speedup_vs_hf_eager']:.2f}", "yes"]
    md = (tmp_path / "report.md").read_text().splitlines()
    i = md.index("| " + " | ".join(GPT2_COLS) + " |")
    assert md[i + 1] == "|" + "---|" * len(GPT2_COLS)
    assert md[i + 4].startswith("| 1 | 128 | float16 | graph | ")


def test_gpt2_missing_optional_fields_print_a_dash(tmp_path):
    report.main([str(GPT2_RUN), "--out", str(tmp_path)])
    rows = _table_rows((tmp_path / "gpt2.txt").read_text().splitlines())
    assert [r[-2:] for r in rows if r[0] == "16"] == [["-", "-"], ["-", "-"]]
    md = (tmp_path / "report.md").read_text()
    assert "| 16 | 512 | float16 | hf-sdpa | 2168.0 | 10.539 | 5.953 | 12.195 | - | - |" in md
    data = json.loads(GPT2_RUN.read_text())
    for b in data["benchmarks"]:
        for k in ("ttft_ms", "speedup_vs_hf_eager", "tokens_match_hf_eager"):
            b["extra_info"].pop(k, None)
    data["benchmarks"][0]["extra_info"]["tokens_match_hf_eager"] = False
    fam = report.families(data, "backend")[0]
    header, *lines = report.model_table(fam, False)
    assert "TTFT ms" not in header and "x hf-eager" not in header  # no case has them
    assert header.split()[-4:] == ["same", "tokens", "as", "hf-eager"]
    assert [ln.split()[-1] for ln in lines].count("no") == 1 and [ln.split()[-1] for ln in lines].count("-") == 4


def test_gpt2_only_runs_make_a_report_without_softmax_tables_or_plots(tmp_path):
    runs = []
    for name in ("bench_gpt2_b1.json", "bench_gpt2_b16.json"):
        runs.append(tmp_path / name)
        runs[-1].write_text(GPT2_RUN.read_text())
    out = tmp_path / "r"
    assert report.main([*map(str, runs), "--out", str(out)]) == 0
    for name in ("micro.txt", "memory.txt"):
        text = (out / name).read_text()
        assert text.count("No kernel cases (with a provider) in this run.") == 2
        assert "shape [B,H,N,N]" not in text and "p50 spread" not in text
    assert not list(out.glob("*.png"))
    lines = (out / "gpt2.txt").read_text().splitlines()
    heads = [i for i, ln in enumerate(lines) if ln.startswith("# NVIDIA H200 (driver 580.159.04)")]
    assert len(heads) == 2 and all("commit b9b3a2b (with uncommitted changes)" in lines[i] for i in heads)
    assert [lines[i + 1].split(";")[0] for i in heads] == ["# source: bench_gpt2_b1.json",
                                                          "# source: bench_gpt2_b16.json"]
    assert all(len(_table_rows(lines, i)) == 5 for i in heads)
    md = (out / "report.md").read_text()
    assert md.count("## GPT-2 end to end: NVIDIA H200") == 2
    assert "scaled_masked_softmax" not in md and "## Plots" not in md


def _fake_profile(d: Path, backends: list[str]) -> None:
    head = "gpt2-random on NVIDIA H200, torch.float16, batch 1, prompt 128, 32 new tokens"
    d.mkdir()
    (d / "profile.md").write_text(f"# GPT-2 profile: {head}\n\n## graph\n")
    for i, b in enumerate(backends):
        (d / f"layers_{b}.txt").write_text(f"# {b}: {head}\n{'part':<12} {'device us':>16} {'share':>7}\n"
                                           f"{'attention':<12} {100.0 + i:>16.1f} {100.0:>6.1f}%\n"
                                           f"{'total':<12} {100.0 + i:>16.1f}\n")
        (d / f"kernels_{b}.txt").write_text(f"# {b}: {head}\n{'kernel':<80} {'device us':>11} {'launches':>9} "
                                            f"{'per token':>9}\n{'gemm_kernel_' + b:<80} {90.0:>11.1f} {40:>9} "
                                            f"{1.2:>9.1f}\n{'all kernels':<80} {1234.5 + i:>11.1f} {420:>9} "
                                            f"{13.1:>9.1f}\n")


def test_profile_summary_is_appended(tmp_path):
    prof = tmp_path / "prof"
    _fake_profile(prof, ["graph", "hf-eager"])
    assert report.main([str(GPT2_RUN), "--out", str(tmp_path / "r"), "--profile", str(prof)]) == 0
    text = (tmp_path / "r" / "gpt2.txt").read_text()
    tail = text[text.index("# GPT-2 profile: gpt2-random on NVIDIA H200"):]
    assert f"full tables: {prof}/profile.md" in tail
    assert tail.index("\nhf-eager\n") < tail.index("\ngraph\n")  # backend order, not file-name order
    assert "all kernels: 1234.5 device us, 420 launches, 13.1 per token" in tail
    assert "all kernels: 1235.5 device us" in tail and "attention" in tail and "101.0" in tail
    assert "gemm_kernel" not in tail
    md = (tmp_path / "r" / "report.md").read_text()
    assert "## GPT-2 profile: gpt2-random" in md and "all kernels: 1234.5 device us" in md


def test_profile_without_profile_md_says_so(tmp_path):
    assert report.main([str(GPT2_RUN), "--out", str(tmp_path / "r"), "--profile", str(tmp_path)]) == 0
    assert f"no profile.md in {tmp_path}" in (tmp_path / "r" / "gpt2.txt").read_text()


def test_gpt2_interleaved_comparison_is_named(tmp_path):
    data = json.loads(GPT2_RUN.read_text())
    run = tmp_path / "run.json"
    run.write_text(json.dumps(data))
    report.main([str(run), "--out", str(tmp_path / "plain")])
    assert "interleaved" not in (tmp_path / "plain" / "gpt2.txt").read_text()
    for b in data["benchmarks"]:
        if b["extra_info"]["backend"] == "hf-fused":
            b["extra_info"]["interleaved_hf_eager"] = {"tokens_per_s": 1.0}
    run.write_text(json.dumps(data))
    report.main([str(run), "--out", str(tmp_path / "paired")])
    assert "x hf-eager of hf-fused: against hf-eager rounds interleaved" in (tmp_path / "paired" / "gpt2.txt").read_text()
    for b in data["benchmarks"]:
        if b["extra_info"]["backend"] == "hf-fused":
            del b["extra_info"]["interleaved_hf_eager"]
            b["extra_info"] |= dict(interleaved_peer="hf-sdpa", interleaved={"tokens_per_s": 1.0})
    run.write_text(json.dumps(data))
    report.main([str(run), "--out", str(tmp_path / "sdpa")])
    assert "x hf-sdpa of hf-fused: against hf-sdpa rounds interleaved" in (tmp_path / "sdpa" / "gpt2.txt").read_text()


def test_backward_cases_get_their_own_tables(tmp_path):
    run = json.loads(RUN.read_text())
    forward = len(_kernel_rows(run))
    renamed = {"fused_v1": "fused", "eager": "eager", "compiled": "compiled"}
    bwd = []
    for b in run["benchmarks"]:
        provider = b["extra_info"]["provider"]
        if provider in renamed:
            c = json.loads(json.dumps(b))
            c["name"] = c["name"].replace("bench_scaled_masked_softmax[", "bench_scaled_masked_softmax_backward[")
            c["extra_info"].update(provider=renamed[provider], p50_us=1000.0 + len(bwd),
                                   modeled_bytes=10**6 * (1 + len(bwd)))
            bwd.append(c)
    run["benchmarks"] += bwd
    path = tmp_path / "run.json"
    path.write_text(json.dumps(run))
    assert report.main([str(path), "--out", str(tmp_path / "r"), "--no-plots"]) == 0
    assert len(_kernel_rows(run)) == forward
    assert len(_kernel_rows(run, 1)) == len(bwd)
    micro = (tmp_path / "r" / "micro.txt").read_text()
    fwd_part, bwd_part = micro.split("# scaled_masked_softmax backward (dx from dy and y): ")
    assert " fused " not in fwd_part and "1000.0" not in fwd_part
    assert all(f"{1000.0 + i:.1f}" in bwd_part for i in range(len(bwd))) and " fused " in bwd_part
    assert "x compiled" in fwd_part and "x compiled" in bwd_part
    assert "x compiled_iota" not in micro  # a column no case of the table has is left out
    memory = (tmp_path / "r" / "memory.txt").read_text().split("backward (dx from dy and y)")[1]
    fused_line = next(ln for ln in memory.splitlines() if " fused " in ln)
    assert fused_line.split()[-1] == "1.00"
    assert "## scaled_masked_softmax backward (dx from dy and y)" in (tmp_path / "r" / "report.md").read_text()


def test_gpt2_clock_is_stated(tmp_path):
    data = json.loads(GPT2_RUN.read_text())
    for i, b in enumerate(data["benchmarks"]):
        b["extra_info"].update(clock="cuda events at each token", max_clock_vs_wall_pct=0.01 * i)
    run = tmp_path / "run.json"
    run.write_text(json.dumps(data))
    report.main([str(run), "--out", str(tmp_path / "r")])
    assert "clock: cuda events at each token (largest difference 0.040%)" in (tmp_path / "r" / "gpt2.txt").read_text()


def _decode_run() -> dict:
    """A run of an op the report has no labels for: another parameter, TFLOP/s, a baseline named sdpa_flash."""
    benches = []
    for headdim in (64, 128):
        for sk in (1024, 4096):
            for provider, us in (("sdpa_flash", 20.0), ("fused_attn", 10.0)):
                info = dict(provider=provider, shape=[4, 16, 1, sk], dtype="bfloat16", headdim=headdim,
                            p50_us=us * sk / 1024, tflops=1.5, modeled_bytes=sk * us * 100)
                if provider == "fused_attn":
                    info["speedup_vs_sdpa_flash"] = 2.0
                benches.append(dict(name=f"bench_decode[{provider}-{sk}-{headdim}]",
                                    fullname=f"bench/bench_decode.py::bench_decode[{provider}-{sk}-{headdim}]",
                                    params={"case": dict(shape=info["shape"], dtype="bfloat16", headdim=headdim,
                                                         provider=provider)},
                                    extra_info=info, stats={"median": us * 1e-6}))
    run = json.loads(RUN.read_text())
    run["benchmarks"] = benches
    return run


def test_an_unknown_op_gets_its_columns_and_plots_from_the_data(tmp_path):
    path = tmp_path / "decode.json"
    path.write_text(json.dumps(_decode_run()))
    assert report.main([str(path), "--out", str(tmp_path / "r")]) == 0
    lines = (tmp_path / "r" / "micro.txt").read_text().splitlines()
    assert lines[0].startswith("# decode: NVIDIA H200")
    assert lines[2].split() == ["shape", "dtype", "headdim", "provider", "p50", "us", "TFLOP/s", "x", "sdpa_flash"]
    assert [ln.split()[2:4] for ln in lines[3:7]] == [["64", "sdpa_flash"], ["64", "fused_attn"],
                                                       ["64", "sdpa_flash"], ["64", "fused_attn"]]
    assert lines[4].split()[-1] == "2.00" and lines[3].split()[-1] == "-"
    memory = (tmp_path / "r" / "memory.txt").read_text().splitlines()
    assert [ln.split()[-1] for ln in memory[3:5]] == ["2.00", "1.00"]  # x fused: over fused_attn's bytes
    assert sorted(p.name for p in (tmp_path / "r").glob("*.png")) == ["decode_4x16x1_bfloat16_128.png",
                                                                       "decode_4x16x1_bfloat16_64.png"]


def test_the_default_out_dir_is_outside_the_checkout():
    assert Path(__file__).resolve().parents[1] not in report.DEFAULT_OUT.resolve().parents


def test_readme_table_has_one_row_per_case_of_our_provider(tmp_path):
    """readme.md (the README's tables): one row per (shape, dtype, causal) of fused_v1, every provider's
    p50 of that case in its own column, our speedups from the run."""
    report.main([str(RUN), "--out", str(tmp_path), "--no-plots"])
    rows = _kernel_rows(json.loads(RUN.read_text()))
    ours = [r for r in rows if r["provider"] == "fused_v1"]
    lines = [ln for ln in (tmp_path / "readme.md").read_text().splitlines() if ln.startswith("| ")]
    header, body = lines[0], lines[1:]
    assert "| fused_v1 us |" in header and "| eager us |" in header and "| provider |" not in header
    assert len(body) >= len(ours)
    for r in ours:
        line = next(ln for ln in body if ln.startswith("| " + "x".join(map(str, r["shape"])))
                    and (" yes " in ln) == r["causal"])
        eager = next(e for e in rows if e["provider"] == "eager" and e["shape"] == r["shape"]
                     and e["causal"] == r["causal"])
        assert f" {r['p50_us']:.1f} " in line and f" {eager['p50_us']:.1f} " in line
        assert f" {r['speedup_vs_eager']:.2f} " in line


def test_gpt2_table_shows_the_floors_where_a_case_has_them():
    """bench_gpt2's % of the weight floor and of the step-bytes floor (weights + K/V cache): a column each
    once any case has it, "-" where a case has not (a run without measured ceilings)."""
    data = json.loads(GPT2_RUN.read_text())
    data["_path"] = str(GPT2_RUN)
    for i, b in enumerate(data["benchmarks"]):
        if i % 2 == 0:
            b["extra_info"].update(pct_of_weight_floor=30.0 + i, pct_of_step_floor=40.0 + i)
    fam = report.families(data, "backend")[0]
    header, *lines = report.model_table(fam, False)
    assert header.index("TBT p95 ms") < header.index("% weight floor") < header.index("% step floor")
    for i, b in enumerate(data["benchmarks"]):
        e = b["extra_info"]
        row = [ln for ln in lines if ln.split()[:4] == [str(e["batch"]), str(e["prompt"]), e["dtype"], e["backend"]]]
        assert len(row) == 1
        want = f"{30.0 + i:.1f}" if i % 2 == 0 else "-"
        assert row[0].split()[8] == want, (row, want)


def test_gpt2_sampled_cases_get_a_sample_column():
    """bench_gpt2's ``sample`` flag is a case parameter its extra_info does not repeat: a greedy and a sampled
    case of one batch, prompt, dtype and backend are two rows told apart by a "sample" column (the report
    of 0150ea5's H100 GPT-2 matrix printed them as if greedy)."""
    data = json.loads(GPT2_RUN.read_text())
    data["_path"] = str(GPT2_RUN)
    greedy = next(b for b in data["benchmarks"] if b["name"] == "bench_gpt2[graph-b1-p128-float16]")
    sampled = json.loads(json.dumps(greedy))
    sampled["name"] = "bench_gpt2[graph-b1-p128-float16-sample]"
    sampled["extra_info"].update(temperature=0.8, top_k=50, tokens_per_s=1234.5)
    for b, flag in ((greedy, False), (sampled, True)):
        b["params"] = {"gpt2_case": {k: b["extra_info"][k] for k in ("batch", "prompt", "dtype", "backend")}
                       | {"sample": flag}}
    data["benchmarks"].append(sampled)
    fam = report.families(data, "backend")[0]
    header, *lines = report.model_table(fam, False)
    assert header.split()[:5] == ["batch", "prompt", "dtype", "backend", "sample"]
    rows = [ln.split() for ln in lines if ln.split()[:4] == ["1", "128", "float16", "graph"]]
    assert [(r[4], r[5]) for r in rows] == [("yes", "1234.5"), ("no", f"{greedy['extra_info']['tokens_per_s']:.1f}")]
    assert all(len(ln.split()) == len(rows[0]) for ln in lines)  # cases without the flag print a dash


# The headline charts and the README's results table, from the stored runs (bench/results).
RESULTS = Path(__file__).resolve().parent.parent / "bench" / "results"


def _stored_case(gpu_name: str, function: str, provider: str, case_tail: str) -> dict:
    folder = RESULTS / report.gpu_folder_name(gpu_name)
    newest = report.newest_cases(folder)
    (bench,) = [b for b, _ in newest.values() if b["name"] == f"{function}[{provider}-{case_tail}]"]
    return bench["extra_info"]


def test_results_table_numbers_equal_the_stored_json():
    rows = report.headline_rows(RESULTS)
    ops = {r["op"] for r in rows}
    assert {"GPT-2 decode", "softmax", "decode_attention", "mlp", "sample"} <= ops
    for r in rows:
        function = next((f for f, (op, _, _) in report.PEERS.items() if op == r["op"]), "bench_gpt2")
        prefix = f"{function}[{r['ours']}-"
        stored = report.newest_cases(RESULTS / report.gpu_folder_name(r["gpu"])).values()
        tail = next(b["name"][len(prefix):-1] for b, _ in stored
                    if b["name"].startswith(prefix) and b["extra_info"][r["metric"]] == r["ours_value"])
        ours = _stored_case(r["gpu"], function, r["ours"], tail)
        peer = _stored_case(r["gpu"], function, r["peer"], tail)
        assert (r["ours_value"], r["peer_value"]) == (ours[r["metric"]], peer[r["metric"]])
        line = next(ln for ln in report.results_table([r]) if ln.startswith(f"| {r['gpu']} "))
        assert f"{r['ours']} {ours[r['metric']]:g} " in line and f"{r['peer']} {peer[r['metric']]:g} " in line
        o, q = ours[r["metric"]], peer[r["metric"]]
        want = o / q if r["metric"] == "tokens_per_s" else q / o
        assert f"| {want:.2f}x |" in line
    (h200_b1,) = [r for r in rows if (r["gpu"], r["op"], r["shape"]) == ("NVIDIA H200", "GPT-2 decode", "b1-p128")]
    assert h200_b1["ours"] == "graph-fused" and h200_b1["peer"] == "compile-graph"


def test_readme_table_goes_between_the_markers_and_nowhere_else(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text(f"# title\n\nbefore\n{report.BEGIN}\nold table\n{report.END}\nafter\n")
    assert report.main(["--results", str(RESULTS), "--charts", str(tmp_path / "c"), "--readme", str(readme)]) == 0
    text = readme.read_text()
    assert text.startswith("# title\n\nbefore\n" + report.BEGIN + "\n| GPU | commit | dtype |")
    assert text.endswith(report.END + "\nafter\n") and "old table" not in text
    rows = report.current_rows(report.headline_rows(RESULTS))
    assert len({r["gpu"] for r in rows}) == 1  # one GPU: the one with the newest stored run
    assert sum(ln.startswith("| NVIDIA") for ln in text.splitlines()) == len(rows)
    for name in ("gpt2_decode.png", "ops_speedup.png"):
        assert (tmp_path / "c" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("text", ["# no markers\n", f"{report.END}\n{report.BEGIN}\n",
                                  f"{report.BEGIN}\n{report.BEGIN}\n{report.END}\n"])
def test_readme_without_its_markers_is_refused_and_untouched(tmp_path, capsys, text):
    readme = tmp_path / "README.md"
    readme.write_text(text)
    with pytest.raises(SystemExit) as e:
        report.main(["--results", str(RESULTS), "--charts", str(tmp_path / "c"), "--readme", str(readme)])
    assert e.value.code == 2
    assert "must hold the markers <!-- results:begin --> and <!-- results:end -->" in capsys.readouterr().err
    assert readme.read_text() == text and not (tmp_path / "c").exists()  # nothing written at all


def test_headline_charts_go_to_the_default_out_unless_told(tmp_path, monkeypatch, capsys):
    """With no argument the tool writes into its default folder (under the system's temporary directory,
    test_the_default_out_dir_is_outside_the_checkout) and prints the table; the checkout is not written."""
    monkeypatch.setattr(report, "DEFAULT_OUT", tmp_path / "default")
    assert report.main([]) == 0
    assert sorted(p.name for p in (tmp_path / "default").iterdir()) == ["gpt2_decode.png", "ops_speedup.png"]
    assert "| GPU | commit | dtype | op | shape | ours | peer | ratio | % of floor |" in capsys.readouterr().out
