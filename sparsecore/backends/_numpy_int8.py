"""The NumPy backend's int8 feature passes: exact integer sums, then the float32 epilogue.

Two engines give the same bits. The default, when numba imports, is the
compiled output-stationary kernel of `_int8_cpu_kernels` (int8 x int16
products summed in int32, each output row once, no intermediate arrays).
Without numba, the sums run through float32 GEMMs, as follows. (Through
`sparsecore.int8_conv_forward`, `sparsecore.int8_cpu_dataflow` runs narrow
layers on the float32 conv pass instead, when their sums are provably exact
there, and wide ones on `compiled_conv`; see docs/quantization.md.)

NumPy has no integer BLAS (its int32 ``matmul`` is a plain loop, ~10x slower
than float32 BLAS here), so the int8 products run as float32 GEMMs and stay
exact: every product of two int8 values is an integer of magnitude at most
``2^14``, and float32 holds every integer up to ``2^24`` exactly, so a sum of
such products is exact in any order (BLAS reorders freely) while the sum of
the magnitudes of its terms stays within ``2^24``. The pass bounds that sum
before computing: for each kernel offset, ``max|x| * max_c sum_i |W[c, k, i]|``.
Offsets are accumulated in one float32 array while their bounds add up to at
most ``2^24``; beyond that the float32 partial sum is moved (exactly) into an
int32 accumulator and restarted. An offset whose own bound passes ``2^24`` (more
than ~1,000 input channels per group of large values) has its reduction split
into channel slices that each stay exact. The result equals the int32 sum of
the products bit for bit.

`Int8Epilogue` and `apply_epilogue` are the float32 steps after the sum,
shared by this backend and, as the twin of the kernel's epilogue, by its tests.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from . import _int8_cpu_kernels
from ._pair_runs import offset_runs

__all__ = ["Int8Epilogue", "apply_epilogue", "requantize", "conv_pairs", "compiled_conv", "max_pool_pairs", "EXACT_FLOAT32_LIMIT"]

EXACT_FLOAT32_LIMIT = 1 << 24  # every integer of magnitude up to this is a float32


@dataclass(frozen=True, eq=False)
class Int8Epilogue:
    """The float32 steps of an int8 conv after its int32 sum (see `sparsecore.int8`).

    Attributes:
        multiplier: float32 ``[C_out]``, ``float32(input_scale) * weight_scales`` rounded once.
        bias: float32 ``[C_out]`` or None.
        residual: int8 ``[M, C_out]`` or None.
        residual_scale: float32 scale of ``residual`` (unused without it).
        relu: clamp negative values to 0.
        output_scale: float32 scale to requantize to int8 with, or None for float32 output.
    """

    multiplier: Any
    bias: Any | None
    residual: Any | None
    residual_scale: np.float32
    relu: bool
    output_scale: np.float32 | None


def requantize(xp: Any, values: Any, scale: Any) -> Any:
    """``clip(rint(values / scale), -128, 127)`` as int8; ``values`` float32, overwritten.

    ``scale`` is a float32 scalar or an array broadcasting against ``values``.
    """
    xp.divide(values, scale, out=values)
    xp.rint(values, out=values)
    xp.clip(values, -128, 127, out=values)
    return values.astype(xp.int8)


_EPILOGUE_BLOCK_ELEMENTS = 1 << 16  # NumPy runs the elementwise steps on cache-sized row blocks


def _epilogue_rows(xp: Any, values: Any, residual: Any | None, epilogue: Int8Epilogue) -> Any:
    xp.multiply(values, epilogue.multiplier, out=values)
    if epilogue.bias is not None:
        xp.add(values, epilogue.bias, out=values)
    if residual is not None:
        skip = residual.astype(xp.float32)
        xp.multiply(skip, epilogue.residual_scale, out=skip)
        xp.add(values, skip, out=values)
    if epilogue.relu:
        # y is never -0.0 here (a zero sum gives +0.0, x + (-x) gives +0.0), so maximum(y, 0)
        # is the kernel's "y < 0 ? 0 : y"
        xp.maximum(values, xp.float32(0), out=values)
    if epilogue.output_scale is None:
        return values
    return requantize(xp, values, epilogue.output_scale)


def apply_epilogue(xp: Any, values: Any, epilogue: Int8Epilogue) -> Any:
    """Applies the epilogue to ``values [M, C_out]``: int32 sums, or float32 ``float32(acc)`` (changed in place).

    Every step is elementwise, so running it on blocks of rows (NumPy, to stay
    in cache) or on the whole array gives the same bits.

    Returns:
        int8 ``[M, C_out]`` when ``epilogue.output_scale`` is set, else float32.
    """
    count, channels = values.shape
    rows = max(1, _EPILOGUE_BLOCK_ELEMENTS // max(channels, 1))
    if xp is not np or count <= rows:
        return _epilogue_rows(xp, values.astype(xp.float32, copy=False), epilogue.residual, epilogue)
    if epilogue.output_scale is not None:
        out = np.empty((count, channels), dtype=np.int8)
    else:
        out = values if values.dtype == np.float32 else np.empty((count, channels), dtype=np.float32)
    for start in range(0, count, rows):
        block = slice(start, start + rows)
        residual = None if epilogue.residual is None else epilogue.residual[block]
        out[block] = _epilogue_rows(np, values[block].astype(np.float32, copy=False), residual, epilogue)
    return out


def _grouped_product(rows: np.ndarray, matrices: np.ndarray) -> np.ndarray:
    """``rows [P, g, a]`` float32 times ``matrices [g, a, b]``: ``[P, g * b]``."""
    count, groups = rows.shape[:2]
    if groups == 1:
        return np.matmul(rows[:, 0], matrices[0])
    product = np.matmul(rows.transpose(1, 0, 2), matrices)  # [g, P, b]
    return product.transpose(1, 0, 2).reshape(count, -1)


@dataclass
class _Accumulator:
    """A float32 partial sum whose exactness budget is tracked, spilling into int32."""

    rows: int
    channels: int
    partial: np.ndarray | None = None
    used: int = 0
    total: np.ndarray | None = None

    def reserve(self, bound: int) -> None:
        """Makes room for terms whose magnitudes sum to at most ``bound``."""
        if self.partial is not None and self.used + bound > EXACT_FLOAT32_LIMIT:
            spilled = self.partial.astype(np.int32)
            self.total = spilled if self.total is None else np.add(self.total, spilled, out=self.total)
            self.partial = None
            self.used = 0
        if self.partial is None:
            self.partial = np.zeros((self.rows, self.channels), dtype=np.float32)
        self.used += bound

    def result(self) -> np.ndarray:
        """``float32(sum)``: the partial itself when it never spilled, else the int32 total rounded once."""
        partial = self.partial if self.partial is not None else np.zeros((self.rows, self.channels), np.float32)
        if self.total is None:
            return partial
        total = np.add(self.total, partial.astype(np.int32), out=self.total)
        return total.astype(np.float32)


def _channel_slices(in_per_group: int, bound_per_channel: int) -> list[slice]:
    """Slices of the reduction axis whose bound (channels x ``bound_per_channel``) stays exact."""
    width = max(1, EXACT_FLOAT32_LIMIT // max(bound_per_channel, 1))
    return [slice(start, min(start + width, in_per_group)) for start in range(0, in_per_group, width)]


ENGINES = ("auto", "compiled", "blas")


def conv_pairs(backend: Any, features: np.ndarray, weight: np.ndarray, pair_input: np.ndarray,
               pair_output: np.ndarray, run_starts: tuple[int, ...], num_output: int, identity_offset: int,
               groups: int, epilogue: Int8Epilogue, engine: str = "auto") -> np.ndarray:
    """The int8 conv pass on NumPy (see `ArrayBackend.int8_conv_pairs`).

    Args:
        engine: ``"compiled"``: int32 sums in the numba kernel of `_int8_cpu_kernels`
            (output-stationary, no intermediate arrays); ``"blas"``: exact float32 GEMMs
            per kernel offset (see the module docstring); ``"auto"``: compiled when numba
            imports, else blas. Both give the same bits.
    """
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
    if engine == "compiled" or (engine == "auto" and _int8_cpu_kernels.available()):
        table = _int8_cpu_kernels.neighbour_table(pair_input, pair_output, run_starts, num_output)
        return compiled_conv(features, weight, table, run_starts[-1], groups, epilogue)
    return _blas_conv_pairs(backend, features, weight, pair_input, pair_output, run_starts, num_output,
                            identity_offset, groups, epilogue)


def compiled_conv(features: np.ndarray, weight: np.ndarray, table: np.ndarray, pairs: int, groups: int,
                  epilogue: Int8Epilogue) -> np.ndarray:
    """The int8 conv in the compiled row kernel over a neighbour table (`_int8_cpu_kernels.int8_rows`).

    Args:
        features: int8 ``[N_in, C_in]``.
        weight: int8 ``[C_out, *kernel_size, C_in // groups]``.
        table: int32 ``[N_out, K]`` from `_int8_cpu_kernels.neighbour_table`.
        pairs: the rulebook's pair count.
        groups: channel groups.
        epilogue: the float32 steps after the sums.
    """
    out_channels, in_per_group = weight.shape[0], weight.shape[-1]
    matrices = weight.reshape(groups, out_channels // groups, table.shape[1], in_per_group)
    matrices = np.ascontiguousarray(matrices.transpose(2, 0, 3, 1), dtype=np.int16)  # [K, g, a, b]
    return _int8_cpu_kernels.int8_rows(np.ascontiguousarray(features), table, matrices, pairs, epilogue)


def _blas_conv_pairs(backend: Any, features: np.ndarray, weight: np.ndarray, pair_input: np.ndarray,
                     pair_output: np.ndarray, run_starts: tuple[int, ...], num_output: int, identity_offset: int,
                     groups: int, epilogue: Int8Epilogue) -> np.ndarray:
    num_input, in_channels = features.shape
    out_channels, in_per_group = weight.shape[0], weight.shape[-1]
    volume = len(run_starts) - 1
    flat_weight = weight.reshape(out_channels, volume, in_per_group)
    # [K, g, a, b] float32 matrices (exact: int8 values)
    matrices = flat_weight.astype(np.float32).reshape(groups, out_channels // groups, volume, in_per_group)
    matrices = np.ascontiguousarray(matrices.transpose(2, 0, 3, 1))
    largest_input = int(max(-int(features.min()), int(features.max()))) if features.size else 0
    largest_weight = int(np.abs(flat_weight.astype(np.int32)).max()) if flat_weight.size else 0
    row_sums = np.abs(flat_weight.astype(np.int64)).sum(axis=2).max(axis=0) if out_channels else None  # [K]
    accumulator = _Accumulator(num_output, out_channels)
    features = np.ascontiguousarray(features)
    slices = _channel_slices(in_per_group, largest_input * largest_weight)
    for offset in range(volume):
        start, stop = run_starts[offset], run_starts[offset + 1]
        if stop == start or out_channels == 0 or in_channels == 0:
            continue
        identity = offset == identity_offset and num_input == num_output
        # int8 rows gathered, then widened: a quarter of the random reads of a float32 gather
        rows = features if identity else backend.gather_rows(features, pair_input[start:stop])
        gathered = rows.astype(np.float32).reshape(rows.shape[0], groups, in_per_group)
        for channels in slices:
            bound = largest_input * (int(row_sums[offset]) if len(slices) == 1
                                     else largest_weight * (channels.stop - channels.start))
            accumulator.reserve(bound)
            product = _grouped_product(gathered[:, :, channels], matrices[offset][:, channels])
            if identity:
                np.add(accumulator.partial, product, out=accumulator.partial)
            else:
                backend.scatter_add_rows(accumulator.partial, pair_output[start:stop], product)
    return apply_epilogue(np, accumulator.result(), epilogue)


def max_pool_pairs(features: np.ndarray, pair_input: np.ndarray, pair_output: np.ndarray,
                   run_starts: tuple[int, ...], num_output: int) -> np.ndarray:
    """The int8 max pool on NumPy (see `ArrayBackend.int8_max_pool_pairs`)."""
    channels = features.shape[1]
    out = np.zeros((num_output, channels), dtype=np.int8)
    seen = np.zeros(num_output, dtype=bool)
    for input_rows, output_rows in offset_runs(pair_input, pair_output, run_starts):
        values = np.take(features, input_rows, axis=0)
        current = np.take(out, output_rows, axis=0)
        first = ~np.take(seen, output_rows)
        out[output_rows] = np.where(first[:, None], values, np.maximum(values, current))
        seen[output_rows] = True
    return out
