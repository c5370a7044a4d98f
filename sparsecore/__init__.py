"""sparsecore: spatially sparse convolution on NumPy (CPU) and CuPy (GPU).

The core imports neither torch nor jax, and CuPy only when a GPU array arrives.
See docs/api.md for the functional API and docs/architecture.md for the data flow:
geometry (keys, hash tables, rulebooks) kept apart from the differentiable
feature passes (gather-GEMM-scatter, pooling).
"""

from . import threads as _threads  # first: it sets OpenMP's wait policy before a runtime loads
from . import _dispatch
from .capacity import (
    BoundCapacity,
    CapacityOverflowError,
    CapacityStatus,
    FixedCapacity,
    LearnedCapacity,
    check_capacity,
)
from .conv import conv_backward, conv_forward
from .dense import from_dense, to_dense, union_sites
from .functional import (
    global_avg_pool,
    global_max_pool,
    layer_rulebook,
    sparse_add,
    sparse_avg_pool,
    sparse_conv,
    sparse_max_pool,
)
from .geometry import CONV_KINDS, ConvGeometry
from .hashing import HashTable, pack_keys, unpack_keys
from .layer_geometry import FoundRulebook, GeometryCache, InputSites, find_layer_rulebook, sites_identity
from .int8 import RequantParameters, dequantize, int8_conv_forward, int8_max_pool_forward, quantize, requant_parameters
from .pool import (
    avg_pool_backward,
    avg_pool_forward,
    global_avg_pool_backward,
    global_avg_pool_forward,
    global_max_pool_backward,
    global_max_pool_forward,
    max_pool_backward,
    max_pool_forward,
)
from .reuse import check_inverse_fits, check_rulebook_fits
from .rulebook import PairMap, Rulebook, build_pool_rulebook, build_rulebook, inverse_rulebook
from .tensor import RulebookCache, SparseTensor
from .threads import get_num_threads, num_threads, set_num_threads
from .voxelization import BatchedVoxels, VoxelGrid, Voxels, gather_voxel_features, voxel_means, voxelize, voxelize_batch

__version__ = "0.1.0"

__all__ = [
    "BoundCapacity",
    "CapacityOverflowError",
    "CapacityStatus",
    "FixedCapacity",
    "LearnedCapacity",
    "check_capacity",
    "CONV_KINDS",
    "ConvGeometry",
    "FoundRulebook",
    "GeometryCache",
    "InputSites",
    "HashTable",
    "PairMap",
    "Rulebook",
    "RequantParameters",
    "RulebookCache",
    "SparseTensor",
    "BatchedVoxels",
    "VoxelGrid",
    "Voxels",
    "avg_pool_backward",
    "avg_pool_forward",
    "build_pool_rulebook",
    "build_rulebook",
    "check_inverse_fits",
    "check_rulebook_fits",
    "conv_backward",
    "conv_forward",
    "dequantize",
    "from_dense",
    "gather_voxel_features",
    "get_num_threads",
    "global_avg_pool",
    "global_avg_pool_backward",
    "global_avg_pool_forward",
    "global_max_pool",
    "global_max_pool_backward",
    "global_max_pool_forward",
    "int8_conv_forward",
    "int8_max_pool_forward",
    "find_layer_rulebook",
    "inverse_rulebook",
    "layer_rulebook",
    "max_pool_backward",
    "max_pool_forward",
    "num_threads",
    "pack_keys",
    "quantize",
    "requant_parameters",
    "set_num_threads",
    "sites_identity",
    "sparse_add",
    "sparse_avg_pool",
    "sparse_conv",
    "sparse_max_pool",
    "to_dense",
    "union_sites",
    "unpack_keys",
    "voxel_means",
    "voxelize",
    "voxelize_batch",
]

# The one place the public API meets the caller's arrays: each public function hands its
# array results back in the library of its first array argument (torch in, torch out; JAX in,
# JAX out), and refuses torch tensors that require grad and JAX tracers (sparsecore._dispatch).
_dispatch.wrap_public_functions(globals(), __all__)
