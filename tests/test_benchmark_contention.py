"""sparsecore.benchmark.contention: the fair share, the crop, the busy processes, the table and the command.

Oracles: the fair-share formula written out by hand, a NumPy selection of the crop, the process table
(/proc) for the busy processes, and a short run of the command itself (no timed assertions).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from sparsecore.benchmark import contention, scenes


def test_fair_share_is_the_even_split_of_the_cores() -> None:
    # two threads on two cores: beside 2 busy processes 4 runnable on 2 cores (2x), beside 4: 3x
    assert contention.fair_share(0, 2, 2) == 1.0
    assert contention.fair_share(1, 2, 2) == 1.5
    assert contention.fair_share(2, 2, 2) == 2.0 and contention.fair_share(4, 2, 2) == 3.0
    assert contention.fair_share(1, 1, 2) == 1.0 and contention.fair_share(4, 1, 2) == 2.5
    assert contention.fair_share(2, 4, 2) == 1.5  # 4 threads on 2 cores are already 2x oversubscribed


def test_crop_keeps_the_sites_nearest_the_middle_row() -> None:
    rng = np.random.default_rng(3)
    indices = np.concatenate([np.zeros((300, 1)), rng.integers(0, 40, (300, 3))], axis=1).astype(np.int32)
    features = rng.standard_normal((300, 4)).astype(np.float32)
    scene = scenes.VoxelScene(features, indices, (40, 40, 40), 1, "test")
    cropped_features, cropped_indices = contention.crop_scene(scene, 100)
    distance = np.abs(indices[:, 2] - int(np.median(indices[:, 2])))
    assert len(cropped_indices) == 100
    kept = np.abs(cropped_indices[:, 2] - int(np.median(indices[:, 2])))
    assert kept.max() <= np.sort(distance)[99]  # no site farther than the 100th nearest
    rows = [np.flatnonzero((indices == row).all(axis=1))[0] for row in cropped_indices]
    assert np.array_equal(cropped_features, features[rows]) and rows == sorted(rows)  # original order kept
    whole_features, whole_indices = contention.crop_scene(scene, 1000)
    assert whole_indices is indices and whole_features is features


def test_busy_processes_run_during_the_block_and_stop_after() -> None:
    with contention.busy_processes(2, "python", settle=0.05) as pids:
        assert len(pids) == 2
        assert all(os.path.exists(f"/proc/{pid}") for pid in pids)
    time.sleep(0.05)
    for pid in pids:  # reaped: gone from the process table (or a zombie no longer)
        assert not os.path.exists(f"/proc/{pid}") or "Z" in open(f"/proc/{pid}/stat").read().split()[2]
    with contention.busy_processes(0) as none:
        assert none == []


def test_table_divides_by_the_quiet_median() -> None:
    cells = [contention.ContentionCell("torch step", 2, 0, (0.100, 0.120, 0.110)),
             contention.ContentionCell("torch step", 2, 2, (0.300, 0.200, 0.250))]
    table = contention.format_cells(cells, cores=2)
    assert "| torch step | 2 | 2 | 250.0 | 300 200 250 | 2.27x | 2.00x | 1.14 | - |" in table, table
    placed = contention.ContentionCell("torch step", 2, 4, (0.3,), cores_used=(1, 2, 0, 2, 1, 2))
    assert placed.one_core == "2/5"  # 0: /proc did not say


def _spin(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="needs Linux /proc")
def test_placement_names_the_cores_of_the_threads_that_worked() -> None:
    """Oracle: the cores the test pins its own threads to (sched_setaffinity per thread)."""
    cores = sorted(os.sched_getaffinity(0))
    idle_started, release = threading.Event(), threading.Event()

    def idle() -> None:  # a thread that exists but does not run during the step
        os.sched_setaffinity(0, {cores[-1]})
        idle_started.set()
        release.wait()

    def step(worker_core: int) -> frozenset[int]:
        spun, done = threading.Event(), threading.Event()

        def work() -> None:
            os.sched_setaffinity(0, {worker_core})
            started.wait()
            _spin(0.05)
            spun.set()
            done.wait()  # alive at the second snapshot, as a pool's worker is

        started = threading.Event()
        worker = threading.Thread(target=work)
        worker.start()
        before = contention.thread_placement()
        started.set()
        _spin(0.05)
        spun.wait()
        after = contention.thread_placement()
        done.set()
        worker.join()
        return contention.cores_of_working_threads(before, after)

    sleeper = threading.Thread(target=idle)
    sleeper.start()
    idle_started.wait()
    original = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, {cores[0]})  # this (main) thread only
        assert step(cores[0]) == {cores[0]}  # the sleeper on cores[-1] did not run and does not count
        if len(cores) > 1:
            assert step(cores[1]) == {cores[0], cores[1]}
    finally:
        os.sched_setaffinity(0, original)
        release.set()
        sleeper.join()
    placement = contention.thread_placement()
    assert threading.get_native_id() in placement and placement[threading.get_native_id()][1] in cores


def test_bad_options_are_usage_errors(capsys: pytest.CaptureFixture) -> None:
    from sparsecore.benchmark.cli import build_parser

    for argv in (["contention", "--busy", "1,-2"], ["contention", "--workload", "nothing"],
                 ["contention", "--threads", "two"]):
        with pytest.raises(SystemExit) as raised:
            build_parser().parse_args(argv)
        assert raised.value.code == 2 and "error: argument" in capsys.readouterr().err
    arguments = build_parser().parse_args(["contention"])
    assert arguments.busy == (0, 1, 2, 4) and arguments.threads == (1, 2) and arguments.workload == contention.WORKLOADS


@pytest.mark.slow
def test_the_command_prints_a_row_per_cell() -> None:
    completed = subprocess.run(
        [sys.executable, "-m", "sparsecore.benchmark", "contention", "--workload", "core network", "--sites", "2000",
         "--busy", "0,1", "--threads", "1", "--repeat", "1", "--iterations", "1", "--settle", "0.05"],
        capture_output=True, text=True, timeout=600)
    assert completed.returncode == 0, completed.stderr
    rows = [line for line in completed.stdout.splitlines() if line.startswith("| core network |")]
    assert [row.split("|")[2:4] for row in rows] == [[" 1 ", " 0 "], [" 1 ", " 1 "]], completed.stdout
    assert "OpenMP waits:" in completed.stdout and "load average before" in completed.stdout
