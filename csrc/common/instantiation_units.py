"""The write / --check driver the ops' generate_instantiations.py scripts share.

Each script computes its units (file name -> text) and calls ``main(here, op, units, argv)``: without
--check the units are (re)written and stale ones removed; with --check the exit status is 1 and a
line is printed per missing, stale or extra file (tests/test_build.py runs every script that way).
"""

from __future__ import annotations

from pathlib import Path


def main(here: Path, op: str, want: dict[str, str], argv: list[str]) -> int:
    have = {p.name for p in here.glob(f"{op}_inst_*.cu")}
    if "--check" in argv:
        stale = sorted(n for n, text in want.items() if not (here / n).is_file() or (here / n).read_text() != text)
        extra = sorted(have - set(want))
        for n in stale + extra:
            print(f"csrc/{op}/{n} must match generate_instantiations.py, got "
                  f"{'an extra file' if n in extra else 'a stale or missing file'}")
        return 1 if stale or extra else 0
    for n in have - set(want):
        (here / n).unlink()
    for n, text in want.items():
        (here / n).write_text(text)
    print(f"wrote {len(want)} units in {here}")
    return 0
