"""dev.probe_pdl_state's command line (the probe times on a GPU; its arguments are refused before anything
is built or run, so this runs anywhere)."""

from __future__ import annotations

import pytest

from dev import probe_pdl_state


def test_probe_pdl_state_names_an_unknown_action():
    with pytest.raises(SystemExit, match=r"--actions must name join, joindestroy, samejoin, waitonly, graph, "
                                         r"got 'nope'"):
        probe_pdl_state.main(["--actions", "join,nope"])
