"""The build's inputs: generated instantiation units up to date, unique source names (CPU, no compiler)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from fused_attn import build

ROOT = Path(__file__).resolve().parent.parent


import pytest


@pytest.mark.parametrize("op", sorted(p.parent.name for p in (ROOT / "csrc").glob("*/generate_instantiations.py")))
def test_generated_instantiation_units_are_up_to_date(op):
    script = ROOT / "csrc" / op / "generate_instantiations.py"
    r = subprocess.run([sys.executable, str(script), "--check"], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_sources_cover_every_unit_with_unique_names():
    found = build.sources()
    names = [p.stem for p in found]
    assert len(names) == len(set(names))
    assert {"softmax", "softmax_inst_fp16_v1_vec", "softmax_inst_bf16_bwd_scalar"} <= set(names)
    assert {"decode_attention", "decode_attention_inst_fp16_hd128", "decode_attention_inst_fp32_combine"} <= set(names)
    assert {"layer_norm", "layer_norm_inst_fp16_ln_vec", "layer_norm_inst_bf16_rms_scalar"} <= set(names)
    assert {"attention", "attention_inst_fp16_hd128", "attention_inst_fp32_naive"} <= set(names)
    assert {"linear", "linear_inst_fp16_m8_norm", "sample", "sample_inst_bf16"} <= set(names)


def test_programmatic_kernels_read_no_input_through_ldg():
    """A kernel that waits for its primary (griddepcontrol.wait, common/pdl.cuh) reads the previous
    kernel's output: an __ldg there is an invariant load, which the compiler may issue before the wait
    (graph-fused's GEMVs at 8-16 rows read x early in replayed graphs). Their weights go
    through load_stream / prefetch_l2; nothing in such a file calls __ldg."""
    waiting = [p for p in (ROOT / "csrc").glob("*/*.cuh") if "wait_for_primary()" in p.read_text()
               and p.name != "pdl.cuh"]
    assert {"linear_kernel.cuh", "decode_attention_kernel.cuh", "sample_kernel.cuh"} <= {p.name for p in waiting}
    offenders = [f"{p.relative_to(ROOT)}:{i + 1}" for p in waiting
                 for i, line in enumerate(p.read_text().splitlines()) if "__ldg(" in line]
    assert not offenders, f"__ldg in kernels launched as programmatic dependents: {offenders}"



@pytest.mark.parametrize("archs, defined", [
    (["9.0a"], True), (["8.0", "9.0a"], True), (["9.0a+PTX"], True),
    (["9.0"], False), (["9.0", "9.0a"], False), (["8.0"], False),
])
def test_sm90a_kernels_are_enabled_only_when_sm90_devices_run_the_9_0a_build(archs, defined):
    """The wgmma flash kernel is selected only where an sm_90 device cannot load a plain sm_90 pass (whose
    version of it is empty)."""
    assert (build.arch_defines(archs) == ["-DFUSED_ATTN_SM90A"]) == defined


@pytest.fixture
def stub_compiler(tmp_path, monkeypatch):
    """library_path with cpp_extension.load stubbed: it records its build directories and writes an empty library.
    Yields (the build directory library_path will use, the list of directories built)."""
    import os

    from torch.utils import cpp_extension

    built = []

    def fake_load(*, build_directory, **kwargs):
        built.append(build_directory)
        (Path(build_directory) / f"{build.LIB_NAME}.so").write_bytes(b"")

    monkeypatch.setenv("FUSED_ATTN_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(build, "find_cuda_home", lambda: tmp_path)
    monkeypatch.setattr(cpp_extension, "load", fake_load)
    monkeypatch.setenv("CUDA_HOME", os.environ.get("CUDA_HOME", ""))
    monkeypatch.setattr(cpp_extension, "CUDA_HOME", cpp_extension.CUDA_HOME)
    build_dir = build.cache_root() / f"{build.LIB_NAME}-{build._build_key(build.cuda_flags())}"
    yield build_dir, built


@pytest.mark.parametrize("os_lock", [False, True], ids=["file-baton", "file-lock"])
def test_a_killed_builds_lock_file_does_not_block_the_next_build(stub_compiler, monkeypatch, capsys, os_lock):
    """Before torch 2.14 cpp_extension's lock was a file whose existence blocks (FileBaton): a build killed
    mid-way left it, and every later build waited on it forever. Under our own lock it is a dead build's, and
    is removed; where torch's lock is an OS lock (FileLock) the file is left alone."""
    from torch.utils import cpp_extension

    build_dir, built = stub_compiler
    if os_lock:
        monkeypatch.setattr(cpp_extension, "FileLock", object(), raising=False)
    else:
        monkeypatch.delattr(cpp_extension, "FileLock", raising=False)
    build_dir.mkdir(parents=True)
    (build_dir / "lock").write_text("")
    lib = build.library_path()
    assert built == [str(build_dir)] and lib == build_dir / f"{build.LIB_NAME}.so"
    err = capsys.readouterr().err
    assert (build_dir / "lock").exists() == os_lock
    assert (f"fused_attn: removed {build_dir / 'lock'}, the lock of a build that did not finish" in err) != os_lock


def test_a_build_waits_for_another_process_holding_the_directory_and_resumes_when_it_dies(stub_compiler, capsys):
    """Another process holding the build directory's lock is waited for, with a line saying so; the lock is an
    flock, so it is released when that process is killed, and the build goes on."""
    import signal
    import threading

    build_dir, built = stub_compiler
    build_dir.mkdir(parents=True)
    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, sys, time\n"
        f"f = open({str(build_dir / 'build.flock')!r}, 'a+')\n"
        "fcntl.flock(f, fcntl.LOCK_EX)\n"
        "print('held', flush=True)\n"
        "time.sleep(600)\n")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        threading.Timer(1.0, holder.send_signal, (signal.SIGKILL,)).start()
        lib = build.library_path()
    finally:
        holder.kill()
        holder.wait()
    assert built == [str(build_dir)] and lib.is_file()
    assert f"fused_attn: waiting for another process's build in {build_dir}" in capsys.readouterr().err


def test_a_build_finished_by_the_process_waited_for_is_not_redone(stub_compiler, monkeypatch):
    """Two processes asking for the same missing library: the second, past the lock, finds the first's build
    (library and stamp) and loads it instead of building again."""
    build_dir, built = stub_compiler
    real_lock = build._build_lock

    @build.contextlib.contextmanager
    def lock_after_another_build(d):
        (d / f"{build.LIB_NAME}.so").write_bytes(b"")  # what the process held up front wrote meanwhile
        (d / "sources.sha").write_text(build.sources_hash())
        with real_lock(d):
            yield

    monkeypatch.setattr(build, "_build_lock", lock_after_another_build)
    assert build.library_path() == build_dir / f"{build.LIB_NAME}.so"
    assert built == []
