"""Transformers' own GPT-2 test suite run twice, every model forced onto "eager" and then onto "fused_attn",
and the per-test outcomes compared.

    python -m dev.transformers_gpt2_suite --tests /tmp/tf_tests [--out summary.json] [--logs DIR] [-k EXPR] [-- PYTEST_ARGS]

``--tests`` is a folder holding transformers' test tree (``tests/`` at its root, beside transformers'
``conftest.py`` and ``pyproject.toml``). For each mode, ``tests/models/gpt2/test_modeling_gpt2.py`` runs in a
pytest subprocess started in that folder, with this module loaded as a pytest plugin (``-p
dev.transformers_gpt2_suite``). The plugin:

- wraps ``PreTrainedModel._check_and_adjust_attn_implementation`` (every model's ``__init__``,
  ``from_pretrained``, ``_from_config`` and ``set_attn_implementation`` go through it) so that every
  requested implementation becomes the forced one: ``None`` (the default, SDPA), "sdpa", "flex_attention",
  "flash_attention_*", a hub kernel. Two requests are kept as they are, in both modes: an explicit "eager"
  (the suite asks for it where it needs the attention weights, which only eager returns: transformers
  refuses ``output_attentions`` with any other implementation) and a "paged|..." one (continuous batching's
  paged cache, which fused_attn does not implement);
- in fused_attn mode, registers fused_attn (``fused_attn.hf.register()``);
- counts the calls of every attention function (each entry of ``AttentionInterface`` and GPT-2's
  ``eager_attention_forward``; calls traced by torch.compile are not counted), per test, and fails the
  session when the forced implementation was never called (a forcing that did nothing) or any other but
  eager and paged ones was (a model that escaped it: SDPA, the default, would show here);
- writes each test's outcome (passed, failed, error, skipped, xfailed, xpassed) and its call counts to a JSON
  report the runner reads.

The runner prints both modes' counts and every test whose outcome differs, writes the summary (with both
modes' per-test outcomes and attention calls) to ``--out``, and exits 1 when fused_attn's outcomes differ
from eager's, apart from the tests named by ``--known`` (or a mode ran no forced call, or pytest did not run
to its end). ``HF_HUB_OFFLINE=1`` is set unless the environment sets it: tests that need downloaded
weights are ``@slow`` and skip; the rest build tiny random models.

Outcomes with transformers 5.17.0, torch 2.14 CPU (305 tests): eager 146 passed, 4 failed, 155 skipped;
fused_attn 147 passed, 3 failed, 155 skipped. Failing in both modes: test_can_set_attention_dynamically and
test_sdpa_can_dispatch_non_composite_models (they assert that a model asked for "sdpa" reports "sdpa": the
forcing is what they see; both pass unforced) and test_causal_lm_can_accept_training_kwargs (needs
``accelerate``). One outcome differs, pass ``--known test_cross_attention_respects_encoder_padding_mask``:
its random encoder mask leaves some rows with no visible key once the test pads half the keys, and eager's
softmax over an all-masked row spreads over every key, the corrupted ones too (eager fails; SDPA unforced
and fused_attn, whose rows with no visible key give zeros, pass). In fused_attn mode 25 parity tests
(test_eager_matches_sdpa_inference_*, test_gpt2_sdpa_matches_eager_with_scaling_configs) compare eager's
outputs to fused_attn's, and 13 tests that ask for the attention weights run on eager only.

Assembling the test tree (transformers' test code, never committed here; the versions must match the
installed transformers). For transformers 5.17.0, into DIR:

1. ``pip download transformers==5.17.0 --no-binary :all: --no-deps``; of the sdist keep ``pyproject.toml``
   (pytest settings) and ``tests/`` (the common mixins: test_modeling_common.py, test_pipeline_mixin.py,
   test_configuration_common.py, test_training_mixin.py, ...).
2. The sdist lacks the rest: take it from huggingface/transformers main at commit
   decba1d2ea4ed3cbf0495d1828abad4b2dba1846 (2026-08-19, 5.16.0.dev0: the newest upstream commit to hand,
   three weeks before 5.17.0; test_modeling_gpt2.py last changed on 2026-08-18) and lay it under the sdist's
   files (which win)::

       git archive decba1d2ea conftest.py utils/test_module utils/fetch_hub_objects_for_ci.py \
           tests/__init__.py tests/causal_lm_tester.py tests/models/__init__.py tests/models/gpt2 \
           tests/generation tests/exporters tests/pipelines tests/utils tests/fixtures | tar x -C DIR
       tar xzf transformers-5.17.0.tar.gz -C DIR --strip-components=1 \
           transformers-5.17.0/pyproject.toml transformers-5.17.0/tests

3. ``src/transformers``: the pipeline tests import it (upstream runs from an editable install); the runner
   links it to the installed package when it is absent and refuses a different version.

The tree imports ``parameterized`` and ``datasets`` (with ``dill``, ``multiprocess``, ``pandas``,
``pyarrow``, ``xxhash``); they must be installed. transformers' conftest.py registers a plugin implementing
pytest-xdist's ``pytest_configure_node`` hook; without xdist installed this plugin declares that hook so
pytest accepts it.
"""

from __future__ import annotations

import argparse
import collections
import functools
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

MODES = ("eager", "fused_attn")
SUITE = "tests/models/gpt2/test_modeling_gpt2.py"
REPO_ROOT = Path(__file__).resolve().parent.parent
OUTCOMES = ("passed", "failed", "error", "skipped", "xfailed", "xpassed")


# ---------------------------------------------------------------------------------------------------------------
# Pure logic (tested in dev/test_transformers_gpt2_suite.py)


def forced_implementation(requested: str | None, forced: str) -> str:
    """The implementation a model gets when ``requested`` is asked for under ``forced``: ``forced``, except an
    explicit "eager" and a "paged|..." request, which stay as they are (module docstring)."""
    if requested == "eager" or (isinstance(requested, str) and requested.startswith("paged|")):
        return requested
    return forced


def escaped_forcing(called: str, forced: str) -> bool:
    """Whether a call of the attention function ``called`` under ``forced`` means a model escaped the forcing:
    anything but the forced one and those ``forced_implementation`` keeps (eager, paged)."""
    return called not in (forced, "eager") and not called.startswith("paged|")


def fold_outcome(phases: list[tuple[str, str, bool]]) -> str:
    """One test's outcome from its reports ``(when, outcome, wasxfail)`` (setup, one or more calls when there
    are subtests, teardown): error when setup or teardown failed, failed when any call failed, else the
    call's pass / skip (xfailed / xpassed for an expected failure)."""
    if any(when != "call" and outcome == "failed" for when, outcome, _ in phases):
        return "error"
    calls = [(outcome, wasxfail) for when, outcome, wasxfail in phases if when == "call"]
    if any(outcome == "failed" for outcome, _ in calls):
        return "failed"
    if any(outcome == "passed" and wasxfail for outcome, wasxfail in calls):
        return "xpassed"
    if any(outcome == "skipped" and wasxfail for outcome, wasxfail in calls):
        return "xfailed"
    if any(outcome == "passed" for outcome, _ in calls):
        return "passed"
    return "skipped"


def compare(reports: dict[str, dict]) -> dict:
    """Both modes' outcome counts and the tests whose outcome differs from eager's (a test missing from a
    mode counts as "absent")."""
    base = reports["eager"]["outcomes"]
    counts = {mode: dict(collections.Counter(r["outcomes"].values())) for mode, r in reports.items()}
    differences = {}
    for mode, report in reports.items():
        if mode == "eager":
            continue
        outcomes = report["outcomes"]
        for nodeid in sorted(set(base) | set(outcomes)):
            a, b = base.get(nodeid, "absent"), outcomes.get(nodeid, "absent")
            if a != b:
                differences.setdefault(mode, []).append({
                    "test": nodeid, "eager": a, mode: b,
                    "message": report["messages"].get(nodeid) or reports["eager"]["messages"].get(nodeid, "")})
    return {"counts": counts, "differences": differences}


# ---------------------------------------------------------------------------------------------------------------
# The pytest plugin (active only with --force-attn-implementation)


class _XdistNodeHook:
    """pytest-xdist's hook that transformers' network-debug plugin implements; declared when xdist is absent."""

    @staticmethod
    def pytest_configure_node(node):
        """Configure a worker node (pytest-xdist)."""


def pytest_addhooks(pluginmanager):
    if importlib.util.find_spec("xdist") is None:
        pluginmanager.add_hookspecs(_XdistNodeHook)


def pytest_addoption(parser):
    group = parser.getgroup("fused_attn forcing")
    group.addoption("--force-attn-implementation", choices=MODES, default=None,
                    help="force every model onto this attention implementation")
    group.addoption("--force-attn-report", default=None, help="write per-test outcomes and attention calls here")


class _Forcing:
    def __init__(self, forced: str, report_path: str | None):
        self.forced = forced
        self.report_path = report_path
        self.calls: collections.Counter[str] = collections.Counter()
        self.calls_by_test: dict[str, dict[str, int]] = {}
        self.phases: dict[str, list[tuple[str, str, bool]]] = collections.defaultdict(list)
        self.messages: dict[str, str] = {}

    def _counted(self, name: str, fn):
        import torch

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            # Not while torch.compile traces: a counter in the graph is a guard on its value, so every call
            # would recompile (the suite's no-recompile tests fail). Compiled calls go uncounted.
            if not torch.compiler.is_compiling():
                self.calls[name] += 1
            return fn(*args, **kwargs)
        return wrapper

    def install(self) -> None:
        from transformers import AttentionInterface, PreTrainedModel
        from transformers.models.gpt2 import modeling_gpt2

        if self.forced == "fused_attn":
            import fused_attn.hf

            fused_attn.hf.register()
        for name, fn in list(AttentionInterface._global_mapping.items()):
            AttentionInterface.register(name, self._counted(name, fn))
        modeling_gpt2.eager_attention_forward = self._counted("eager", modeling_gpt2.eager_attention_forward)

        check = PreTrainedModel._check_and_adjust_attn_implementation
        forced = self.forced

        @functools.wraps(check)
        def forcing_check(model, attn_implementation, *args, **kwargs):
            return check(model, forced_implementation(attn_implementation, forced), *args, **kwargs)

        PreTrainedModel._check_and_adjust_attn_implementation = forcing_check

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item, nextitem):
        before = collections.Counter(self.calls)
        yield
        used = dict(self.calls - before)
        if used:
            self.calls_by_test[item.nodeid] = used

    def pytest_runtest_logreport(self, report):
        self.phases[report.nodeid].append((report.when, report.outcome, hasattr(report, "wasxfail")))
        if report.failed and report.nodeid not in self.messages:
            lines = [ln for ln in report.longreprtext.splitlines() if ln.startswith("E ")]
            self.messages[report.nodeid] = (lines[0][1:].strip() if lines else report.longreprtext[-300:])[:300]

    def pytest_sessionfinish(self, session, exitstatus):
        import transformers

        outcomes = {nodeid: fold_outcome(phases) for nodeid, phases in self.phases.items()}
        tests_forced = sum(1 for used in self.calls_by_test.values() if used.get(self.forced))
        escaped = {name: n for name, n in self.calls.items() if escaped_forcing(name, self.forced)}
        report = {"mode": self.forced, "transformers": transformers.__version__, "exitstatus": int(exitstatus),
                  "calls": dict(self.calls), "escaped": escaped, "tests_calling_forced": tests_forced,
                  "outcomes": outcomes, "messages": self.messages, "calls_by_test": self.calls_by_test}
        if self.report_path:
            Path(self.report_path).write_text(json.dumps(report, indent=1, sort_keys=True))
        calls = ", ".join(f"{k} {v}" for k, v in sorted(self.calls.items())) or "none"
        print(f"\nforced {self.forced}: attention calls {calls}; {tests_forced} tests called {self.forced}")
        if not self.calls[self.forced]:
            print(f"forced {self.forced}: no model called it, the forcing did nothing")
            session.exitstatus = pytest.ExitCode.INTERNAL_ERROR
        if escaped:
            print(f"forced {self.forced}: models escaped the forcing, calls {escaped}")
            session.exitstatus = pytest.ExitCode.INTERNAL_ERROR


def pytest_configure(config):
    forced = config.getoption("--force-attn-implementation")
    if forced is None:
        return
    forcing = _Forcing(forced, config.getoption("--force-attn-report"))
    forcing.install()
    config.pluginmanager.register(forcing, "fused_attn_forcing")


# ---------------------------------------------------------------------------------------------------------------
# The runner


def run_mode(mode: str, tests_dir: Path, extra: list[str], log: Path) -> tuple[dict | None, int, float]:
    """Run the suite in a subprocess with every model forced onto ``mode``, its output to ``log``; the
    plugin's report, pytest's exit code, seconds."""
    with tempfile.TemporaryDirectory() as tmp:
        report_path = Path(tmp) / f"{mode}.json"
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT)] + [p for p in [env.get("PYTHONPATH")] if p])
        env.setdefault("HF_HUB_OFFLINE", "1")
        cmd = [sys.executable, "-m", "pytest", SUITE, "-p", "dev.transformers_gpt2_suite", "-p", "no:cacheprovider",
               f"--force-attn-implementation={mode}", f"--force-attn-report={report_path}", "-o", "log_cli=false",
               "-q", "-rfE", *extra]
        print(f"[{mode}] {' '.join(cmd)} > {log}", flush=True)
        start = time.monotonic()
        with open(log, "w") as f:
            proc = subprocess.run(cmd, cwd=tests_dir, env=env, stdout=f, stderr=subprocess.STDOUT)
        seconds = time.monotonic() - start
        report = json.loads(report_path.read_text()) if report_path.exists() else None
    tail = log.read_text().splitlines()[-3:]
    print("\n".join(f"[{mode}] {line}" for line in tail), flush=True)
    return report, proc.returncode, seconds


def link_source(tests_dir: Path) -> None:
    """transformers' pipeline tests import ``src/transformers`` beside ``tests/`` (upstream runs from an editable
    install, where that is the installed package): link it to the installed package when it is absent, and
    refuse a different version."""
    import transformers

    installed = Path(transformers.__file__).resolve().parent
    src = tests_dir / "src" / "transformers"
    if not src.exists():
        src.parent.mkdir(exist_ok=True)
        src.symlink_to(installed, target_is_directory=True)
        print(f"linked {src} -> {installed}")
    version = re.search(r'^__version__ = "([^"]+)"', (src / "__init__.py").read_text(), re.M)
    if version is None or version.group(1) != transformers.__version__:
        raise SystemExit(f"--tests' src/transformers must be the installed transformers {transformers.__version__}, "
                         f"got {version.group(1) if version else 'no __version__'} at {src}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tests", required=True, type=Path, help="folder holding transformers' tests/ tree")
    ap.add_argument("--out", type=Path, help="write the JSON summary here")
    ap.add_argument("--logs", type=Path, help="folder for each mode's pytest output (default: a temporary one)")
    ap.add_argument("--known", action="append", default=[], metavar="TEST",
                    help="a test (its name, after the last ::) whose differing outcome is known and explained")
    ap.add_argument("-k", dest="keyword", help="pytest -k expression, passed to both runs")
    ap.add_argument("pytest_args", nargs="*", help="further pytest arguments (after --)")
    args = ap.parse_args(argv)
    if not (args.tests / SUITE).is_file():
        ap.error(f"--tests must be a folder holding {SUITE}, got {str(args.tests)!r}")
    extra = (["-k", args.keyword] if args.keyword else []) + args.pytest_args
    tests_dir = args.tests.resolve()
    link_source(tests_dir)
    logs = args.logs or Path(tempfile.mkdtemp(prefix="transformers_gpt2_suite."))
    logs.mkdir(parents=True, exist_ok=True)

    reports, problems, seconds = {}, [], {}
    for mode in MODES:
        report, rc, seconds[mode] = run_mode(mode, tests_dir, extra, logs / f"{mode}.log")
        if report is None:
            problems.append(f"{mode}: pytest exited {rc} without a report")
            continue
        reports[mode] = report
        if rc not in (pytest.ExitCode.OK, pytest.ExitCode.TESTS_FAILED):
            problems.append(f"{mode}: pytest exited {rc}")
        if not report["calls"].get(mode):
            problems.append(f"{mode}: no model called {mode}'s attention (the forcing did nothing)")
        if report["escaped"]:
            problems.append(f"{mode}: models escaped the forcing, calls {report['escaped']}")
    summary = {"suite": SUITE, "seconds": seconds, "problems": problems}
    unknown = []
    if len(reports) == len(MODES):
        summary.update(compare(reports))
        summary["transformers"] = reports["eager"]["transformers"]
        summary["calls"] = {mode: r["calls"] for mode, r in reports.items()}
        summary["tests_calling_forced"] = {mode: r["tests_calling_forced"] for mode, r in reports.items()}
        summary["reports"] = reports
        print(f"\ntransformers {summary['transformers']}, {SUITE}")
        for mode in MODES:
            counts = ", ".join(f"{o} {summary['counts'][mode].get(o, 0)}" for o in OUTCOMES)
            print(f"  {mode:10s} {counts}; {summary['tests_calling_forced'][mode]} tests called {mode}, "
                  f"{seconds[mode]:.0f} s")
        for mode, diffs in summary["differences"].items():
            print(f"\n{len(diffs)} tests differ from eager under {mode}:")
            for d in diffs:
                d["known"] = d["test"].rsplit("::", 1)[-1] in args.known
                print(f"  {d['test']}: eager {d['eager']}, {mode} {d[mode]}{' (known)' if d['known'] else ''}  "
                      f"{d['message']}")
        unknown += [d for diffs in summary["differences"].values() for d in diffs if not d["known"]]
        if not unknown:
            print(f"\nfused_attn's outcomes are eager's, test for test{', apart from --known' if args.known else ''}")
    for problem in problems:
        print(f"problem: {problem}")
    if args.out:
        args.out.write_text(json.dumps(summary, indent=1, sort_keys=True))
    return 1 if problems or unknown else 0


if __name__ == "__main__":
    sys.exit(main())
