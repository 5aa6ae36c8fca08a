"""bench.clocks: nvidia-smi's samples during a run summarized (CPU; the lines are the format an H200 printed)."""

from __future__ import annotations

import pytest

from bench import clocks

LINES = """\
2026/11/30 20:23:04.166, 1980 MHz, 3201 MHz, 127.70 W, 41, 0x0000000000000000
2026/11/30 20:23:05.169, 345 MHz, 3201 MHz, 96.31 W, 40, 0x0000000000000001
2026/11/30 20:24:10.002, 1965 MHz, 3201 MHz, 648.10 W, 60, 0x0000000000000004
2026/11/30 20:24:11.002, 1500 MHz, 3201 MHz, 640.00 W, 64, 0x0000000000000004
2026/11/30 20:24:12.002, 1980 MHz, 3201 MHz, 400.00 W, 58, 0x0000000000000000

"""


def test_parse_reads_clock_power_temperature_and_reasons():
    got = clocks.parse(LINES)
    assert [(s.sm_mhz, s.power_w, s.temperature_c, s.reasons) for s in got] == [
        (1980, 127.70, 41, 0), (345, 96.31, 40, 1), (1965, 648.10, 60, 4), (1500, 640.0, 64, 4), (1980, 400.0, 58, 0)]


def test_summary_counts_busy_samples_and_each_throttle_reason():
    assert clocks.summarize(clocks.parse(LINES)) == (
        "clocks: 4 busy samples of 5; SM clock 1500-1980 MHz (median 1972), power up to 648 W, up to 64 C; "
        "2 throttled by software power cap at 1500-1965 MHz")


def test_summary_of_an_unthrottled_and_of_an_idle_run():
    steady = "t, 1980 MHz, 3201 MHz, 500.00 W, 50, 0x0000000000000000\n"
    assert clocks.summarize(clocks.parse(steady * 3)).endswith("; none throttled")
    idle = "t, 345 MHz, 3201 MHz, 80.00 W, 38, 0x0000000000000001\n"
    assert clocks.summarize(clocks.parse(idle * 2)) == "clocks: 2 samples, none busy (every sample idle)"
    assert clocks.summarize([]) == "clocks: no samples (nvidia-smi printed none)"


def test_reason_names_cover_combined_and_unknown_bits():
    assert clocks.names(0x4 | 0x40) == "software power cap, hardware thermal slowdown"
    assert clocks.names(0x1000) == "0x1000"
    assert clocks.names(0) == "none"


@pytest.mark.parametrize("line, message", [
    ("t, 1980 MHz, 3201 MHz, 500 W, 0x0", r"must have 6 comma-separated fields .* got 5"),
    ("t, fast MHz, 3201 MHz, 500 W, 50, 0x0", r"must hold numbers in MHz units, got 'fast MHz'"),
    ("t, 1980 MHz, 3201 MHz, 500 W, 50, none", r"must end with a hexadecimal reason mask, got 'none'"),
])
def test_bad_lines_are_refused_with_what_was_expected(line, message):
    with pytest.raises(ValueError, match=message):
        clocks.parse(line)


def test_lines_of_unsupported_fields_are_skipped():
    assert clocks.parse("t, [N/A], 3201 MHz, [N/A], 50, 0x0\n") == []


def test_cli_prints_the_summary_and_refuses_a_missing_file(tmp_path, capsys):
    path = tmp_path / "clocks.csv"
    path.write_text(LINES)
    assert clocks.main([str(path)]) == 0
    assert capsys.readouterr().out.startswith("clocks: 4 busy samples of 5;")
    with pytest.raises(SystemExit):
        clocks.main([str(tmp_path / "missing.csv")])
    assert "csv must be a file of nvidia-smi samples, got" in capsys.readouterr().err
    path.write_text("t, 1980 MHz\n")
    assert clocks.main([str(path)]) == 2
    assert "bench.clocks: clocks line must have 6" in capsys.readouterr().err
