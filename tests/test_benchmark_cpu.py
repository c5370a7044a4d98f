"""The CPU benchmark's rates, peaks, --busy and --threads (sparsecore.benchmark.cpu, timing, cli).

Oracles: the FLOP and byte counts of the issue's worked example (SubMConv3d
16->16 on 788,888 pairs: 0.40 GFLOP, 101 MB), arithmetic on fixed inputs, and
the operating system's process table for the busy process.
"""

from __future__ import annotations

import os

import pytest

from sparsecore.benchmark.cases import LayerSpec
from sparsecore.benchmark.cli import build_parser
from sparsecore.benchmark.cpu import layer_work, rate_note
from sparsecore.benchmark.timing import MachinePeaks, busy_process, measure_peaks


def test_layer_work_matches_the_worked_example():
    layer = LayerSpec("SubMConv3d 16->16 k3", "subm", 16, 16)
    flops, moved = layer_work(layer, 788_888, "forward")
    assert flops == 2 * 788_888 * 16 * 16 and abs(flops / 1e9 - 0.404) < 1e-3
    assert moved == 4 * 788_888 * 32 and abs(moved / 1e6 - 101.0) < 0.1
    assert layer_work(layer, 788_888, "backward") == (2 * flops, 2 * moved)


def test_rate_note_reports_rates_and_share_of_peak():
    peaks = MachinePeaks(gflops=100.0, gigabytes_per_second=20.0, threads=1)
    note = rate_note(5e9, 2e9, 0.5, peaks)
    assert note == "10.0 GFLOP/s (10% of peak), 4.0 GB/s (20%)"
    assert rate_note(5e9, 2e9, 0.5, None) == "10.0 GFLOP/s, 4.0 GB/s"


def test_measure_peaks_is_positive():
    peaks = measure_peaks(1, repeat=1)
    assert peaks.gflops > 0 and peaks.gigabytes_per_second > 0 and peaks.threads == 1


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads the process table")
def test_busy_process_runs_beside_the_block_and_stops():
    with busy_process() as description:
        pid = int(description.split("pid ")[1].rstrip(")"))
        assert os.path.exists(f"/proc/{pid}")
    assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z"


def test_cpu_parser_has_busy_and_threads():
    arguments = build_parser().parse_args(["cpu", "--busy", "--threads", "2"])
    assert arguments.busy and arguments.threads == 2
    assert not build_parser().parse_args(["cpu"]).busy
