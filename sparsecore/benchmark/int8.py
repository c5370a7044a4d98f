"""``python -m sparsecore.benchmark int8``: int8, bfloat16 and float32 sparse convolution, layer by layer.

On the CPU: six conv layers of the SECOND-style backbone's sizes on the real
scan (SubMConv3d 16->16, 32->32, 64->64, 128->128; SparseConv3d k3 s2
32->64, 64->128; bias and ReLU, forward, rulebooks built once outside the
timings), each as float32 `sparsecore.conv_forward`, bfloat16 (the same call
on ``ml_dtypes.bfloat16`` arrays), and int8 `sparsecore.int8_conv_forward`
(int8 in, int8 out) on its automatic route (the VNNI kernel where the CPU has
avx512_vnni) and on today's route (``SPARSECORE_CPU_ISA=generic``), at each
thread count in one process (`sparsecore.num_threads`); then the backbone
itself through `sparsecore.runtime`, exported in float32 and in int8
(`sparsecore.benchmark.runtime_int8`; needs torch and onnx). On the GPU
(``--device cuda``): the 64->64 layer, the ``sc_int8_conv`` kernel against
float16 ``conv_forward``.

Variants and thread counts take turns in every round (float32 at 1 thread,
bfloat16 at 1 thread, ..., float32 at 2 threads, ...), so a machine shared
with other work loads them alike; the table gives the median and the minimum
of the rounds and the 1-minute load average.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import asdict, dataclass
from typing import Any, Callable, Sequence

import numpy as np

from sparsecore.benchmark import scenes
from sparsecore.benchmark.timing import (VariantTiming, add_scan_suite_parser, machine_description,
                                         summarize_times, time_alternating)

__all__ = ["LAYERS", "Int8Timing", "add_parser", "run_int8_command", "time_alternating", "layer_inputs",
           "layer_variants", "cpu_layer_rows", "format_rows"]


@dataclass(frozen=True)
class LayerSpec:
    """One benchmark layer: its name, ``"subm"`` or ``"strided"`` (k3 s2 p1), and its channels."""

    name: str
    kind: str
    in_channels: int
    out_channels: int


LAYERS = (LayerSpec("subm 16->16", "subm", 16, 16), LayerSpec("subm 32->32", "subm", 32, 32),
          LayerSpec("subm 64->64", "subm", 64, 64), LayerSpec("subm 128->128", "subm", 128, 128),
          LayerSpec("strided 32->64", "strided", 32, 64), LayerSpec("strided 64->128", "strided", 64, 128))
"""The CPU layers (names as the table prints them)."""

BASELINE = "float32"


@dataclass(frozen=True)
class Int8Timing(VariantTiming):
    """One variant's times (`VariantTiming`: variant, median_ms, min_ms) on one layer, device and thread count.

    Attributes:
        layer: the layer's (or the backbone's) name.
        device: ``"cpu"`` or ``"cuda"``.
        threads: threads of the CPU passes, 0 on the GPU.
        relative_to_float: the float baseline's median over this variant's (> 1: faster than float).
        relative_to_one_thread: this variant's one-thread median over this median (1 at one thread;
            0 where there is no one-thread row).
    """

    layer: str
    device: str
    threads: int
    relative_to_float: float
    relative_to_one_thread: float = 0.0


def add_parser(suites: Any) -> None:
    """Registers the ``int8`` sub-command on the benchmark's sub-parsers."""
    parser = add_scan_suite_parser(
        suites, "int8", "int8, bfloat16 and float32 conv layers and the backbone on the real scan (CPU: 1 and 2 "
        "threads; GPU: one layer against float16)", __doc__.split("\n\n")[1], 5, scenes.VOXELS_FILE_NAME)
    parser.add_argument("--threads", type=str, default="1,2", help="comma-separated thread counts (cpu)")
    parser.add_argument("--layers", type=str, default="",
                        help="comma-separated layer names to run (default: all; e.g. 'subm 64->64')")
    parser.add_argument("--no-backbone", action="store_true", help="skip the backbone through sparsecore.runtime")
    parser.add_argument("--seed", type=int, default=0)


def layer_inputs(voxels_path: str | None, seed: int, xp: Any = np, layer: LayerSpec = LAYERS[2],
                 rulebooks: dict | None = None) -> dict[str, Any]:
    """The scan's rulebook, float features, weight and bias, and their int8 quantization (per-channel weights).

    ``rulebooks`` (kind -> rulebook) is filled and reused across layers.
    """
    import sparsecore as sc

    scene = scenes.load_voxel_scene(scenes.require_data_file(voxels_path, scenes.VOXELS_FILE_NAME))
    rulebooks = {} if rulebooks is None else rulebooks
    if layer.kind not in rulebooks:
        geometry = (sc.ConvGeometry.create(3, 3, kind="subm") if layer.kind == "subm"
                    else sc.ConvGeometry.create(3, 3, stride=2, padding=1, kind="regular"))
        rulebooks[layer.kind] = sc.build_rulebook(xp.asarray(scene.indices), scene.spatial_shape, scene.batch_size,
                                                  geometry)
    rulebook = rulebooks[layer.kind]
    generator = np.random.default_rng([seed, layer.in_channels, layer.out_channels, len(layer.kind)])
    cin, cout = layer.in_channels, layer.out_channels
    features = generator.standard_normal((rulebook.num_input, cin)).astype(np.float32)
    weight = (generator.standard_normal((cout, 3, 3, 3, cin)) / np.sqrt(27 * cin)).astype(np.float32)
    bias = (0.1 * generator.standard_normal(cout)).astype(np.float32)
    input_scale = float(np.abs(features).max() / 127)
    weight_scales = (np.abs(weight).reshape(cout, -1).max(axis=1) / 127).astype(np.float32)
    features, weight, bias = xp.asarray(features), xp.asarray(weight), xp.asarray(bias)
    return dict(
        scene=f"{scene.source}: {len(scene.indices)} voxels", pairs=rulebook.num_pairs, rulebook=rulebook,
        features=features, weight=weight, bias=bias, input_scale=input_scale, weight_scales=xp.asarray(weight_scales),
        features_int8=sc.quantize(features, input_scale), weight_int8=sc.quantize(weight, weight_scales, axis=0))


def _variants(inputs: dict[str, Any], float_dtype: Any) -> dict[str, Callable[[], Any]]:
    """The GPU suite's variants (and the int8 -> float32 output): float layer, int8 -> int8, int8 -> float32."""
    import sparsecore as sc

    rulebook = inputs["rulebook"]
    features, weight, bias = (inputs[name].astype(float_dtype) for name in ("features", "weight", "bias"))
    common = dict(input_scale=inputs["input_scale"], weight_scales=inputs["weight_scales"], bias=inputs["bias"],
                  relu=True)
    xp = sc.backends.backend_for(features).xp
    return {
        np.dtype(float_dtype).name: lambda: xp.maximum(sc.conv_forward(features, weight, rulebook, bias), 0),
        "int8 -> int8": lambda: sc.int8_conv_forward(inputs["features_int8"], inputs["weight_int8"], rulebook,
                                                     output_scale=0.05, **common),
        "int8 -> float32": lambda: sc.int8_conv_forward(inputs["features_int8"], inputs["weight_int8"], rulebook,
                                                        **common),
    }


def layer_variants(inputs: dict[str, Any]) -> dict[str, Callable[[], Any]]:
    """The CPU variants of one layer: float32, bfloat16 (where ml_dtypes imports), int8 (auto), int8 today."""
    import sparsecore as sc
    from sparsecore.backends import x86_features

    rulebook, bias = inputs["rulebook"], inputs["bias"]
    common = dict(input_scale=inputs["input_scale"], weight_scales=inputs["weight_scales"], bias=bias, relu=True,
                  output_scale=0.05)

    def int8_layer() -> Any:
        return sc.int8_conv_forward(inputs["features_int8"], inputs["weight_int8"], rulebook, **common)

    def int8_today() -> Any:
        with x86_features.cpu_isa("generic"):
            return int8_layer()

    variants = {BASELINE: lambda: np.maximum(sc.conv_forward(inputs["features"], inputs["weight"], rulebook, bias), 0)}
    try:
        import ml_dtypes
    except ImportError:
        pass
    else:
        features, weight, bias16 = (inputs[name].astype(ml_dtypes.bfloat16) for name in ("features", "weight", "bias"))
        # ReLU on the bits: NumPy's ufuncs on ml_dtypes' bfloat16 loop element by element (np.maximum took
        # longer than the conv itself), while a bfloat16 with its sign bit set is, as int16, negative
        variants["bfloat16"] = lambda: np.maximum(
            sc.conv_forward(features, weight, rulebook, bias16).view(np.int16), 0).view(ml_dtypes.bfloat16)
    int8_name = "int8 (vnni)" if x86_features.uses("avx512_vnni") else "int8 (auto)"
    variants[int8_name] = int8_layer
    variants["int8 today"] = int8_today
    return variants


def cpu_layer_rows(voxels_path: str | None, seed: int, repeat: int, thread_counts: Sequence[int],
                   layers: Sequence[LayerSpec] = LAYERS) -> tuple[list[Int8Timing], list[str]]:
    """Times every layer's variants at every thread count in this process, all taking turns per round.

    Returns:
        The rows, and notes (whether the int8 routes gave the same bits; missing variants).
    """
    import sparsecore as sc

    rows, notes, rulebooks = [], [], {}
    for layer in layers:
        inputs = layer_inputs(voxels_path, seed, layer=layer, rulebooks=rulebooks)
        variants = layer_variants(inputs)
        int8_names = [name for name in variants if name.startswith("int8")]
        same = np.array_equal(np.asarray(variants[int8_names[0]]()), np.asarray(variants[int8_names[1]]()))
        notes.append(f"{layer.name} ({inputs['pairs']} pairs): int8 routes bitwise equal: {'yes' if same else 'NO'}")
        functions = {}
        for threads in thread_counts:
            for name, function in variants.items():
                functions[(threads, name)] = (lambda threads=threads, function=function: _on_threads(sc, threads,
                                                                                                     function))
        times = time_alternating(functions, repeat, lambda: None)
        rows.extend(_layer_rows(layer.name, thread_counts, list(variants), times))
    if not any(row.variant == "bfloat16" for row in rows):
        notes.append("bfloat16: not timed (ml_dtypes is not installed)")
    return rows, notes


def _on_threads(sc: Any, threads: int, function: Callable[[], Any]) -> Any:
    with sc.num_threads(threads):
        return function()


def _layer_rows(layer: str, thread_counts: Sequence[int], names: list[str], times: dict) -> list[Int8Timing]:
    rows = []
    one_thread = {name: float(np.median(times[(1, name)])) for name in names if (1, name) in times}
    for threads in thread_counts:
        summary = summarize_times({name: times[(threads, name)] for name in names}, baseline=BASELINE)
        for name, (median, fastest, relative) in summary.items():
            rows.append(Int8Timing(variant=name, median_ms=median, min_ms=fastest, layer=layer, device="cpu",
                                   threads=threads, relative_to_float=relative,
                                   relative_to_one_thread=one_thread[name] / median if name in one_thread else 0.0))
    return rows


def _gpu_timings(voxels_path: str | None, seed: int, repeat: int) -> tuple[list[Int8Timing], str]:
    import cupy

    inputs = layer_inputs(voxels_path, seed, cupy)
    times = time_alternating(_variants(inputs, np.float16), repeat, cupy.cuda.Device().synchronize)
    summary = summarize_times(times, baseline=next(iter(times)))
    return [Int8Timing(variant=name, median_ms=median, min_ms=fastest, layer=LAYERS[2].name, device="cuda",
                       threads=0, relative_to_float=relative)
            for name, (median, fastest, relative) in summary.items()], inputs["scene"]


def format_rows(rows: Sequence[Int8Timing]) -> str:
    """An aligned text table of the rows."""
    titles = ("layer", "threads", "variant", "median ms", "min ms", "float / this", "1 thread / this")
    cells = [(row.layer, str(row.threads) if row.device == "cpu" else "-", row.variant, f"{row.median_ms:.1f}",
              f"{row.min_ms:.1f}", f"{row.relative_to_float:.2f}x",
              f"{row.relative_to_one_thread:.2f}x" if row.relative_to_one_thread else "-") for row in rows]
    widths = [max([len(title)] + [len(cell[column]) for cell in cells]) for column, title in enumerate(titles)]
    lines = ["  ".join(value.ljust(width) if column < 3 else value.rjust(width)
                       for column, (value, width) in enumerate(zip(line, widths))).rstrip()
             for line in [titles] + cells]
    return "\n".join(lines) + "\n"


def _selected_layers(text: str) -> list[LayerSpec]:
    if not text.strip():
        return list(LAYERS)
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in {layer.name for layer in LAYERS}]
    if unknown:
        raise SystemExit(f"--layers: unknown layer {unknown[0]!r}; expected names among "
                         f"{', '.join(layer.name for layer in LAYERS)}")
    return [layer for layer in LAYERS if layer.name in names]


def run_int8_command(arguments: argparse.Namespace) -> int:
    """Runs the ``int8`` suite and prints its tables."""
    if arguments.repeat < 1:
        raise SystemExit(f"--repeat must be at least 1, got {arguments.repeat}")
    notes: list[str] = []
    try:
        if arguments.device == "cuda":
            rows, scene = _gpu_timings(arguments.voxels, arguments.seed, arguments.repeat)
        else:
            thread_counts = [int(value) for value in arguments.threads.split(",") if value.strip()]
            rows, notes = cpu_layer_rows(arguments.voxels, arguments.seed, arguments.repeat, thread_counts,
                                         _selected_layers(arguments.layers))
            if not arguments.no_backbone:
                from sparsecore.benchmark.runtime_int8 import backbone_rows

                backbone, backbone_notes = backbone_rows(arguments.voxels, arguments.repeat, thread_counts)
                rows.extend(Int8Timing(**row) for row in backbone)
                notes.extend(backbone_notes)
            scene = scenes.require_data_file(arguments.voxels, scenes.VOXELS_FILE_NAME).name
    except (OSError, ValueError) as error:
        raise SystemExit(f"error: {error}") from None
    header = machine_description()
    header["threads"] = "per row (sparsecore.num_threads, one process)" if arguments.device == "cpu" else "-"
    header.update({"layers": "k3, bias, ReLU, forward (rulebooks prebuilt); int8 in and out", "scene": str(scene),
                   "timing": f"{arguments.repeat} rounds, variants and thread counts taking turns, after one "
                             "warm-up round; time.perf_counter",
                   "load": f"1-minute load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs"})
    width = max(len(label) for label in header)
    print("".join(f"{label.ljust(width)} : {value}\n" for label, value in header.items()) + "\n"
          + format_rows(rows) + "".join(f"\n{note}" for note in notes) + ("\n" if notes else ""), end="")
    if arguments.json:
        with open(arguments.json, "w", encoding="utf-8") as handle:
            json.dump({"header": header, "rows": [asdict(row) for row in rows], "notes": notes}, handle, indent=2)
    return 0
