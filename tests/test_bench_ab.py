"""bench/ab.py on the CPU: edits applied to a copy of a repository (never to the checkout), anchors found
exactly once or refused, the named variants' anchors present in this tree, and one table of times against
the default from a command run in each copy (the builds stubbed out)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from bench import ab


def make_repo(root: Path, files: dict[str, str]) -> Path:
    root.mkdir(parents=True)
    subprocess.run(["git", "init", "-q"], cwd=root, check=True)
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def snapshot(root: Path) -> dict[str, tuple[bytes, int]]:
    return {str(p.relative_to(root)): (p.read_bytes(), p.stat().st_mtime_ns)
            for p in sorted(root.rglob("*")) if p.is_file() and ".git" not in p.parts}


def test_the_copy_has_the_replacement_and_the_checkout_is_untouched(tmp_path):
    root = make_repo(tmp_path / "repo", {"src/h.h": "constexpr int kRows = 8;\nint other = 8;\n", "notes.txt": "x"})
    before = snapshot(root)
    v = ab.Variant("rows-16", (ab.Edit("src/h.h", "constexpr int kRows = 8;", "constexpr int kRows = 16;"),))
    copy = ab.prepare(root, tmp_path / "work", v)
    assert copy == tmp_path / "work" / "rows-16" / "repo"
    assert (copy / "src/h.h").read_text() == "constexpr int kRows = 16;\nint other = 8;\n"
    assert (copy / "notes.txt").read_text() == "x"
    assert snapshot(root) == before
    assert ab.variant_env(copy)["FUSED_ATTN_CACHE"] == str(tmp_path / "work" / "rows-16" / "cache")
    # A second prepare starts from a fresh copy: a file gone from the tree is gone from the copy.
    (root / "notes.txt").unlink()
    copy = ab.prepare(root, tmp_path / "work", v)
    assert not (copy / "notes.txt").exists() and (copy / "src/h.h").read_text().startswith("constexpr int kRows = 16;")


@pytest.mark.parametrize("text,count", [("int a = 1;\n", 0),
                                        ("constexpr int kRows = 8;\nconstexpr int kRows = 8;\n", 2)])
def test_an_anchor_not_found_exactly_once_is_refused(tmp_path, text, count):
    root = make_repo(tmp_path / "repo", {"h.h": text})
    v = ab.Variant("rows-16", (ab.Edit("h.h", "constexpr int kRows = 8;", "constexpr int kRows = 16;"),))
    with pytest.raises(LookupError, match=re.escape(f"rows-16: anchor found {count} times in h.h (must be exactly "
                                                    "once): 'constexpr int kRows = 8;'")):
        ab.prepare(root, tmp_path / "work", v)
    assert (root / "h.h").read_text() == text


@pytest.mark.parametrize("name", sorted(ab.VARIANTS))
def test_every_named_variants_anchors_occur_once_in_this_tree(name):
    """The table of named variants is the record of what was measured: each must still apply to the tree."""
    for e in ab.VARIANTS[name].edits:
        assert (ab.ROOT / e.path).read_text().count(e.old) == 1, (name, e.path, e.old)
        assert e.new != e.old


def test_times_are_read_from_lines_and_benchmark_json(tmp_path):
    out = (" graph-fused B1: 190.8 us/step (min 190.1, max 191.0); first token agrees\n"
           "tag graph-fused B16: 276 us\n# header: 5 ms\nnot a time\n")
    assert ab.times_from_output(out) == {"graph-fused B1": 190.8, "tag graph-fused B16": 276.0}
    j = tmp_path / "b.json"
    j.write_text('{"benchmarks": [{"name": "a", "extra_info": {"p50_us": 12.5}, "stats": {"median": 1.0}},'
                 ' {"name": "b", "extra_info": {}, "stats": {"median": 2e-05}}]}')
    assert ab.times_from_benchmark_json(j) == {"a": 12.5, "b": pytest.approx(20.0)}
    empty = tmp_path / "tests.json"  # what pytest-benchmark leaves after a test command: no case, no error
    empty.write_text("")
    assert ab.times_from_benchmark_json(empty) == {}


def test_main_prints_one_table_against_the_default(tmp_path, monkeypatch, capsys):
    """Each copy runs the command (which prints a time read from its copy's file): one row per case, the
    variant's median beside the default's and their ratio; the checkout keeps its text."""
    root = make_repo(tmp_path / "repo", {"t.txt": "3\n"})
    monkeypatch.setattr(ab, "ROOT", root)
    monkeypatch.setattr(ab, "VARIANTS", {"six": ab.Variant("six", (ab.Edit("t.txt", "3\n", "6\n"),))})
    monkeypatch.setattr(ab, "build", lambda copies: {})
    cmd = f"{sys.executable} -c \"print('case A:', open('t.txt').read().strip(), 'us')\""
    assert ab.main(["six", "--cmd", cmd, "--repeat", "2", "--workdir", str(tmp_path / "work")]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^case A\s+3\.0\s+6\.0 \(2\.000\)$", out, re.MULTILINE), out
    assert (root / "t.txt").read_text() == "3\n"


def test_main_refuses_unknown_variants_and_bad_repeats(capsys):
    with pytest.raises(SystemExit):
        ab.main(["no-such-variant"])
    assert re.search(r"variants must be names from bench/ab.py's VARIANTS \(.*\), got \['no-such-variant'\]",
                     capsys.readouterr().err)
    with pytest.raises(SystemExit):
        ab.main(["--repeat", "0"])
    assert "--repeat must be at least 1, got 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        ab.main(["--no-default"])
    assert "variants must name at least one variant with --no-default, got none" in capsys.readouterr().err


def test_a_tree_is_timed_beside_the_default(tmp_path, monkeypatch, capsys):
    """--tree NAME=DIR: another tree of the project (here not a git work tree: a commit exported by git archive)
    is copied without its caches and runs the same command in the same rounds; its row sits beside the default's."""
    root = make_repo(tmp_path / "repo", {"t.txt": "3\n", "fused_attn/a.py": "", "csrc/b.cu": ""})
    other = tmp_path / "old"
    files = {"t.txt": "5\n", "fused_attn/a.py": "", "csrc/b.cu": "",
             "fused_attn/__pycache__/a.pyc": "x"}
    for rel, text in files.items():
        (other / rel).parent.mkdir(parents=True, exist_ok=True)
        (other / rel).write_text(text)
    monkeypatch.setattr(ab, "ROOT", root)
    monkeypatch.setattr(ab, "build", lambda copies: {})
    cmd = f"{sys.executable} -c \"print('case A:', open('t.txt').read().strip(), 'us')\""
    work = tmp_path / "work"
    assert ab.main(["--tree", f"old={other}", "--cmd", cmd, "--repeat", "2", "--workdir", str(work)]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^case A\s+3\.0\s+5\.0 \(1\.667\)$", out, re.MULTILINE), out
    assert (work / "old" / "repo" / "csrc" / "b.cu").is_file()
    assert not (work / "old" / "repo" / "fused_attn" / "__pycache__").exists()


@pytest.mark.parametrize("arg", ["old", "=DIR", "default=DIR", "decode-deep-off=DIR", "old=NOWHERE"])
def test_a_tree_must_be_a_new_name_and_a_tree_of_the_project(tmp_path, capsys, arg):
    tree = tmp_path / "t"
    (tree / "fused_attn").mkdir(parents=True)
    (tree / "csrc").mkdir()
    arg = arg.replace("DIR", str(tree)).replace("NOWHERE", str(tmp_path / "none"))
    with pytest.raises(SystemExit):
        ab.main(["--tree", arg])
    err = capsys.readouterr().err
    assert "--tree must be NAME=DIR with a new name (not " in err and "and DIR a tree of the project (fused_attn/ " \
        "and csrc/ in it), got " + repr(arg) in err, err
