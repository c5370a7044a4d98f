"""The ``int8`` benchmark suite: its command line, its alternating timer, and that its int8 layer is right."""

from __future__ import annotations

import numpy as np
import pytest

import sparsecore as sc
from sparsecore.benchmark import cli, scenes
from sparsecore.benchmark import int8 as suite


def test_command_line_registers_the_suite() -> None:
    arguments = cli.build_parser().parse_args(["int8", "--threads", "1,2", "--repeat", "3"])
    assert arguments.suite == "int8" and arguments.threads == "1,2" and arguments.repeat == 3
    assert arguments.device == "cpu" and arguments.child is None


def test_alternating_timer_runs_each_function_in_turn() -> None:
    calls: list[str] = []
    times = suite.time_alternating({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, 3,
                                   lambda: None)
    assert calls == ["a", "b"] * 4  # one warm-up round, then three timed ones
    assert [len(values) for values in times.values()] == [3, 3]
    rows = suite._rows("cpu", 1, times)
    assert [row.variant for row in rows] == ["a", "b"] and rows[0].relative_to_float == 1.0
    text = suite.format_rows(rows)
    assert "float / this" in text and "\ncpu" in text


def test_int8_layer_of_the_benchmark_computes_the_float_layer() -> None:
    try:
        inputs = suite.layer_inputs(None, seed=3)
    except FileNotFoundError:
        pytest.skip(f"{scenes.VOXELS_FILE_NAME} is not available")
    variants = suite._variants(inputs, np.float32)
    reference = np.asarray(variants["float32"]())
    dequantized = np.asarray(variants["int8 -> float32"]())
    quantized = np.asarray(variants["int8 -> int8"]())
    assert dequantized.shape == reference.shape == quantized.shape and quantized.dtype == np.int8
    error = np.abs(dequantized - reference).mean() / np.abs(reference).mean()
    assert error < 0.02, f"mean relative error of the int8 layer {error:.4f}"
    same = sc.quantize(dequantized, 0.05)
    np.testing.assert_array_equal(quantized, same)  # requantizing in the epilogue == quantize(float output)
