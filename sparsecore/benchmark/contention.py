"""``python -m sparsecore.benchmark contention``: how much slower a step gets beside busy processes.

Two workloads on a crop of the real scan (``lidar_voxels_125k.npz``, the
``--sites`` sites nearest the middle of its y axis):

- ``torch step``: a `sparsecore.torch` training step, three SubMConv3d
  (4->32->32->32) with BatchNorm and ReLU, then a SparseConv3d(k3, s2) 32->64
  with BatchNorm, a mean-square loss and an Adam step (needs torch);
- ``core network``: the core's basic network (`sparsecore.benchmark.network`,
  spconv's reference network without torch), forward with every rulebook
  build and backward.

Each is timed quiet and beside 1, 2 and 4 busy processes that the command
starts and stops itself (``--spinner python``: ``while True: pass``;
``numpy``: small one-thread matrix products), at each ``--threads`` count
(sparsecore's and torch's threads alike). The load levels take turns within
every repetition, and each cell is the median over repetitions of the median of
``--iterations`` runs, so the other users of a shared machine move all levels
alike. The slowdown is judged against the fair share of the cores: with ``b``
busy processes beside ``t`` threads on ``c`` cores, ``max(1, (b + t) / c)``
times the quiet time (only ``t`` threads ever run, so ``max(1, t/c)`` is the
quiet baseline already). The last column, ``one core``, counts the timed runs
whose working threads last ran on one core (from ``/proc``, Linux): beside
busy processes a multi-threaded step is slower when the scheduler puts its
threads on different cores.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from sparsecore.benchmark import scenes

__all__ = ["add_parser", "run_contention_command", "busy_processes", "fair_share", "crop_scene",
           "ContentionCell", "thread_placement", "cores_of_working_threads"]

SPINNERS = {
    "python": "while True: pass",
    "numpy": ("import numpy as np\na = np.ones((64, 64))\nwhile True:\n    a = a @ a\n    a /= a.max()"),
}
WORKLOADS = ("torch step", "core network")


def add_parser(suites: Any) -> None:
    """Adds the ``contention`` sub-command to ``suites`` (an argparse sub-parsers object)."""
    parser = suites.add_parser(
        "contention",
        help="a torch training step and the core network, quiet and beside 1, 2 and 4 busy processes",
        description=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--busy", type=_int_list, default=(0, 1, 2, 4),
                        help="comma-separated counts of busy processes to start beside the run (0: quiet)")
    parser.add_argument("--threads", type=_int_list, default=(1, 2),
                        help="comma-separated thread counts of sparsecore and torch")
    parser.add_argument("--workload", type=_name_list, default=WORKLOADS,
                        help=f"comma-separated workloads: {', '.join(WORKLOADS)}")
    parser.add_argument("--sites", type=int, default=40_000, help="sites of the real scan to keep")
    parser.add_argument("--repeat", type=int, default=3, help="repetitions; the load levels take turns in each")
    parser.add_argument("--iterations", type=int, default=3, help="timed runs per cell and repetition")
    parser.add_argument("--spinner", choices=sorted(SPINNERS), default="python", help="what a busy process runs")
    parser.add_argument("--settle", type=float, default=0.3, help="seconds the busy processes run before timing")
    parser.add_argument("--seed", type=int, default=0, help="random seed of features and weights")


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(item) for item in text.split(",") if item.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 0:
        raise argparse.ArgumentTypeError(f"expected non-negative integers, got {text!r}")
    return values


def _name_list(text: str) -> tuple[str, ...]:
    names = tuple(item.strip() for item in text.split(",") if item.strip())
    unknown = [name for name in names if name not in WORKLOADS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"workloads are {', '.join(WORKLOADS)}; got {text!r}")
    return names


def fair_share(busy: int, threads: int, cores: int) -> float:
    """The slowdown an even split of ``cores`` between ``busy`` spinners and ``threads`` workers gives."""
    return max(1.0, (busy + threads) / cores) / max(1.0, threads / cores)


@contextlib.contextmanager
def busy_processes(count: int, spinner: str = "python", settle: float = 0.3) -> Iterator[list[int]]:
    """Runs ``count`` busy processes beside the block and stops them after.

    Yields:
        Their process ids.
    """
    environment = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
    processes = [subprocess.Popen([sys.executable, "-c", SPINNERS[spinner]], stdin=subprocess.DEVNULL,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=environment)
                 for _ in range(count)]
    try:
        if count:
            time.sleep(settle)
        yield [process.pid for process in processes]
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            process.wait(timeout=30)


def crop_scene(scene: scenes.VoxelScene, sites: int) -> tuple[np.ndarray, np.ndarray]:
    """The ``sites`` sites of ``scene`` nearest the middle of its y axis (a band across the scan)."""
    indices = scene.indices
    if sites >= len(indices):
        return scene.features, indices
    y = indices[:, 2].astype(np.int64)
    order = np.argsort(np.abs(y - int(np.median(y))), kind="stable")[:sites]
    order.sort()
    return np.ascontiguousarray(scene.features[order]), np.ascontiguousarray(indices[order])


@dataclass(frozen=True)
class ContentionCell:
    """One workload at one thread count and load level.

    Attributes:
        workload: ``"torch step"`` or ``"core network"``.
        threads: sparsecore's and torch's thread count.
        busy: busy processes beside it.
        seconds: the median per repetition.
        cores_used: per timed run, how many cores the threads that worked in it last ran on
            (`cores_of_working_threads`; 0 where /proc does not say).
    """

    workload: str
    threads: int
    busy: int
    seconds: tuple[float, ...]
    cores_used: tuple[int, ...] = ()

    @property
    def one_core(self) -> str:
        """``"k/n"``: of the ``n`` runs whose placement is known, ``k`` had their working threads on one core."""
        known = [count for count in self.cores_used if count]
        return f"{sum(count == 1 for count in known)}/{len(known)}" if known else "-"

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)


def _torch_step(features: np.ndarray, indices: np.ndarray, spatial_shape: tuple[int, ...], seed: int
                ) -> Callable[[], None]:
    import torch

    import sparsecore.torch as spconv

    torch.manual_seed(seed)
    channels = features.shape[1]
    model = spconv.SparseSequential(
        spconv.SubMConv3d(channels, 32, 3, bias=False, indice_key="subm"), torch.nn.BatchNorm1d(32), torch.nn.ReLU(),
        spconv.SubMConv3d(32, 32, 3, bias=False, indice_key="subm"), torch.nn.BatchNorm1d(32), torch.nn.ReLU(),
        spconv.SubMConv3d(32, 32, 3, bias=False, indice_key="subm"), torch.nn.BatchNorm1d(32), torch.nn.ReLU(),
        spconv.SparseConv3d(32, 64, 3, stride=2, padding=1, bias=False), torch.nn.BatchNorm1d(64),
    )
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    feature_tensor = torch.from_numpy(features)
    index_tensor = torch.from_numpy(indices)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        tensor = spconv.SparseConvTensor(feature_tensor, index_tensor, list(spatial_shape), 1)
        loss = model(tensor).features.square().mean()
        loss.backward()
        optimizer.step()

    return step


def _core_network(features: np.ndarray, indices: np.ndarray, spatial_shape: tuple[int, ...], seed: int
                  ) -> Callable[[], None]:
    from sparsecore.benchmark.network import REFERENCE_NETWORK, core_backward, core_forward, network_weights

    weights = network_weights(REFERENCE_NETWORK, seed)
    inputs = np.ascontiguousarray(features[:, :REFERENCE_NETWORK[0].in_channels])

    def step() -> None:
        state = core_forward(inputs, indices, spatial_shape, weights)
        gradient = np.ones_like(state.output)
        core_backward(state, gradient, weights)

    return step


def _set_threads(threads: int) -> None:
    import sparsecore

    sparsecore.set_num_threads(threads)
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(threads)


def thread_placement() -> dict[int, tuple[int, int]]:
    """This process's threads: ``{thread id: (nanoseconds run so far, the core it last ran on)}``.

    Read from ``/proc/self/task/*/schedstat`` and ``stat`` (Linux); empty where they do not exist.
    """
    placement = {}
    try:
        thread_ids = os.listdir("/proc/self/task")
    except OSError:
        return placement
    for thread_id in thread_ids:
        try:
            with open(f"/proc/self/task/{thread_id}/schedstat") as handle:
                run_nanoseconds = int(handle.read().split()[0])
            with open(f"/proc/self/task/{thread_id}/stat") as handle:
                status = handle.read()
            fields = status[status.rindex(")") + 2:].split()  # field 3 (state) onwards; field 39 is the core
            placement[int(thread_id)] = (run_nanoseconds, int(fields[36]))
        except (OSError, ValueError, IndexError):  # the thread ended meanwhile, or a kernel without the field
            continue
    return placement


def cores_of_working_threads(before: dict[int, tuple[int, int]], after: dict[int, tuple[int, int]]
                             ) -> frozenset[int]:
    """The cores that the threads which ran between two `thread_placement` snapshots last ran on.

    Beside busy processes a two-thread step is bimodal: with both threads on one core it stays near
    its fair share, with one on each core (each beside its own busy processes) every barrier waits
    for a thread queued behind them (docs/performance.md, 'On a shared machine').
    """
    return frozenset(core for thread_id, (run_nanoseconds, core) in after.items()
                     if thread_id in before and run_nanoseconds > before[thread_id][0])


def _timed(step: Callable[[], None], iterations: int) -> tuple[float, list[int]]:
    """The median seconds of ``iterations`` runs of ``step``, and per run how many cores its threads used."""
    times, cores_used = [], []
    for _ in range(iterations):
        before = thread_placement()
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
        cores_used.append(len(cores_of_working_threads(before, thread_placement())))
    return statistics.median(times), cores_used


def run_contention_command(arguments: argparse.Namespace) -> int:
    """Runs the ``contention`` sub-command; returns the exit status."""
    if arguments.repeat < 1 or arguments.iterations < 1 or arguments.sites < 1:
        raise SystemExit("error: --repeat, --iterations and --sites must be at least 1, got "
                         f"{arguments.repeat}, {arguments.iterations}, {arguments.sites}")
    import sparsecore
    from sparsecore.threads import default_num_threads

    cores = len(os.sched_getaffinity(0))
    pool = default_num_threads()
    if max(arguments.threads) > pool:
        raise SystemExit(f"error: --threads {max(arguments.threads)} exceeds sparsecore's pool of {pool}; "
                         f"start with SPARSECORE_NUM_THREADS={max(arguments.threads)}")
    scene = scenes.load_voxel_scene(scenes.require_data_file(None, scenes.VOXELS_FILE_NAME))
    features, indices = crop_scene(scene, arguments.sites)
    builders = {"torch step": _torch_step, "core network": _core_network}
    steps = {}
    for workload in arguments.workload:
        try:
            steps[workload] = builders[workload](features, indices, scene.spatial_shape, arguments.seed)
        except ImportError as error:
            print(f"# {workload}: skipped ({error})")
    loads_before = os.getloadavg()
    print(f"# {len(indices)} sites of {scene.source}; {cores} cores; threading layer "
          f"{sparsecore.threads.threading_layer()}; OpenMP waits: {sparsecore.threads.openmp_wait_policy()}; "
          f"spinner {arguments.spinner}; load average before "
          + " ".join(f"{value:.2f}" for value in loads_before), flush=True)
    for threads in arguments.threads:  # warm-up: compiles every kernel at every thread count
        _set_threads(threads)
        for step in steps.values():
            step()
    samples: dict[tuple[str, int, int], list[float]] = {}
    placements: dict[tuple[str, int, int], list[int]] = {}
    for repetition in range(arguments.repeat):
        levels = arguments.busy if repetition % 2 == 0 else tuple(reversed(arguments.busy))
        for busy in levels:
            with busy_processes(busy, arguments.spinner, arguments.settle):
                for threads in arguments.threads:
                    _set_threads(threads)
                    for workload, step in steps.items():
                        seconds, cores_used = _timed(step, arguments.iterations)
                        samples.setdefault((workload, threads, busy), []).append(seconds)
                        placements.setdefault((workload, threads, busy), []).extend(cores_used)
        print(f"# repetition {repetition + 1}/{arguments.repeat} done, load average {os.getloadavg()[0]:.2f}",
              flush=True)
    cells = [ContentionCell(*key, tuple(times), tuple(placements[key])) for key, times in samples.items()]
    print(format_cells(cells, cores))
    print("# one core: runs whose working threads last ran on one core, of those /proc placed (beside busy "
          "processes, runs with the threads on different cores are the slow ones)")
    print("# load average after " + " ".join(f"{value:.2f}" for value in os.getloadavg())
          + " (the busy processes count in it)")
    return 0


def format_cells(cells: Sequence[ContentionCell], cores: int) -> str:
    """The table: one row per workload, threads and load level, with slowdown and fair share."""
    quiet = {(cell.workload, cell.threads): cell.median for cell in cells if cell.busy == 0}
    lines = ["| workload | threads | busy | median ms | runs (ms) | slowdown | fair share | over fair | one core |",
             "| --- | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: |"]
    for cell in sorted(cells, key=lambda cell: (cell.workload, cell.threads, cell.busy)):
        base = quiet.get((cell.workload, cell.threads))
        slowdown = cell.median / base if base else float("nan")
        share = fair_share(cell.busy, cell.threads, cores)
        runs = " ".join(f"{seconds * 1e3:.0f}" for seconds in cell.seconds)
        lines.append(f"| {cell.workload} | {cell.threads} | {cell.busy} | {cell.median * 1e3:.1f} | {runs} | "
                     f"{slowdown:.2f}x | {share:.2f}x | {slowdown / share:.2f} | {cell.one_core} |")
    return "\n".join(lines)
