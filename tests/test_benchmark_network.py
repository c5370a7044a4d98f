"""The network benchmark: spconv's reference network on the core API, end to end on a small scene.

No timing is asserted. The CPU smoke run checks every row is there with a
sparsecore time and, where spconv is importable, that spconv agrees. The
network's backward is checked against a directional derivative of its
forward. The CUDA path of the suite (CUDA-event clock, device transfers,
memory hook, the TF32 child process) is dry-run on a stand-in ``cupy``
module that keeps NumPy arrays, so the core runs on its NumPy backend. The
CPU smoke run also draws its ``--plot`` PNG (where matplotlib is installed),
and its ``--json`` is plotted again with ``plots.plot_rows``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from sparsecore.benchmark import network, network_checks
from sparsecore.benchmark.cli import build_parser
from sparsecore.benchmark.network_command import network_options
from sparsecore.benchmark.network_suite import case_row_keys, run_network_suite
from sparsecore.benchmark.timing import THREAD_VARIABLES

REPOSITORY = Path(__file__).resolve().parents[1]


def _spconv_importable() -> bool:
    return importlib.util.find_spec("spconv") is not None and importlib.util.find_spec("torch") is not None


def _run_benchmark(arguments: list[str], environment: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sparsecore.benchmark", *arguments], capture_output=True,
                          text=True, timeout=300, env=environment, cwd=REPOSITORY)


def test_reference_network_layout() -> None:
    layers = network.REFERENCE_NETWORK
    convs = [layer for layer in layers if layer.kind == "subm"]
    pools = [layer for layer in layers if layer.kind == "maxpool"]
    assert (len(layers), len(convs), len(pools)) == (20, 14, 6)
    assert [layer.index for layer in layers] == list(range(20))
    assert [(layer.in_channels, layer.out_channels) for layer in convs[::2]] == [
        (3, 64), (64, 96), (96, 128), (128, 160), (160, 192), (192, 224), (224, 256)]
    assert all(second.in_channels == second.out_channels == first.out_channels
               for first, second in zip(convs[::2], convs[1::2]))
    assert [layer.indice_key for layer in convs] == [f"c{block}" for block in range(7) for _ in range(2)]
    assert sum(layer.builds_rulebook for layer in layers) == 13
    assert [layers.index(pool) for pool in pools] == [2, 5, 8, 11, 14, 17]
    for first, second in zip(layers, layers[1:]):
        assert second.in_channels == first.out_channels


def test_network_backward_is_the_derivative_of_its_forward() -> None:
    scene = network.network_scene("synthetic", "small", seed=4)
    keep = scene.indices[:, 2] < 40  # a strip of the scene keeps this quick
    features = scene.features[keep].astype(np.float64)
    indices = np.ascontiguousarray(scene.indices[keep])
    weights = tuple(None if weight is None else weight.astype(np.float64)
                    for weight in network.network_weights(network.REFERENCE_NETWORK, seed=4))
    generator = np.random.default_rng(5)
    state = network.core_forward(features, indices, scene.spatial_shape, weights)
    grad_output = generator.standard_normal(state.output.shape)
    grad_features, weight_grads = network.core_backward(state, grad_output, weights)
    assert grad_features.shape == features.shape
    assert [grad is None for grad in weight_grads] == [weight is None for weight in weights]
    direction = generator.standard_normal(features.shape)
    step = 1e-6

    def objective(shift: float) -> float:
        moved = network.core_forward(features + shift * direction, indices, scene.spatial_shape, weights)
        return float(np.sum(moved.output * grad_output))

    numeric = (objective(step) - objective(-step)) / (2 * step)
    analytic = float(np.sum(grad_features * direction))
    assert analytic != 0.0
    assert numeric == pytest.approx(analytic, rel=1e-5, abs=1e-12)


def test_spconv_pool_floor_is_max_with_zero() -> None:
    scene = network.network_scene("synthetic", "small", seed=1)
    generator = np.random.default_rng(2)
    layers = network.REFERENCE_NETWORK[:3]  # two convs and a pool
    weights = tuple(None if weight is None else weight for weight in network.network_weights(layers, seed=2))
    features = generator.standard_normal(scene.features.shape).astype(np.float32)
    plain = network.core_forward(features, scene.indices, scene.spatial_shape, weights, layers)
    floored = network.core_forward(features, scene.indices, scene.spatial_shape, weights, layers,
                                   spconv_pool_floor=True)
    assert np.array_equal(floored.output, np.maximum(plain.output, 0))
    assert np.all(floored.argmaxes[2][plain.output < 0] == -1)
    assert np.any(plain.output < 0)


def test_relative_error_is_the_norm_ratio() -> None:
    rng = np.random.default_rng(41)
    reference = rng.standard_normal((30, 4))
    noise = rng.standard_normal((30, 4))
    values = (reference + 1e-3 * noise).astype(np.float16)
    expected = np.linalg.norm(values.astype(np.float64) - reference) / np.linalg.norm(reference)
    assert network_checks.relative_error(values, reference) == pytest.approx(expected, rel=1e-12)
    assert network_checks.relative_error(np.zeros((0, 4)), np.zeros((0, 4))) == 0.0
    with pytest.raises(ValueError, match=r"shapes \(2, 4\) and \(3, 4\) differ"):
        network_checks.relative_error(np.ones((2, 4)), np.ones((3, 4)))


def test_network_options_defaults_and_errors() -> None:
    parser = build_parser()
    cpu = network_options(parser.parse_args(["network", "--scale", "small"]))
    assert (cpu.device, cpu.scenes, cpu.dtypes, cpu.spconv_algorithms) == (
        "cpu", ("synthetic",), ("float32",), ("native",))
    gpu = network_options(parser.parse_args(["gpu"]))
    assert (gpu.device, gpu.scenes, gpu.dtypes) == ("cuda", ("basic", "large"), ("float32", "float16", "tf32"))
    assert gpu.memory and gpu.spconv_algorithms == ("native", "implicit_gemm")
    for bad in (["network", "--dtype", "tf32"], ["network", "--scene", "huge"],
                ["network", "--spconv-algo", "implicit_gemm"], ["gpu", "--repeat", "0"]):
        with pytest.raises(SystemExit):
            network_options(parser.parse_args(bad))


def test_time_limit_skips_the_cases_left() -> None:
    options = network_options(build_parser().parse_args(
        ["network", "--scale", "small", "--no-spconv", "--time-limit", "0"]))
    header, rows = run_network_suite(options)
    assert [(row.case, row.agreement) for row in rows] == [("synthetic float32 network", "SKIPPED")]
    assert "scene synthetic" in header


def test_network_benchmark_on_small_synthetic_scene_cpu(tmp_path: Path) -> None:
    json_path, markdown_path = tmp_path / "rows.json", tmp_path / "rows.md"
    plot_path = tmp_path / "figures" / "network.png"  # a missing directory is created
    plotting = importlib.util.find_spec("matplotlib") is not None
    completed = _run_benchmark(["network", "--device", "cpu", "--scale", "small", "--repeat", "1",
                                "--json", str(json_path), "--markdown", str(markdown_path),
                                *(["--plot", str(plot_path)] if plotting else [])])
    assert completed.returncode == 0, completed.stdout + completed.stderr
    document = json.loads(json_path.read_text())
    rows = document["rows"]
    spconv = _spconv_importable()
    assert [(row["case"], row["stage"]) for row in rows] == case_row_keys(
        "synthetic float32", ("native",) if spconv else (), layers=True)
    for row in rows:
        assert row["sparsecore_ms"] is not None and row["sparsecore_ms"] >= 0, row
    assert "13 rulebook builds included" in rows[0]["notes"]
    for label in ("device", "scene synthetic", "timing", "network", "spconv"):
        assert label in document["header"] and label in completed.stdout
    summary = markdown_path.read_text()
    assert "| synthetic float32 network | forward |" in summary and "L01 SubMConv3d" not in summary
    if spconv:
        assert "compared" in document["header"]["spconv"], document["header"]["spconv"]
        for row in rows[:2]:
            assert row["spconv_ms"] is not None and row["ratio_spconv_over_sparsecore"] is not None, row
            assert row["agreement"].startswith("ok"), row
        # both engines against the float64 network: float32 rounding only
        note = next(note for note in rows[1]["notes"] if note.startswith("rel. error vs float64"))
        errors = [float(value) for value in re.findall(r"\d\.\de[+-]\d+", note)]
        assert len(errors) == 4 and all(0 < error < 1e-3 for error in errors), note
    else:
        assert all(row["spconv_ms"] is None for row in rows)
    if plotting:
        from sparsecore.benchmark.plots import load_rows, plot_rows

        for path in (plot_path, plot_rows("network", *load_rows(json_path), tmp_path / "replot.png")):
            assert path.is_file() and path.stat().st_size > 1000
            assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


_STAND_IN_CUPY = '''
"""A stand-in for CuPy on NumPy: arrays stay NumPy, events read the host clock."""
import time
import numpy

__version__ = "stand-in"


class ndarray:  # no array is ever one: the core keeps its NumPy backend
    pass


def asarray(array):
    return numpy.asarray(array)


def asnumpy(array):
    return numpy.asarray(array)


class _Pool:
    def total_bytes(self):
        return 0


def get_default_memory_pool():
    return _Pool()


class cuda:
    class runtime:
        @staticmethod
        def getDeviceCount():
            return 1

        @staticmethod
        def getDevice():
            return 0

        @staticmethod
        def getDeviceProperties(device):
            return {"name": b"Stand-in GPU", "multiProcessorCount": 1, "totalGlobalMem": 2**30}

        @staticmethod
        def runtimeGetVersion():
            return 0

        @staticmethod
        def driverGetVersion():
            return 0

    class Event:
        def record(self):
            self.time = time.perf_counter()

    class _Stream:
        def synchronize(self):
            return None

    class MemoryHook:
        def __enter__(self):
            return self

        def __exit__(self, *exception):
            return False

    @staticmethod
    def get_elapsed_time(start, stop):
        return (stop.time - start.time) * 1000.0

    @staticmethod
    def get_current_stream():
        return cuda._Stream()
'''


def test_cuda_path_dry_run_on_a_stand_in_cupy(tmp_path: Path) -> None:
    stand_in = tmp_path / "stand_in"
    (stand_in / "cupy").mkdir(parents=True)
    (stand_in / "cupy" / "__init__.py").write_text(textwrap.dedent(_STAND_IN_CUPY))
    environment = dict(os.environ, PYTHONPATH=os.pathsep.join([str(stand_in), str(REPOSITORY)]), CUPY_TF32="0")
    # the stand-in device is NumPy: one BLAS thread, as the cpu suite runs (a busy machine slows threads a lot)
    environment.update({variable: "1" for variable in THREAD_VARIABLES})
    json_path = tmp_path / "gpu.json"
    completed = _run_benchmark(["gpu", "--scene", "synthetic", "--scale", "small", "--repeat", "1",
                                "--warmup", "1", "--profile-runs", "1", "--no-spconv", "--no-layers",
                                "--json", str(json_path)], environment)
    assert completed.returncode == 0, completed.stdout + completed.stderr
    document = json.loads(json_path.read_text())
    keys = [(row["case"], row["stage"]) for row in document["rows"]]
    for dtype in ("float32", "float16", "tf32"):  # the TF32 rows from the child process, bitwise row included
        expected = case_row_keys(f"synthetic {dtype}", (), layers=False, bitwise=True)
        assert [key for key in keys if key[0].startswith(f"synthetic {dtype} ")] == expected
    bitwise = [row for row in document["rows"] if row["stage"] == "two runs bitwise equal"]
    assert [row["agreement"] for row in bitwise] == ["ok"] * 3, bitwise
    memory = [row for row in document["rows"] if row["case"].startswith("memory SubMConv3d 64->64")]
    assert [row["stage"] for row in memory] == ["float32 peak MiB (not ms)", "float16 peak MiB (not ms)"]
    assert all(row["sparsecore_ms"] is not None for row in memory), memory
    for row in memory:
        assert any(re.fullmatch(r"rulebook \+ forward \+ backward [\d.]+ ms \(median of \d+\)", note)
                   for note in row["notes"]), row["notes"]
    assert "CUPY_TF32=1" in document["header"]["child"]
    assert "Stand-in GPU" in document["header"]["device"]
    # the device targets' verdicts end the output: no spconv here, so speed and memory are not measured
    verdicts = completed.stdout.split("issue 28's device targets:")[1]
    assert verdicts.count("\nNOT MEASURED ") == 12 + 2  # speed: 2 scenes x 3 dtypes x 2 directions; memory: 2
    assert "PASS         two runs bitwise equal" in verdicts
    assert "device targets: 1 PASS, 0 FAIL, 14 NOT MEASURED" in verdicts
