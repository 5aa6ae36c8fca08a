"""The environment of a pytest run that a test starts in a subprocess."""

from __future__ import annotations

import os


def child_env(**extra: str) -> dict[str, str]:
    """os.environ without pytest-xdist's worker variables, plus extra. A child pytest that inherits
    PYTEST_XDIST_WORKER takes itself for an xdist worker, and pytest-benchmark then leaves its --benchmark-json
    empty (only a controller writes it): under `pytest -n` the tests reading the child's JSON failed."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST_")}
    env.update(extra)
    return env
