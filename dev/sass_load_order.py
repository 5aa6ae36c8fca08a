"""Where the 16-row tensor-core GEMVs issue x after their wait, read from their SASS (no GPU needed).

    python -m dev.sass_load_order              # compile linear_inst_{fp16,bf16}_m16.cu for sm_90a, report
    python -m dev.sass_load_order A.cubin ...  # report on cubins built elsewhere

For each linear_mma_kernel / linear_splitk_kernel: after griddepcontrol.wait (ACQBULK in SASS), the x
pieces issued before the first MMA (LDGSTS on the staged path, LDG.E.128 on the register path), and how
many of them come after the first instruction that reads a weight register (a destination of the
weight loads issued before the wait). In-order issue stalls at that read until the weights land, so a
piece behind it leaves one round trip later: the staged 16-row kernels had three of their six there
until mma_walk_pieces fenced the copies (docs/lab-notes/linear-mlp.md). Exit status 1 when a staged kernel
(template argument kStageX true) has such a late piece; the register-path builds are reported only (they
issue one piece before their first MMA by design of ptxas, not ours).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
UNITS = ("linear_inst_fp16_m16.cu", "linear_inst_bf16_m16.cu")


def find_cuobjdump() -> str | None:
    """cuobjdump from the CUDA toolkit that builds the library, from PATH, or the copy Triton ships."""
    candidates = []
    try:
        from fused_attn import build

        candidates.append(build.find_cuda_home() / "bin" / "cuobjdump")
    except Exception:  # noqa: BLE001 - no toolkit: try the others
        pass
    which = shutil.which("cuobjdump")
    if which:
        candidates.append(Path(which))
    try:
        import triton

        candidates.append(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump")
    except ImportError:
        pass
    return next((str(c) for c in candidates if c.is_file() and os.access(c, os.X_OK)), None)


def compile_units(out_dir: Path, extra_flags: list[str], units: tuple[str, ...] = UNITS,
                  log: dict[Path, str] | None = None) -> list[Path]:
    """Linear units (default: the 16-row ones) as sm_90a cubins, with the library's own nvcc flags (and
    extra_flags); `log`, if given, receives each cubin's compiler messages (ptxas's, with -Xptxas -v)."""
    from fused_attn import build

    cuda_home = build.find_cuda_home()
    os.environ.setdefault("CUDA_HOME", str(cuda_home))  # read by cpp_extension when first imported
    import torch.utils.cpp_extension as cpp

    nvcc = cuda_home / "bin" / "nvcc"
    includes = [f"-I{p}" for p in cpp.include_paths()] + [f"-I{build.CSRC}"]
    cubins = []
    for unit in units:
        cubin = out_dir / (Path(unit).stem + ".cubin")
        cmd = [str(nvcc), *build.CUDA_CFLAGS, "-std=c++17", "-gencode=arch=compute_90a,code=sm_90a",
               "-DFUSED_ATTN_SM90A", *extra_flags, *includes, "-cubin", str(build.CSRC / "linear" / unit), "-o", str(cubin)]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"nvcc must compile {unit}, got exit status {r.returncode}:\n{r.stderr[-2000:]}")
        if log is not None:
            log[cubin] = r.stderr
        cubins.append(cubin)
    return cubins


def functions(sass: str) -> dict[str, list[str]]:
    """SASS instructions per function (mangled name), comments and encodings stripped."""
    body: dict[str, list[str]] = {}
    name = None
    for line in sass.splitlines():
        m = re.search(r"Function : (\S+)", line)
        if m:
            name = m.group(1)
            body[name] = []
        elif name and re.match(r"\s+/\*[0-9a-f]{4}\*/", line):
            body[name].append(re.sub(r"/\*.*?\*/", "", line).strip().rstrip(" ;"))
    return body


def _sources(inst: str) -> str:
    """An instruction's source operands (everything after its first operand, the destination)."""
    text = re.sub(r"^@!?U?P\w+\s+", "", inst)
    parts = text.split(None, 1)
    return parts[1].split(",", 1)[1] if len(parts) > 1 and "," in parts[1] else ""


def issue_order(lines: list[str]) -> tuple[int, int] | None:
    """(x pieces issued between the wait and the first MMA, of them after the first weight read), or None
    for a function without a wait."""
    wait = next((i for i, l in enumerate(lines) if l.startswith("ACQBULK")), None)
    if wait is None:
        return None
    weights = set()
    for inst in lines[:wait]:
        m = re.search(r"LDG\.E\.NA\.LTC256B\.128\.CONSTANT R(\d+),", inst)
        if m:
            weights |= {int(m.group(1)) + k for k in range(4)}
    mma = next((i for i in range(wait, len(lines)) if "HMMA" in lines[i]), len(lines))
    pieces = [i for i in range(wait, mma) if "LDGSTS" in lines[i] or re.search(r"\bLDG\.E\.128 ", lines[i])]
    if not pieces:
        return 0, 0
    # From the first piece on (the code between the wait and it holds the never-taken reload of the
    # chunk walk's first group, whose register reads are not on the executed path).
    first_read = next((i for i in range(pieces[0], mma)
                       if any(int(r) in weights for r in re.findall(r"\bR(\d+)\b", _sources(lines[i])))), mma)
    return len(pieces), sum(1 for i in pieces if i > first_read)


def demangle(name: str) -> str:
    tool = shutil.which("c++filt")
    text = subprocess.run([tool, name], capture_output=True, text=True).stdout.strip() if tool else name
    return re.sub(r"\(fused_attn::.*", "", text.replace("void fused_attn::linear::", ""))


def tensor_core_kernels(cubins: list[Path], cuobjdump: str):
    """(cubin, mangled name, instructions) of every tensor-core linear kernel in the cubins."""
    for cubin in cubins:
        sass = subprocess.run([cuobjdump, "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout
        for name, lines in functions(sass).items():
            if "linear_mma_kernel" in name or "linear_splitk_kernel" in name:
                yield cubin, name, lines


def report(cubins: list[Path], cuobjdump: str) -> list[tuple[str, bool, int, int]]:
    """(kernel, staged, pieces, late) for every tensor-core linear kernel in the cubins."""
    rows = []
    for _, name, lines in tensor_core_kernels(cubins, cuobjdump):
        order = issue_order(lines)
        if order is None:
            continue
        kernel = demangle(name)
        args = [a.strip() for a in kernel[kernel.find("<") + 1:kernel.rfind(">")].split(",")]
        staged = len(args) >= 4 and args[1] == "2" and args[2] == "true" and args[3] == "true"
        rows.append((kernel, staged, *order))
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("cubins", nargs="*", type=Path)
    ap.add_argument("--nvcc-flag", action="append", default=[],
                    help="an extra nvcc flag for the units compiled here, e.g. -lineinfo")
    args = ap.parse_args(argv)
    cuobjdump = find_cuobjdump()
    if cuobjdump is None:
        print("cuobjdump must be installed (CUDA toolkit, PATH or Triton's copy), got none", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        cubins = args.cubins or compile_units(Path(tmp), args.nvcc_flag)
        rows = report(cubins, cuobjdump)
    bad = [r for r in rows if r[1] and r[3] > 0]
    for kernel, staged, pieces, late in rows:
        print(f"{kernel:64s} {'staged' if staged else 'registers':9s} x pieces before the first MMA {pieces}, "
              f"after the first weight read {late}")
    if not any(r[1] for r in rows):
        print("no staged 16-row kernel found in the cubins", file=sys.stderr)
        return 1
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
