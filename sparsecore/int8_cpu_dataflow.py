"""Which dataflow runs an int8 conv on the CPU: the VNNI kernel, the compiled int8 kernel, or the float32 pass.

Three routes give the same bits on the NumPy backend (`sparsecore.int8`'s
int32 sum, then its float32 epilogue):

- the VNNI kernel (`sparsecore.backends._int8_vnni_kernels`): ``vpdpbusd``
  into int32, output-stationary over the float32 dataflow's forward tile plan
  (`sparsecore.cpu_dataflow.tile_plan`) and its work split, the epilogue fused.
  ``"auto"`` runs every layer above `_cpu_kernels.NUMPY_MAX_WORK` on it where
  `sparsecore.backends.x86_features` selects ``avx512_vnni`` (the CPU has it,
  numba can target it, ``SPARSECORE_CPU_ISA`` allows it: `vnni_on_cpu`);
  elsewhere the two routes below, chosen as before. Real scan, one thread,
  wall-clock medians of 5 interleaved rounds, 2026-12-07 20:22 UTC, quiet
  2-core Xeon with AVX-512 VNNI (load average 0.8), float32 layer (bias,
  ReLU) / today's int8 route / VNNI int8 layer (int8 in and out), ms:
  subm 16 -> 16 12.8 / 13.6 / 4.2, 32 -> 32 27.5 / 28.6 / 8.0, 64 -> 64
  78.4 / 81.4 / 19.2, 128 -> 128 291.0 / 245.6 / 55.6; strided 32 -> 64
  36.6 / 51.8 / 10.0, 64 -> 128 97.1 / 87.4 / 24.5 (docs/quantization.md,
  section 7; ``python -m sparsecore.benchmark int8``);

- the compiled int8 kernel (`sparsecore.backends._int8_cpu_kernels`, numba):
  output-stationary, int8 x int16 products summed in int32, the epilogue fused;
- the float32 pass (`float_pass`): the int8 values widened to float32 and run
  through `sparsecore.conv_forward`, which picks the float layer's own
  dataflow (`sparsecore.cpu_dataflow`: the tiled BLAS passes for ungrouped
  layers, on `sparsecore.threads`' thread count), then
  the epilogue in one compiled pass (`_int8_cpu_kernels.epilogue`; its NumPy
  twin `_numpy_int8.apply_epilogue` without numba). Every product of two int8 values
  is an integer of magnitude at most ``2^14``, and float32 holds every integer
  up to ``2^24``, so while ``max|x| * max_c sum_{k,i} |W[c, k, i]|`` stays
  within ``2^24`` every partial sum, in any order, with or without FMA, is an
  exact integer: the float32 result is ``float32(acc)`` exactly. Layers over
  that bound (checked per call, from the data) run the compiled kernel, or the
  backend's int8 pass without numba.

`compiled_on_cpu` chooses by the channel counts only (never the thread count
or the data). Both routes give the same bits, so the choice is speed alone.
Interleaved runs of both routes on the real scan (125,562 voxels; int8
features in [-127, 127], weights of a calibrated layer's size; bias, ReLU,
int8 output), 2-core AMD EPYC VM, 2026-12-05 08:33-08:35 UTC, medians of 5,
ms, compiled / float pass:

=========================  ===============  ===============
layer (pairs)              1 thread         2 threads
=========================  ===============  ===============
subm 16 -> 16 (789k)       82-83 / 15       42-48 / 8-9
subm 32 -> 32 (789k)       297-328 / 31-32  164 / 16-17
strided 32 -> 64 (423k)    37 / 34          19 / 29-30
subm 64 -> 64 (789k)       119 / 87-90      60 / 55-57
strided 64 -> 128 (423k)   129-137 / 96-106 63 / 62-63
subm 128 -> 128 (789k)     454-456 / 300-333  222-223 / 164-170
=========================  ===============  ===============

The float pass gained from the float32 dataflow's tiled kernels and their
small GEMM slices (2026-12-03 to 2026-12-05); the compiled kernel keeps only
the 32 -> 64 shape (`COMPILED_MIN_IN_PER_GROUP`, `COMPILED_MIN_OUT_PER_GROUP`,
`COMPILED_MAX_MATRIX`), where its int8 output (a quarter of the float pass's
float32 sums: 33 MiB there, past the size glibc serves from its heap, so
every call faults its pages in afresh) keeps it ahead at two threads. Until
2026-12-05 it ran every layer from 32 x 64 up (measured 2026-12-03, when the
float32 64 -> 64 forward took 164-170 ms). A layer past the float pass's
exactness bound runs the compiled kernel too, where numba imports.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from . import cpu_dataflow
from .backends import NumpyBackend, x86_features
from .backends import _cpu_kernels, _int8_cpu_kernels, _int8_vnni_kernels
from .backends._numpy_int8 import EXACT_FLOAT32_LIMIT, Int8Epilogue, apply_epilogue, compiled_conv
from .conv import conv_forward
from .rulebook import PairMap, Rulebook

__all__ = ["COMPILED_MIN_IN_PER_GROUP", "COMPILED_MIN_OUT_PER_GROUP", "COMPILED_MAX_MATRIX", "ROUTES",
           "compiled_on_cpu", "vnni_on_cpu", "float_pass_is_exact", "int8_neighbour_table", "int8_conv_on_cpu"]

COMPILED_MIN_IN_PER_GROUP = 32
"""Input channels per group from which the compiled int8 kernel runs a layer (with `COMPILED_MIN_OUT_PER_GROUP`)."""

COMPILED_MIN_OUT_PER_GROUP = 64
"""Output channels per group from which the compiled int8 kernel runs a layer."""

COMPILED_MAX_MATRIX = 32 * 64
"""Most ``in_per_group * out_per_group`` of a layer the compiled int8 kernel runs; wider layers run the
float32 pass (faster there since the tiled float32 dataflow; the module docstring has the measurements)."""

ROUTES = ("auto", "vnni", "compiled", "float_pass")


def vnni_on_cpu(pairs: int, in_channels: int, out_channels: int) -> bool:
    """Whether ``"auto"`` runs a layer on the VNNI kernel (`sparsecore.backends._int8_vnni_kernels`).

    Where `x86_features.uses` ``("avx512_vnni")`` (the CPU has it, numba can target it and
    ``SPARSECORE_CPU_ISA`` allows it) and numba imports, every layer whose work
    (``pairs * (C_in + C_out)``) passes `_cpu_kernels.NUMPY_MAX_WORK`: smaller layers keep the
    float pass, whose small sizes run NumPy twins, so a small cloud's first call compiles nothing.
    """
    return (_cpu_kernels.compiled_kernel(pairs * (in_channels + out_channels)) and _int8_cpu_kernels.available()
            and x86_features.uses("avx512_vnni"))


def compiled_on_cpu(in_per_group: int, out_per_group: int) -> bool:
    """Whether the compiled int8 kernel runs a layer (when numba imports) rather than the float32 pass."""
    return (_int8_cpu_kernels.available() and in_per_group >= COMPILED_MIN_IN_PER_GROUP
            and out_per_group >= COMPILED_MIN_OUT_PER_GROUP and in_per_group * out_per_group <= COMPILED_MAX_MATRIX)


def float_pass_is_exact(features: np.ndarray, weight: np.ndarray) -> bool:
    """Whether every partial sum of the conv stays an integer within ``2^24`` (see the module docstring).

    Args:
        features: int8 ``[N, C_in]``.
        weight: int8 ``[C_out, *kernel_size, C_in // groups]``.
    """
    if features.size == 0 or weight.size == 0:
        return True
    largest_input = max(-int(features.min()), int(features.max()))
    row_sums = np.abs(weight.reshape(weight.shape[0], -1).astype(np.int32)).sum(axis=1, dtype=np.int64)
    return largest_input * int(row_sums.max()) <= EXACT_FLOAT32_LIMIT


def int8_neighbour_table(rulebook: Rulebook | PairMap) -> np.ndarray:
    """The compiled int8 kernel's table (`_int8_cpu_kernels.neighbour_table`), built once per rulebook.

    Memoised, read only, in the map's ``derived`` slot (as `sparsecore.cpu_dataflow.neighbour_table`
    memoises the float kernels' tables): every int8 layer sharing a rulebook builds it once.

    Returns:
        int32 ``[num_output, K]``: the input row paired with each output row through each offset, or -1.
    """
    pair_map = rulebook.pair_map if isinstance(rulebook, Rulebook) else rulebook
    table = pair_map.derived.get("int8_neighbour_table")
    if table is None:
        table = _int8_cpu_kernels.neighbour_table(pair_map.pair_input, pair_map.pair_output,
                                                  tuple(pair_map.offset_starts), pair_map.num_output)
        table.setflags(write=False)
        pair_map.derived["int8_neighbour_table"] = table
    return table


def int8_conv_on_cpu(backend: NumpyBackend, features: np.ndarray, weight: np.ndarray, rulebook: Rulebook | PairMap,
                     groups: int, epilogue: Int8Epilogue, route: str = "auto") -> np.ndarray:
    """The int8 conv of `sparsecore.int8.int8_conv_forward` on NumPy arrays (checked arguments).

    Args:
        backend: the NumPy backend.
        features: int8 ``[N_in, C_in]``.
        weight: int8 ``[C_out, *kernel_size, C_in // groups]``.
        rulebook: the layer's rulebook.
        groups: channel groups.
        epilogue: the float32 steps after the sum.
        route: ``"auto"`` (`vnni_on_cpu`, else `compiled_on_cpu` decides), ``"vnni"`` (the VNNI
            kernel over the forward `sparsecore.cpu_dataflow.tile_plan`; a `ValueError` where
            `x86_features` does not select ``avx512_vnni`` or numba is missing), ``"compiled"`` (the compiled int8
            kernel over the memoised `int8_neighbour_table`; the backend's int8 pass without
            numba), or ``"float_pass"`` (the float32 pass when `float_pass_is_exact`, else
            the compiled route). Every route gives the same bits.

    Returns:
        int8 ``[N_out, C_out]`` with ``epilogue.output_scale``, else float32.
    """
    if route not in ROUTES:
        raise ValueError(f"route must be one of {ROUTES}, got {route!r}")
    in_per_group, out_per_group = weight.shape[-1], weight.shape[0] // groups
    if route == "auto" and vnni_on_cpu(rulebook.num_pairs, features.shape[1], weight.shape[0]):
        route = "vnni"
    if route == "auto":
        route = "compiled" if compiled_on_cpu(in_per_group, out_per_group) else "float_pass"
    if route == "vnni":
        if not (_int8_cpu_kernels.available() and x86_features.uses("avx512_vnni")):
            raise ValueError("route='vnni' needs numba and a CPU with avx512_vnni that numba can target, selected by "
                             f"{x86_features.ISA_VARIABLE} (now {x86_features.selected_features()}); use route='auto'")
        items = _cpu_kernels.tile_items(-(-rulebook.num_output // _cpu_kernels.ROW_BLOCK))
        return _int8_vnni_kernels.conv(features, weight, cpu_dataflow.tile_plan(rulebook, "forward", items),
                                       rulebook.num_output, rulebook.num_pairs, groups, epilogue)
    if route == "float_pass" and float_pass_is_exact(features, weight):
        sums = conv_forward(features.astype(np.float32), weight.astype(np.float32), rulebook, groups=groups,
                            backend=backend)
        if _int8_cpu_kernels.available():  # one compiled pass; the same bits as NumPy's steps
            return _int8_cpu_kernels.epilogue(sums, epilogue)
        return apply_epilogue(np, sums, epilogue)
    if _int8_cpu_kernels.available():  # the compiled route, or a float pass past its exactness bound
        return compiled_conv(features, weight, int8_neighbour_table(rulebook), rulebook.num_pairs, groups, epilogue)
    return backend.int8_conv_pairs(features, weight, rulebook.pair_input, rulebook.pair_output,
                                   tuple(rulebook.offset_starts), rulebook.num_output, rulebook.identity_offset,
                                   groups, epilogue)
