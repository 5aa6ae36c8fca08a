"""The command-line checks of bench.time_decode_graph (it times on a GPU; its arguments are refused before
anything is built or run, so these run anywhere)."""

from __future__ import annotations

import pytest

from bench import time_decode_graph


@pytest.mark.parametrize("steps", ["0", "-2"])
def test_time_decode_graph_refuses_fewer_than_one_step_a_graph(steps, capsys):
    with pytest.raises(SystemExit) as e:
        time_decode_graph.main(["--steps-per-graph", steps])
    assert e.value.code == 2
    assert f"--steps-per-graph must be at least 1, got {steps}" in capsys.readouterr().err

