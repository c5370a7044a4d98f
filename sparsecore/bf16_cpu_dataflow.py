"""bfloat16 conv passes on the CPU: which route runs them, and the passes on AMX tiles and ``vdpbf16ps``.

NumPy has no bfloat16; the core takes ``ml_dtypes.bfloat16`` arrays (what JAX hands a callback, and what
`sparsecore.torch` makes of a torch bfloat16 tensor), and never imports ml_dtypes itself: a bfloat16 array
brings its dtype along (`is_bfloat16`). Three routes compute the same function on the NumPy backend
(`bfloat16_route`); the first two take ungrouped layers above `sparsecore.backends._cpu_kernels.NUMPY_MAX_WORK`:

- ``"amx"``: where the CPU has AMX-BF16 and Linux grants its tile state (Intel since Sapphire Rapids;
  `sparsecore.backends._bf16_cpu_kernels.amx_available`) and ``SPARSECORE_CPU_ISA`` is ``auto``: the
  weight gradient, and the forward and input gradient of layers wider than `AMX_MIN_MATRIX`, on tile
  products (``tdpbf16ps``); narrower forward and input gradients on ``vdpbf16ps``, as the next route;
- ``"dpbf16ps"``: where the kernels use AVX-512 BF16 (`sparsecore.backends.x86_features`: the CPU has it,
  numba can target it, and the switch does not leave it out; ``SPARSECORE_CPU_ISA=avx512_bf16`` keeps AMX
  out): bfloat16 rows and weights read as they are, products summed in float32 by ``vdpbf16ps``
  (output-stationary over the float32 dataflow's tile plans for the forward and the input gradient, per
  offset in pair order for the weight gradient);
- ``"widened"``: everything else (``SPARSECORE_CPU_ISA=generic`` forces it everywhere): the operands
  widened to float32 (exact) and the float32 dataflows of `sparsecore.cpu_dataflow` run.

All sum in float32 and round once to bfloat16 (nearest even): they agree within the rounding of the sums
(each adds in its own order; the instructions flush denormals). Outputs and input gradients are bfloat16;
the weight gradient is summed in float32 and returned in the weight's dtype. Every route gives bitwise
the same result at every thread count.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from ._bfloat16 import is_bfloat16
from ._conv_products import offset_matrices, weight_from_matrices
from .backends import ArrayBackend, NumpyBackend, x86_features
from .backends import _cpu_kernels
from .cpu_dataflow import tile_plan
from .rulebook import PairMap, Rulebook

__all__ = ["AMX_MIN_MATRIX", "is_bfloat16", "check_bfloat16_operands", "bfloat16_route", "dot_forward",
           "dot_backward"]

AMX_MIN_MATRIX = 16 * 16
"""On the ``"amx"`` route, the forward and input gradient of layers with ``in_channels * out_channels``
above this run on tiles; narrower ones run faster on ``vdpbf16ps`` (real scan, one thread, 2026-12-07:
16 -> 16 forward 8.1 ms on tiles, 7.2 on vdpbf16ps; 32 -> 32 11.8 against 19.0; 64 -> 64 23.2 against 63.1)."""


def check_bfloat16_operands(**arrays: Any) -> None:
    """Raises when some of the named arrays are bfloat16 and others are not (a pass computes in one dtype).

    None entries are skipped.

    Raises:
        TypeError: naming every argument and its dtype.
    """
    present = {name: array.dtype for name, array in arrays.items() if array is not None}
    kinds = {is_bfloat16(dtype) for dtype in present.values()}
    if len(kinds) > 1:
        listing = ", ".join(f"{name} is {dtype}" for name, dtype in present.items())
        raise TypeError(f"a bfloat16 pass takes bfloat16 operands only: {listing}; cast them to one dtype "
                        "(.astype(ml_dtypes.bfloat16), or .astype(float32) for float32 arithmetic)")


def bfloat16_route(backend: ArrayBackend, in_channels: int, out_channels: int, groups: int, pairs: int) -> str:
    """``"amx"``, ``"dpbf16ps"`` or ``"widened"``: the route of a bfloat16 conv pass on ``backend`` (module
    docstring).

    From the sizes, the CPU and ``SPARSECORE_CPU_ISA`` only (`x86_features.uses`), never the thread count.

    Raises:
        ValueError: ``SPARSECORE_CPU_ISA`` asks for a feature this machine lacks, or holds an unknown value.
    """
    if (not isinstance(backend, NumpyBackend) or groups != 1
            or not _cpu_kernels.compiled_kernel(pairs * (in_channels + out_channels))
            or not x86_features.uses("avx512_bf16")):
        return "widened"
    switch = os.environ.get(x86_features.ISA_VARIABLE, "").strip().lower()
    if switch in ("", "auto") and _kernels().amx_available():
        return "amx"
    return "dpbf16ps"


def _kernels() -> Any:
    from .backends import _bf16_cpu_kernels

    return _bf16_cpu_kernels


def _matrices(weight: Any) -> np.ndarray:
    """The ungrouped weight's per-offset bfloat16 matrices ``[K, a, b]``."""
    return offset_matrices(weight, 1, weight.dtype)[:, 0]


def _rows(route: str, source: Any, matrices: np.ndarray, plan: Any, num_rows: int, pairs: int,
          initial: Any = None) -> Any:
    """The forward or input-gradient rows kernel of ``route`` (`AMX_MIN_MATRIX` decides on ``"amx"``)."""
    kernels = _kernels()
    if route == "amx" and matrices.shape[1] * matrices.shape[2] > AMX_MIN_MATRIX:
        return kernels.amx_rows(source, matrices, plan, num_rows, pairs, initial)
    return kernels.dot_rows(source, matrices, plan, num_rows, pairs, initial)


def dot_forward(features: Any, weight: Any, rulebook: Rulebook | PairMap, bias: Any | None,
                route: str = "dpbf16ps") -> Any:
    """`sparsecore.conv_forward` of ungrouped bfloat16 operands on the ``"amx"`` or ``"dpbf16ps"`` route.

    Args:
        features: bfloat16 ``[N_in, a]``.
        weight: bfloat16 ``[b, *kernel_size, a]``.
        rulebook: the layer's rulebook (pairs).
        bias: ``[b]`` of any float dtype, or None (added to the float32 sums before rounding).
        route: from `bfloat16_route`.

    Returns:
        bfloat16 ``[N_out, b]``.
    """
    plan = tile_plan(rulebook, "forward", _kernels().dot_items(rulebook.num_output, weight.shape[0]))
    initial = None if bias is None else np.asarray(bias).astype(np.float32)
    return _rows(route, features, _matrices(weight), plan, rulebook.num_output, rulebook.num_pairs, initial)


def dot_backward(grad_output: Any, features: Any, weight: Any, rulebook: Rulebook | PairMap,
                 route: str = "dpbf16ps") -> tuple[Any, Any]:
    """`sparsecore.conv_backward` of ungrouped bfloat16 operands on the ``"amx"`` or ``"dpbf16ps"`` route.

    Returns:
        ``(grad_features bfloat16 [N_in, a], grad_weight [b, *kernel_size, a] in the weight's dtype)``.
    """
    kernels = _kernels()
    matrices = _matrices(weight)
    # one pass: each gradient row read once for both products, the source rows from the work item's block
    items = kernels.amx_backward_items(rulebook.num_input, matrices.shape[0], features.shape[1], grad_output.shape[1],
                                       rulebook.num_pairs)
    backward = kernels.amx_backward if route == "amx" else kernels.dot_backward
    grad_features, grad_matrices = backward(grad_output, features, matrices, tile_plan(rulebook, "backward", items),
                                            rulebook.num_pairs)
    return grad_features, weight_from_matrices(grad_matrices[:, None], weight).astype(weight.dtype)
