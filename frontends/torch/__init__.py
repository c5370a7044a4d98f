"""sparsecore.torch: the PyTorch frontend, a drop-in for spconv 2.x's ``spconv.pytorch``.

``import sparsecore.torch as spconv`` runs a model written for spconv: the same
tensor type (`SparseConvTensor`), layers (``SubMConv3d``, ``SparseConv3d``,
``SparseInverseConv3d``, ``SparseMaxPool3d``, ... in 1D to 4D), containers
(`SparseSequential`, tables) and utilities, with spconv's argument lists,
weight layout ``[out, *kernel, in // groups]`` and state_dict keys, so spconv
checkpoints load. See docs/migrating_from_spconv.md for the few differences
(where spconv is wrong, sparsecore does what spconv documents).

The frontend converts, validates and wraps: rulebooks are built by the core
(`sparsecore.build_rulebook`) outside torch graphs, and the feature passes are
``torch.library`` custom ops (``torch.ops.sparsecore.*``) that autograd,
``torch.compile`` and ``opcheck`` understand. Tensors reach the core through
DLPack without copies; CUDA tensors run on torch's current stream and memory
pool. Importing this module imports torch; ``sparsecore`` itself never does.
"""

from __future__ import annotations

try:
    import torch as _torch  # a missing torch is named here, not deep in a submodule

    del _torch
except ModuleNotFoundError as _missing:
    if _missing.name != "torch":
        raise
    raise ModuleNotFoundError(
        "sparsecore.torch is the PyTorch frontend and needs PyTorch, which is not installed here; install it "
        "with pip install 'sparsecore-conv[torch]' (or see https://pytorch.org for a CUDA build). The core, "
        "sparsecore, runs without it (NumPy arrays), and sparsecore.runtime runs exported models without it",
        name="torch") from None

from . import conv, core, functional, hash, modules, ops, pool, tables, utils
from .conv import (
    SparseConv1d,
    SparseConv2d,
    SparseConv3d,
    SparseConv4d,
    SparseConvolution,
    SparseConvTranspose1d,
    SparseConvTranspose2d,
    SparseConvTranspose3d,
    SparseConvTranspose4d,
    SparseInverseConv1d,
    SparseInverseConv2d,
    SparseInverseConv3d,
    SparseInverseConv4d,
    SubMConv1d,
    SubMConv2d,
    SubMConv3d,
    SubMConv4d,
)
from .core import AlgoHint, ConvAlgo
from .hash import HashTable
from .modules import (
    Identity,
    RemoveGrid,
    SparseBatchNorm,
    SparseIdentity,
    SparseModule,
    SparseReLU,
    SparseSequential,
    SparseSyncBatchNorm,
    ToDense,
    assign_name_for_sparse_modules,
)
from .pool import (
    SparseAvgPool,
    SparseAvgPool1d,
    SparseAvgPool2d,
    SparseAvgPool3d,
    SparseAvgPool4d,
    SparseGlobalAvgPool,
    SparseGlobalMaxPool,
    SparseMaxPool,
    SparseMaxPool1d,
    SparseMaxPool2d,
    SparseMaxPool3d,
    SparseMaxPool4d,
)
from .tables import AddTable, AddTableMisaligned, ConcatTable, JoinTable
from .tensor import IndiceData, SparseConvTensor
from .onnx_export import ExportError, export_onnx  # noqa: E402  (deployment: docs/deployment.md)
from .program_loading import load_program  # noqa: E402  (a .pt2 made elsewhere, loaded safely)
from . import pytree  # noqa: E402,F401  (SparseConvTensor as a torch pytree node)
from .spconv_alias import install_as_spconv  # noqa: E402  (sparsecore as the `spconv` existing code imports)

__all__ = [
    "AddTable", "AddTableMisaligned", "AlgoHint", "ConcatTable", "ConvAlgo", "HashTable", "Identity",
    "IndiceData", "JoinTable", "RemoveGrid", "SparseAvgPool", "SparseAvgPool1d", "SparseAvgPool2d",
    "SparseAvgPool3d", "SparseAvgPool4d", "SparseBatchNorm", "SparseConv1d", "SparseConv2d", "SparseConv3d",
    "SparseConv4d", "SparseConvTensor", "SparseConvTranspose1d", "SparseConvTranspose2d",
    "SparseConvTranspose3d", "SparseConvTranspose4d", "SparseConvolution", "SparseGlobalAvgPool",
    "SparseGlobalMaxPool", "SparseIdentity", "SparseInverseConv1d", "SparseInverseConv2d",
    "SparseInverseConv3d", "SparseInverseConv4d", "SparseMaxPool", "SparseMaxPool1d", "SparseMaxPool2d",
    "SparseMaxPool3d", "SparseMaxPool4d", "SparseModule", "SparseReLU", "SparseSequential",
    "SparseSyncBatchNorm", "SubMConv1d", "SubMConv2d", "SubMConv3d", "SubMConv4d", "ToDense",
    "assign_name_for_sparse_modules", "conv", "core", "functional", "hash", "modules", "ops", "pool", "tables",
    "utils",
    # sparsecore's additions (not in spconv.pytorch): deployment (docs/deployment.md)
    "ExportError", "export_onnx", "load_program",
    # and the one call that makes existing `import spconv` code run on sparsecore (docs/migrating_from_spconv.md)
    "install_as_spconv",
]
