"""bench.history: runs, A/B tables and generate printouts as rows of one CSV, plain or gzipped (CPU only)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from bench import history

DATA = Path(__file__).parent / "data"
RUN, GPT2_RUN = DATA / "bench_softmax_small.json", DATA / "bench_gpt2_small.json"
AB_ONE = """fused_v1 float16 p50 us (% of copy bandwidth), one session; copy GB/s: auto: 4195.4, early zeros: 4198.5
shape                                   auto           early zeros
8x12x512x512                   43.3 ( 55.4%)         46.7 ( 51.3%)
8x12x1024x1024 c              119.1 ( 60.5%)        118.5 ( 60.7%)
"""
AB_REPEATS = """fused_v1 float16 p50 us (% of copy bandwidth / % of read-write roofline), one session; median of 3
empty kernel us: auto: 2.85/3.01/2.72; short block 64: 2.85/2.72/2.98
shape                  same-bytes copy us                                          auto                                short block 64
1x12x128x128 c                        3.9                4.6 ( 3.1/ 3.2%) [4.6/4.6/4.5]                4.7 ( 3.0/ 3.0%) [5.0/4.5/4.6]
"""
AB_CASES = """# python3 -m pytest bench/bench_decode_attention.py --full -k 'paged- and b1-' (2 round(s), medians)
case                                                            default us  base us (x default)
bench_decode_attention[paged-b1-hq32-hkv8-d128-l8192-float16]   21.7        23.1 (1.065)
bench_decode_attention[fused-b1-hq32-hkv8-d128-l8192-float16]   21.5        -
exit status / last line                                         0: Wrote benchmark data; 0: Wrote  0: Wrote
"""
GEN = """gpt2-random on NVIDIA H200, torch.float16, batch 1, prompt 128 tokens, 128 new
hf-eager  TTFT     8.92 ms  TBT p50   7.307 ms  p95  11.282 ms      127.9 tokens/s
graph     TTFT     4.19 ms  TBT p50   0.627 ms  p95   0.631 ms     1523.5 tokens/s
"""


def _read(path: Path) -> tuple[list[str], list[dict]]:
    return history.read_table(path)


def test_runs_become_one_row_per_case_and_adding_twice_adds_nothing(tmp_path, capsys):
    table = tmp_path / "history.csv"
    assert history.main(["add", str(RUN), "--csv", str(table), "--note", "small"]) == 0
    cols, rows = _read(table)
    run = json.loads(RUN.read_text())
    assert len(rows) == len(run["benchmarks"])
    assert cols[:7] == history.KEYS and "note" not in cols
    b = run["benchmarks"][-1]
    last = rows[-1]
    assert (last["gpu"], last["op"], last["case"], last["provider"]) == (
        "NVIDIA H200", "scaled_masked_softmax", b["group"], b["extra_info"]["provider"])
    assert float(last["p50_us"]) == b["extra_info"]["p50_us"]
    assert history.read_notes(table) == {(last["source"], last["run"]): "small"}  # once, in history.notes.csv
    assert float(last["speedup_vs_eager"]) == b["extra_info"]["speedup_vs_eager"]
    history.main(["add", str(RUN), "--csv", str(table)])
    assert len(_read(table)[1]) == len(rows)
    assert capsys.readouterr().out.splitlines()[-1].endswith(f"0 rows added ({len(rows)} already there)")


def test_model_columns_join_the_table_in_one_order(tmp_path):
    table = tmp_path / "history.csv"
    history.main(["add", str(RUN), "--csv", str(table)])
    data = json.loads(GPT2_RUN.read_text())
    fused = next(b for b in data["benchmarks"] if b["extra_info"]["backend"] == "hf-fused")
    fused["extra_info"]["interleaved_hf_eager"] = dict(tokens_per_s=140.0, ttft_ms=8.0)
    gpt2 = tmp_path / "gpt2.json"
    gpt2.write_text(json.dumps(data))
    history.main(["add", str(gpt2), "--csv", str(table)])
    cols, rows = _read(table)
    assert cols.index("p50_us") < cols.index("tokens_per_s") < cols.index("speedup_vs_eager")
    assert "tokens_match_hf_eager" in cols
    paired = [r for r in rows if r["provider"] == "hf-eager (interleaved with hf-fused)"]
    assert len(paired) == 1 and paired[0]["tokens_per_s"] == "140.0" and paired[0]["tbt_p50_ms"] == ""
    fused["extra_info"] |= dict(interleaved_peer="hf-sdpa", interleaved=dict(tokens_per_s=150.0))
    del fused["extra_info"]["interleaved_hf_eager"]
    table = tmp_path / "history_sdpa.csv"
    gpt2.write_text(json.dumps(data))
    history.main(["add", str(gpt2), "--csv", str(table)])
    paired = [r for r in _read(table)[1] if r["provider"] == "hf-sdpa (interleaved with hf-fused)"]
    assert len(paired) == 1 and paired[0]["tokens_per_s"] == "150.0"
    graph = next(r for r in rows if r["provider"] == "graph" and r["case"] == "gpt2 b1 p128 float16")
    assert graph["op"] == "gpt2" and graph["p50_us"] == "" and graph["tokens_match_hf_eager"] == "yes"


def test_a_table_with_a_note_column_has_its_notes_moved_to_the_notes_table(tmp_path):
    table = tmp_path / "history.csv"
    table.write_text("commit,gpu,run,source,op,case,provider,p50_us,note\n"
                     "abc1234,NVIDIA H200,t1,a.json,softmax,s1,fused,1.5,first run\n"
                     "abc1234,NVIDIA H200,t1,a.json,softmax,s2,fused,2.5,first run\n"
                     "def5678,NVIDIA H200,t2,b.json,softmax,s1,fused,1.4,\n")
    assert history.main(["add", str(RUN), "--csv", str(table), "--note", "the new run"]) == 0
    cols, rows = _read(table)
    assert "note" not in cols and [r["p50_us"] for r in rows[:3]] == ["1.5", "2.5", "1.4"]
    run = json.loads(RUN.read_text())
    source = rows[-1]["source"]
    assert history.read_notes(table) == {("a.json", "t1"): "first run", (source, run["datetime"]): "the new run"}
    assert history.notes_path(table).name == "history.notes.csv"


@pytest.mark.parametrize("text,expected", [
    (AB_ONE, [("softmax 8x12x512x512 float16 full", "fused_v1 [auto]", "43.3", "55.4", ""),
              ("softmax 8x12x512x512 float16 full", "fused_v1 [early zeros]", "46.7", "51.3", ""),
              ("softmax 8x12x1024x1024 float16 causal", "fused_v1 [auto]", "119.1", "60.5", ""),
              ("softmax 8x12x1024x1024 float16 causal", "fused_v1 [early zeros]", "118.5", "60.7", "")]),
    (AB_REPEATS, [("softmax 1x12x128x128 float16 causal", "fused_v1 [auto]", "4.6", "3.1", "3.2"),
                  ("softmax 1x12x128x128 float16 causal", "fused_v1 [short block 64]", "4.7", "3.0", "3.0")]),
])
def test_ab_tables_become_rows(tmp_path, text, expected):
    ab, table = tmp_path / "ab.txt", tmp_path / "history.csv"
    ab.write_text(text)
    history.main(["add-ab", str(ab), "--commit", "c8d3792", "--gpu", "NVIDIA H200", "--csv", str(table)])
    rows = _read(table)[1]
    assert [(r["case"], r["provider"], r["p50_us"], r["pct_of_copy_bw"], r["pct_of_roofline"]) for r in rows] == expected
    assert {r["commit"] for r in rows} == {"c8d3792"} and all(r["run"] for r in rows)


def test_ab_case_tables_become_rows(tmp_path):
    """The table bench.ab prints for any command: one row a (case, variant) that ran, the op from the case name."""
    ab, table = tmp_path / "ab.txt", tmp_path / "history.csv"
    ab.write_text(AB_CASES)
    history.main(["add-ab", str(ab), "--commit", "efc6be1", "--gpu", "NVIDIA H200", "--csv", str(table)])
    rows = _read(table)[1]
    assert [(r["op"], r["case"], r["provider"], r["p50_us"]) for r in rows] == [
        ("decode_attention", "bench_decode_attention[paged-b1-hq32-hkv8-d128-l8192-float16]", "ab [default]", "21.7"),
        ("decode_attention", "bench_decode_attention[paged-b1-hq32-hkv8-d128-l8192-float16]", "ab [base]", "23.1"),
        ("decode_attention", "bench_decode_attention[fused-b1-hq32-hkv8-d128-l8192-float16]", "ab [default]", "21.5")]


def test_an_ab_table_with_no_case_is_rejected(tmp_path, capsys):
    ab = tmp_path / "ab.txt"
    ab.write_text(AB_CASES.splitlines()[0] + "\n" + AB_CASES.splitlines()[1] + "\nexit status / last line  1: error\n")
    with pytest.raises(SystemExit) as exc:
        history.main(["add-ab", str(ab), "--commit", "x", "--gpu", "g", "--csv", str(tmp_path / "history.csv")])
    assert exc.value.code == 2 and "ab.txt holds a bench.ab table with no case measured" in capsys.readouterr().err
    assert not (tmp_path / "history.csv").exists()


def test_generate_printouts_become_rows(tmp_path):
    gen, table = tmp_path / "gen.txt", tmp_path / "history.csv"
    gen.write_text(GEN)
    history.main(["add-generate", str(gen), "--commit", "a2f6a2b", "--gpu", "NVIDIA H200", "--csv", str(table)])
    rows = _read(table)[1]
    assert [(r["provider"], r["tokens_per_s"], r["tbt_p95_ms"]) for r in rows] == [("hf-eager", "127.9", "11.282"),
                                                                                  ("graph", "1523.5", "0.631")]
    assert rows[0]["case"].startswith("gpt2-random on NVIDIA H200") and rows[0]["op"] == "generate"


def test_files_that_are_not_what_they_should_be_are_rejected(tmp_path, capsys):
    bad = tmp_path / "bad.txt"
    bad.write_text("nothing here\n")
    table = str(tmp_path / "history.csv")
    for cmd, message in (("add-ab", "bad.txt must hold a bench.ab table (a line starting 'case' or 'shape'), got none"),
                         ("add-generate", "bad.txt must hold `python -m fused_attn.generate` timing lines, got none")):
        with pytest.raises(SystemExit) as exc:
            history.main([cmd, str(bad), "--commit", "x", "--gpu", "g", "--csv", table])
        err = capsys.readouterr().err
        assert exc.value.code == 2 and f"python -m bench.history {cmd}: error: " in err and message in err, err
    with pytest.raises(SystemExit):  # --csv is required: the tool writes into the checkout only when told
        history.main(["add", str(RUN)])


def test_a_gzipped_table_holds_the_plain_tables_text_and_the_same_table_is_the_same_bytes(tmp_path, capsys):
    plain, table = tmp_path / "plain" / "history.csv", tmp_path / "history.csv.gz"
    for t in (plain, table):
        history.main(["add", str(RUN), "--csv", str(t), "--note", "small"])
    assert _read(table) == _read(plain) and len(_read(table)[1]) == len(json.loads(RUN.read_text())["benchmarks"])
    assert gzip.decompress(table.read_bytes()) == plain.read_bytes()
    assert history.notes_path(table) == tmp_path / "history.notes.csv" and history.read_notes(table)
    first = table.read_bytes()
    history.main(["add", str(RUN), "--csv", str(table)])  # adds nothing: the table is rewritten as it was
    assert table.read_bytes() == first
    other = tmp_path / "other.csv.gz"  # no name or time in the gzip header: bytes depend on the text alone
    for _ in range(2):
        history.write_table(other, plain.read_text())
        assert other.read_bytes() == first
    assert first[3] == 0 and first[4:8] == bytes(4)  # gzip FLG (no FNAME) and MTIME
    assert "history.csv.gz: 0 rows added" in capsys.readouterr().out


def test_a_gzipped_table_takes_in_the_plain_table_beside_it(tmp_path, capsys):
    plain, table = tmp_path / "history.csv", tmp_path / "history.csv.gz"
    plain.write_text("commit,gpu,run,source,op,case,provider,p50_us\n"
                     "abc1234,NVIDIA H200,t1,a.json,softmax,s1,fused,1.5\n")
    assert history.main(["add", str(RUN), "--csv", str(table)]) == 0
    assert not plain.exists()
    rows = _read(table)[1]
    assert rows[0]["source"] == "a.json" and len(rows) == 1 + len(json.loads(RUN.read_text())["benchmarks"])
    assert f"{plain}: its rows moved into history.csv.gz, the plain table removed" in capsys.readouterr().out


def test_a_table_that_cannot_be_the_history_is_refused(tmp_path, capsys):
    with pytest.raises(ValueError, match=r"^a history table's name must end in \.csv or \.csv\.gz, got history\.txt$"):
        history.add(tmp_path / "history.txt", [])
    with pytest.raises(SystemExit) as exc:
        history.main(["add", str(RUN), "--csv", str(tmp_path / "history.tsv")])
    assert exc.value.code == 2
    assert "add: error: a history table's name must end in .csv or .csv.gz, got history.tsv" in capsys.readouterr().err
    table = tmp_path / "history.csv.gz"
    table.write_text("commit,gpu,run,source,op,case,provider\n")  # plain text under the gzipped name
    with pytest.raises(ValueError, match=r"history\.csv\.gz must be gzipped CSV text, got BadGzipFile: "):
        history.read_table(table)
    history.write_table(table, "commit,gpu,run,source,op,case,provider\n")
    with pytest.raises(ValueError, match=r"^the table must be .*history\.csv\.gz, the gzipped table already there, "
                                         r"got .*history\.csv$"):
        history.add(tmp_path / "history.csv", [])  # a second table beside the gzipped one
    assert not (tmp_path / "history.csv").exists() and not list(tmp_path.glob("*.txt")) and not list(
        tmp_path.glob("*.tsv"))
