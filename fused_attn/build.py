"""Build and load the CUDA library of fused_attn.

The sources in ``csrc/`` (``csrc/common/`` and one folder per op; the checkout's, or the
copy a non-editable install ships inside the package) are compiled on first use with
``torch.utils.cpp_extension.load`` (ninja) into a build directory keyed by torch and CUDA
versions, the target architectures and the compiler flags, and loaded with
``torch.ops.load_library``. The directory is stable across source edits, so ninja
recompiles only the translation units whose sources (or included headers) changed. A
stamp of the sources' hash lets a later process with unchanged sources load the library
directly (no ninja). Processes that need the same build wait for one builder (an ``flock``
on the build directory, released however the builder exits), then load what it built.
``FUSED_ATTN_DEBUG=1`` adds ``-G`` (device debug info, no optimization) for sanitizer
runs, in a build directory of its own; ``-lineinfo`` is always on.

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
import contextlib
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
_PACKAGE = Path(__file__).resolve().parent
# A checkout (editable install) keeps the sources beside the package; a wheel ships them inside it.
CSRC = _PACKAGE.parent / "csrc" if (_PACKAGE.parent / "csrc" / "common" / "checks.h").is_file() else _PACKAGE / "csrc"
SOURCE_SUFFIXES = (".cu", ".cpp")
HEADER_SUFFIXES = (".cuh", ".h")
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


def cublaslt_ldflags(cuda_home: Path) -> list[str]:
    """Link flags for cuBLASLt (linear's many-row GEMM, csrc/linear/linear_cublaslt.cpp): the library file
    this process's torch loaded (so both use one copy: same soname), else a pip-installed or the toolkit's."""
    found = []
    try:
        with open("/proc/self/maps") as maps:
            found = [line.split()[-1] for line in maps if "libcublasLt.so" in line]
    except OSError:
        pass
    if not found:
        site = Path(sysconfig.get_paths()["purelib"])
        for root in dict.fromkeys([Path(torch.__file__).resolve().parent.parent, site]):
            found += glob.glob(str(root / "nvidia" / "*" / "lib" / "libcublasLt.so*"))
        found += glob.glob(str(cuda_home / "lib64" / "libcublasLt.so*"))
    if not found:
        raise BuildError(f"cuBLASLt (libcublasLt.so) must be installed with torch or in {cuda_home}/lib64, "
                         "got neither")
    lib = Path(min(found, key=len))  # the soname (libcublasLt.so.13) before libcublasLt.so.13.x.y
    return [f"-L{lib.parent}", f"-l:{lib.name}"]


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


def _files(suffixes: tuple[str, ...]) -> list[Path]:
    return sorted(p for p in CSRC.rglob("*") if p.is_file() and p.suffix in suffixes)


def sources() -> list[Path]:
    """Every translation unit under csrc/ (csrc/common/ and the per-op folders)."""
    if not CSRC.is_dir():
        raise BuildError(
            f"fused_attn's CUDA sources were not found at {CSRC}: reinstall the package "
            "(`pip install .` or `pip install -e .` from a checkout)"
        )
    found = _files(SOURCE_SUFFIXES)
    names = [p.stem for p in found]
    clashes = sorted({n for n in names if names.count(n) > 1})
    if clashes:  # cpp_extension names object files by stem: two softmax.cu in different folders would overwrite each other
        raise BuildError(f"csrc/ source file names must be unique across folders, got {clashes} twice")
    return found


def sources_hash() -> str:
    """Hash of every source and header under csrc/ (names and contents)."""
    h = hashlib.sha256()
    for p in _files(SOURCE_SUFFIXES + HEADER_SUFFIXES):
        h.update(str(p.relative_to(CSRC)).encode())
        h.update(p.read_bytes())
    return h.hexdigest()[:16]


def _build_key(cuda_flags: list[str]) -> str:
    """What makes object files incompatible: toolchain, Python, flags. Not the sources (ninja tracks those)."""
    h = hashlib.sha256()
    for part in (torch.__version__, str(torch.version.cuda), sys.version, *cuda_flags, *CXX_CFLAGS):
        h.update(part.encode())
    return h.hexdigest()[:16]


def arch_defines(archs: list[str]) -> list[str]:
    """``-DFUSED_ATTN_SM90A`` when the only 9.0 target is the arch-specific ``9.0a``: an sm_90 device then
    runs that build, so the launchers may pick the kernels that need it (wgmma; their plain sm_90 pass is
    empty). With a plain ``9.0`` beside it the device might load either, so none are picked."""
    bases = {a.removesuffix("+PTX") for a in archs}
    return ["-DFUSED_ATTN_SM90A"] if "9.0a" in bases and "9.0" not in bases else []


def cuda_flags() -> list[str]:
    archs = target_archs()
    flags = CUDA_CFLAGS + gencode_flags(archs) + arch_defines(archs)
    if os.environ.get("FUSED_ATTN_DEBUG", "") not in ("", "0"):
        flags = [f for f in flags if f != "-O3"] + ["-G"]
    return flags + os.environ.get("FUSED_ATTN_NVCC_FLAGS", "").split()


def cache_root() -> Path:
    env = os.environ.get("FUSED_ATTN_CACHE")
    base = Path(env) if env else Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "fused_attn"
    return base


@contextlib.contextmanager
def _build_lock(build_dir: Path):
    """Hold an exclusive lock on build_dir while building into it: ``flock``, which the kernel releases when the
    holder exits, however it exits. A process that finds the lock held says whose build it waits for."""
    try:
        import fcntl
    except ImportError:  # not POSIX: torch's own lock alone
        yield
        return
    with open(build_dir / "build.flock", "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"fused_attn: waiting for another process's build in {build_dir}", file=sys.stderr, flush=True)
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _remove_stale_baton(build_dir: Path) -> None:
    """Before torch 2.14, cpp_extension locked a build directory with a file whose existence is the lock
    (FileBaton), so a build killed mid-way (a segfault, SIGKILL, a timeout) left every later build waiting
    forever. Under _build_lock no other build runs here, so such a file is a dead build's: removed. Where
    torch holds an OS lock on the file instead (FileLock), the file is left as it is."""
    from torch.utils import cpp_extension

    baton = build_dir / "lock"
    if not hasattr(cpp_extension, "FileLock") and baton.exists():
        baton.unlink()
        print(f"fused_attn: removed {baton}, the lock of a build that did not finish", file=sys.stderr, flush=True)


def library_path(verbose: bool = False) -> Path:
    """Path of the built library, building (or incrementally rebuilding) it first when the
    sources changed since the last build in this configuration.

    ``$FUSED_ATTN_NVCC_FLAGS`` (space-separated) is appended to nvcc's flags and to the
    cache key: kernel variants for experiments (bench/ab.py) build side by side."""
    flags = cuda_flags()
    build_dir = cache_root() / f"{LIB_NAME}-{_build_key(flags)}"
    lib = build_dir / f"{LIB_NAME}.so"
    stamp = build_dir / "sources.sha"
    want = sources_hash()

    def built() -> bool:
        return lib.is_file() and stamp.is_file() and stamp.read_text() == want

    if built():
        return lib
    cuda_home = find_cuda_home()
    # cpp_extension reads the toolkit location from CUDA_HOME when first imported (and warns with
    # it when no GPU is visible): set it first, so the location it names is the one used.
    os.environ["CUDA_HOME"] = str(cuda_home)
    build_dir.mkdir(parents=True, exist_ok=True)
    with _build_lock(build_dir):
        if built():
            return lib  # built by the process this one waited for
        _remove_stale_baton(build_dir)
        _build(build_dir, cuda_home, flags, verbose)
        stamp.write_text(want)
    return lib


def _build(build_dir: Path, cuda_home: Path, flags: list[str], verbose: bool) -> None:
    print(f"fused_attn: building the CUDA library in {build_dir} (nvcc; only changed sources "
          "are recompiled; later processes load it from there)", file=sys.stderr, flush=True)
    from torch.utils import cpp_extension

    cpp_extension.CUDA_HOME = str(cuda_home)
    # Appended after torch's own -isystem list, so the toolkit's headers win.
    includes = [f"-isystem {d}" for d in extra_include_dirs(cuda_home)]
    try:
        cpp_extension.load(
            name=LIB_NAME,
            sources=[str(s) for s in sources()],
            extra_cflags=CXX_CFLAGS + includes,
            extra_cuda_cflags=flags + includes,
            extra_ldflags=cublaslt_ldflags(cuda_home),
            build_directory=str(build_dir),
            is_python_module=False,
            verbose=verbose,
        )
    except (RuntimeError, subprocess.CalledProcessError) as exc:
        raise BuildError(f"building {LIB_NAME} in {build_dir} failed: {exc}") from exc


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fused_attn.build", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("-v", "--verbose", action="store_true", help="show the compiler commands")
    args = parser.parse_args(argv)
    t0 = time.perf_counter()
    try:
        lib = library_path(verbose=args.verbose)
    except BuildError as e:
        parser.exit(2, f"{parser.prog}: error: {e}\n")
    torch.ops.load_library(str(lib))
    print(f"fused_attn: {lib} for {', '.join(target_archs())} ({time.perf_counter() - t0:.1f} s)")
    ops = sorted(n for n in torch._C._dispatch_get_all_op_names() if n.startswith("fused_attn::"))
    print(f"fused_attn: ops {', '.join(ops)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
