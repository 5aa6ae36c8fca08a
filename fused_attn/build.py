"""Build and load the CUDA library of fused_attn.

The sources in ``csrc/`` are compiled on first use with
``torch.utils.cpp_extension.load`` (ninja) into a cache directory keyed by the
sources, torch and CUDA versions, the target architectures and the compiler
flags, and loaded with ``torch.ops.load_library``. A second process finds the
built library in the cache and loads it directly (no ninja, no hashing of
build trees).

Toolkit discovery, in order: ``$CUDA_HOME`` / ``$CUDA_PATH``; the toolkit behind an
``nvcc`` on ``PATH`` (a wrapper script is resolved by asking nvcc itself where it
lives). Headers the toolkit lacks (e.g. ``cusparse.h`` on a minimal toolkit) are
taken from torch's pip-installed CUDA packages (``site-packages/nvidia/cu*/include``),
searched after the toolkit's own.

Target architectures: ``$TORCH_CUDA_ARCH_LIST`` if set (e.g. ``"9.0a"`` or
``"8.0;9.0"``), else every visible GPU (Hopper gets ``sm_90a``), else ``9.0`` when
no GPU is visible (a compile check).

Command line: ``python -m fused_attn.build`` compiles all of ``csrc/`` and
prints where the library is; it needs nvcc but no GPU.
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import time
from functools import lru_cache
from pathlib import Path

import torch

LIB_NAME = "fused_attn_C"
CSRC = Path(__file__).resolve().parent.parent / "csrc"
CUDA_CFLAGS = ["-O3", "--expt-relaxed-constexpr", "-lineinfo"]
CXX_CFLAGS = ["-O3"]


class BuildError(RuntimeError):
    """The CUDA library could not be built (no toolkit, compiler error)."""


def _has_nvcc(home: Path) -> bool:
    return (home / "bin" / "nvcc").is_file()


@lru_cache(maxsize=None)
def find_cuda_home() -> Path:
    """The CUDA toolkit root; raises BuildError naming what to install."""
    for var in ("CUDA_HOME", "CUDA_PATH"):
        value = os.environ.get(var)
        if value and _has_nvcc(Path(value)):
            return Path(value)
    nvcc = shutil.which("nvcc")
    if nvcc:
        real = Path(os.path.realpath(nvcc))
        if _has_nvcc(real.parent.parent) and (real.parent.parent / "include" / "cuda_runtime.h").is_file():
            return real.parent.parent
        # A wrapper script: nvcc's dry run prints the directory it runs from.
        probe = subprocess.run([nvcc, "-dryrun", "-E", "-x", "cu", os.devnull], capture_output=True, text=True)
        found = re.search(r"_HERE_=(\S+)", probe.stdout + probe.stderr)
        if found and _has_nvcc(Path(found.group(1)).parent):
            return Path(found.group(1)).parent
    raise BuildError(
        "fused_attn's CUDA ops need the CUDA toolkit (nvcc) to build: install a CUDA toolkit "
        f"matching torch's CUDA {torch.version.cuda} and set CUDA_HOME or put nvcc on PATH. "
        "CPU tensors do not need it."
    )


def extra_include_dirs(cuda_home: Path) -> list[str]:
    """torch's pip-installed CUDA headers, for headers the toolkit lacks."""
    if (cuda_home / "include" / "cusparse.h").is_file():
        return []
    site = Path(sysconfig.get_paths()["purelib"])
    roots = [Path(torch.__file__).resolve().parent.parent, site]
    found = []
    for root in dict.fromkeys(roots):
        for inc in sorted(glob.glob(str(root / "nvidia" / "cu[0-9]*" / "include"))):
            found.append(inc)
        for inc in sorted(glob.glob(str(root / "nvidia" / "*" / "include"))):
            if inc not in found and (Path(inc) / "cusparse.h").is_file():
                found.append(inc)
    return found


def _arch_from_capability(major: int, minor: int) -> str:
    # wgmma/setmaxnreg need the arch-specific target on Hopper.
    return f"{major}.{minor}a" if major == 9 else f"{major}.{minor}"


def target_archs() -> list[str]:
    env = os.environ.get("TORCH_CUDA_ARCH_LIST", "").strip()
    if env:
        return [a for a in re.split(r"[;\s]+", env) if a]
    if torch.cuda.is_available():
        caps = {torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())}
        return sorted(_arch_from_capability(*c) for c in caps)
    return ["9.0"]


def gencode_flags(archs: list[str]) -> list[str]:
    flags = []
    for arch in archs:
        ptx = arch.endswith("+PTX")
        m = re.fullmatch(r"(\d+)\.(\d+)([af]?)", arch.removesuffix("+PTX"))
        if not m:
            raise BuildError(f"TORCH_CUDA_ARCH_LIST entries must look like 9.0, 9.0a or 8.6+PTX, got {arch!r}")
        num = f"{m.group(1)}{m.group(2)}{m.group(3)}"
        flags.append(f"-gencode=arch=compute_{num},code=sm_{num}")
        if ptx:
            flags.append(f"-gencode=arch=compute_{num},code=compute_{num}")
    return flags


def sources() -> list[Path]:
    if not CSRC.is_dir():
        raise BuildError(
            f"fused_attn's CUDA sources were not found at {CSRC}: install the package from a "
            "checkout with `pip install -e .`"
        )
    return sorted(p for p in CSRC.iterdir() if p.suffix in (".cu", ".cpp"))


def _build_key(cuda_flags: list[str]) -> str:
    h = hashlib.sha256()
    for p in sorted(CSRC.iterdir()):
        if p.is_file():
            h.update(p.name.encode())
            h.update(p.read_bytes())
    for part in (torch.__version__, str(torch.version.cuda), sys.version, *cuda_flags, *CXX_CFLAGS):
        h.update(part.encode())
    return h.hexdigest()[:16]


def cache_root() -> Path:
    env = os.environ.get("FUSED_ATTN_CACHE")
    base = Path(env) if env else Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "fused_attn"
    return base


def library_path(verbose: bool = False) -> Path:
    """Path of the built library, building it first if the cache has none.

    ``$FUSED_ATTN_NVCC_FLAGS`` (space-separated) is appended to nvcc's flags and to the
    cache key: kernel variants for experiments (bench/ab.py) build side by side."""
    archs = target_archs()
    cuda_flags = CUDA_CFLAGS + gencode_flags(archs) + os.environ.get("FUSED_ATTN_NVCC_FLAGS", "").split()
    build_dir = cache_root() / f"{LIB_NAME}-{_build_key(cuda_flags)}"
    lib = build_dir / f"{LIB_NAME}.so"
    if lib.is_file():
        return lib
    cuda_home = find_cuda_home()
    build_dir.mkdir(parents=True, exist_ok=True)
    from torch.utils import cpp_extension

    # cpp_extension reads the toolkit location from module state set at import.
    os.environ["CUDA_HOME"] = str(cuda_home)
    cpp_extension.CUDA_HOME = str(cuda_home)
    # Appended after torch's own -isystem list, so the toolkit's headers win.
    includes = [f"-isystem {d}" for d in extra_include_dirs(cuda_home)]
    try:
        cpp_extension.load(
            name=LIB_NAME,
            sources=[str(s) for s in sources()],
            extra_cflags=CXX_CFLAGS + includes,
            extra_cuda_cflags=cuda_flags + includes,
            build_directory=str(build_dir),
            is_python_module=False,
            verbose=verbose,
        )
    except (RuntimeError, subprocess.CalledProcessError) as exc:
        raise BuildError(f"building {LIB_NAME} in {build_dir} failed: {exc}") from exc
    return lib


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="show the compiler commands")
    args = parser.parse_args(argv)
    t0 = time.perf_counter()
    lib = library_path(verbose=args.verbose)
    torch.ops.load_library(str(lib))
    print(f"fused_attn: {lib} for {', '.join(target_archs())} ({time.perf_counter() - t0:.1f} s)")
    ops = sorted(n for n in torch._C._dispatch_get_all_op_names() if n.startswith("fused_attn::"))
    print(f"fused_attn: ops {', '.join(ops)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
