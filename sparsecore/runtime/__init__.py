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
'sparsecore[onnx]'``); torch and jax are never imported.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Union

from .nodes import (
    ACTIVATIONS,
    SUPPORTED_OPS,
    AddNode,
    ConvNode,
    Graph,
    GraphError,
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
    "ReluNode",
    "ReshapeNode",
    "RuntimeOutput",
    "ScatterDenseNode",
    "Session",
    "TransposeNode",
    "load",
    "load_model",
]


def load(path: Union[str, Path], *, dtype: str = "float32") -> Session:
    """Reads and validates a libspconv ONNX file and returns a `Session` that runs it.

    Args:
        path: the ``.onnx`` file.
        dtype: ``"float32"`` (default; FP16 weights widened) or ``"float16"``: the float nodes'
            dtype (int8 nodes compute in int8 with int32 sums whatever it is).

    Raises:
        FileNotFoundError: no file at ``path``.
        GraphError: a corrupt or foreign file, or a node the runtime cannot run (named), including
            int8 nodes without usable dynamic ranges.
        ImportError: the ``onnx`` package is missing.
    """
    return Session(parse_model(read_model(path)), dtype=dtype)


def load_model(model: Any, *, dtype: str = "float32") -> Session:
    """Like `load`, from an in-memory ``onnx.ModelProto``."""
    return Session(parse_model(model), dtype=dtype)
