"""The ``int8`` benchmark suite: its command line, its alternating timer, and that its int8 layer is right."""

from __future__ import annotations

import numpy as np
import pytest

import sparsecore as sc
from sparsecore.benchmark import cli, scenes
from sparsecore.benchmark import int8 as suite


def test_command_line_registers_the_suite() -> None:
    arguments = cli.build_parser().parse_args(["int8", "--threads", "1,2", "--repeat", "3", "--layers",
                                               "subm 16->16,strided 32->64", "--no-backbone"])
    assert arguments.suite == "int8" and arguments.threads == "1,2" and arguments.repeat == 3
    assert arguments.device == "cpu" and arguments.no_backbone
    assert [layer.name for layer in suite._selected_layers(arguments.layers)] == ["subm 16->16", "strided 32->64"]
    assert suite._selected_layers("") == list(suite.LAYERS)
    with pytest.raises(SystemExit, match="unknown layer 'subm 8->8'"):
        suite._selected_layers("subm 8->8")


def test_alternating_timer_runs_each_function_in_turn() -> None:
    calls: list[str] = []
    functions = {(threads, name): (lambda threads=threads, name=name: calls.append(f"{name}{threads}"))
                 for threads in (1, 2) for name in ("float32", "b")}
    times = suite.time_alternating(functions, 3, lambda: None)
    assert calls == ["float321", "b1", "float322", "b2"] * 4  # one warm-up round, then three timed ones
    assert [len(values) for values in times.values()] == [3, 3, 3, 3]
    rows = suite._layer_rows("subm 16->16", (1, 2), ["float32", "b"], times)
    assert [(row.threads, row.variant) for row in rows] == [(1, "float32"), (1, "b"), (2, "float32"), (2, "b")]
    assert rows[0].relative_to_float == 1.0 and rows[0].relative_to_one_thread == 1.0
    assert rows[3].relative_to_one_thread == pytest.approx(np.median(times[(1, "b")]) / np.median(times[(2, "b")]))
    text = suite.format_rows(rows)
    assert "float / this" in text and "1 thread / this" in text and "\nsubm 16->16" in text


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
