"""sparsecore.runtime: inference from a libspconv ONNX file without PyTorch or JAX.

    session = sparsecore.runtime.load("backbone.onnx")
    out = session.run(features, indices, batch_size, spatial_shape)
    bev = out.dense            # [B, C*D, H, W] after ScatterDense + Reshape, or
    sparse = out.sparse        # a sparsecore.SparseTensor when the graph ends on sparse sites

The file is the format NVIDIA's libspconv reads (``SparseConvolution``,
``Add``, ``Relu``, ``ScatterDense``, ``Reshape``, ``Transpose``), as written by
`sparsecore.torch.export_onnx` or NVIDIA's exporter. Inputs are NumPy (CPU) or
CuPy (GPU) arrays; each layer runs through the core's public functions
(``sparsecore.functional.sparse_conv``, rulebooks shared by ``rulebook`` name).
int8 files (``export_onnx(..., precision="int8")`` or NVIDIA's int8
export) run their int8 nodes through `sparsecore.int8` with the file's
dynamic ranges (`sparsecore.runtime.quantized`). Reading the file needs the ``onnx`` package (``pip install
'sparsecore-conv[onnx]'``); torch and jax are never imported.

A model file is input from elsewhere: `load` validates it whole before the
first run (`sparsecore.runtime.checks`, `sparsecore.runtime.int8_checks`),
reads external data only from regular files inside the model's folder
(`sparsecore.runtime.files`), holds every run to a memory budget
(`sparsecore.memory_budget`) and, in float16, reports the first node whose
output overflows (`NonFiniteError`). See docs/deployment.md.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional, Union

from ..memory_budget import MemoryBudgetError
from .nodes import (
    ACTIVATIONS,
    SUPPORTED_OPS,
    AddNode,
    ConvNode,
    Graph,
    GraphError,
    NonFiniteError,
    ReluNode,
    ReshapeNode,
    ScatterDenseNode,
    TransposeNode,
)
from .graph import parse_model, read_model
from .quantized import Int8Value
from .session import DTYPES, RuntimeOutput, Session

__all__ = [
    "ACTIVATIONS",
    "DTYPES",
    "SUPPORTED_OPS",
    "AddNode",
    "ConvNode",
    "Graph",
    "GraphError",
    "Int8Value",
    "MemoryBudgetError",
    "NonFiniteError",
    "ReluNode",
    "ReshapeNode",
    "RuntimeOutput",
    "ScatterDenseNode",
    "Session",
    "TransposeNode",
    "load",
    "load_model",
]


def load(path: Union[str, Path], *, dtype: str = "float32", memory_budget: Union[int, str, None] = None,
         check_finite: Optional[bool] = None, capture: bool = False) -> Session:
    """Reads and validates a libspconv ONNX file and returns a `Session` that runs it.

    Args:
        path: the ``.onnx`` file (external data, if any, beside it in the same folder).
        dtype: ``"float32"`` (default; FP16 weights widened) or ``"float16"``: the float nodes'
            dtype (int8 nodes compute in int8 with int32 sums whatever it is).
        memory_budget: the most bytes one step of a run may allocate (bytes, ``"8G"``, ``"30%"``);
            None: `sparsecore.memory_budget`'s process-wide budget.
        check_finite: raise `NonFiniteError` naming the first float node whose output holds inf or
            NaN; None (default): on for float16, off for float32 and for ``capture``.
        capture: capacity mode, and on CuPy one CUDA graph recorded per input capacity and replayed
            (`sparsecore.runtime.capture`, docs/capture.md).

    Raises:
        FileNotFoundError: no file at ``path``.
        GraphError: a corrupt, foreign or inconsistent file, named: the node and the attribute or
            initializer (see `parse_model`), an external-data path outside the model's folder, a
            node the runtime cannot run, int8 nodes without usable dynamic ranges.
        ImportError: the ``onnx`` package is missing.
    """
    return Session(parse_model(read_model(path)), dtype=dtype, memory_budget=memory_budget,
                   check_finite=check_finite, capture=capture)


def load_model(model: Any, *, dtype: str = "float32", memory_budget: Union[int, str, None] = None,
               check_finite: Optional[bool] = None, capture: bool = False) -> Session:
    """Like `load`, from an in-memory ``onnx.ModelProto`` (whose external data is already loaded)."""
    return Session(parse_model(model), dtype=dtype, memory_budget=memory_budget, check_finite=check_finite,
                   capture=capture)
