"""sparsecore.jax: spatially sparse convolution in JAX, under ``jit`` and ``grad``.

Geometry (rulebooks, output sites) depends on the values of the indices, so it
is built eagerly, outside ``jit``, by the sparsecore core, into a `Plan` whose
arrays are padded to capacity buckets; the feature passes are
``jax.custom_vjp`` functions of features, weights and the plan's arrays. A
stream of clouds of varying size compiles once per bucket::

    import sparsecore.jax as sj

    def net(params, x):
        x = sj.subm_conv(x, params["conv1"]["weight"])
        x = x.replace(jax.nn.relu(x.features))
        x = sj.sparse_conv(x, params["down"]["weight"], stride=2, padding=1)
        return sj.global_avg_pool(x)

    x = sj.SparseTensor.from_arrays(features, indices, spatial_shape, batch_size)
    x = x.with_plan(sj.plan(net, params, x))        # eager, outside jit
    out = jax.jit(net)(params, x)                   # feature passes only
    x2 = x.plan.recipe.apply(sj.SparseTensor.from_arrays(...))   # the next cloud

See docs/jax.md.
"""

from __future__ import annotations

try:
    import jax as _jax  # a missing jax is named here, not deep in a submodule

    del _jax
except ModuleNotFoundError as _missing:
    if _missing.name != "jax":
        raise
    raise ModuleNotFoundError(
        "sparsecore.jax is the JAX frontend and needs JAX, which is not installed here; install it with "
        "pip install 'sparsecore-conv[jax]' (or see https://docs.jax.dev for a GPU build). The core, sparsecore, "
        "runs without it (NumPy arrays)", name="jax") from None

from .buckets import Buckets, CapacityError, CapacityPolicy, Fixed
from .functional import (
    conv_transpose,
    global_avg_pool,
    global_max_pool,
    inverse_conv,
    sparse_add,
    sparse_avg_pool,
    sparse_conv,
    sparse_max_pool,
    subm_conv,
    to_dense,
)
from .norm import batch_norm, init_batch_norm
from .ops import IMPLS, default_impl, set_default_impl
from .parallel import data_parallel_grad, local, repad, stack
from .params import conv_weight_shape, init_conv, params_from_state_dict, spconv_1x1_weight
from .plan import PaddedRulebook, Plan, PlanError, Recipe, RulebookInfo, Sites, SitesInfo
from .planner import plan
from .tensor import SparseTensor
from .voxelize import voxelize, voxels_to_points

__all__ = [
    "Buckets",
    "CapacityError",
    "CapacityPolicy",
    "Fixed",
    "IMPLS",
    "PaddedRulebook",
    "Plan",
    "PlanError",
    "Recipe",
    "RulebookInfo",
    "Sites",
    "SitesInfo",
    "SparseTensor",
    "batch_norm",
    "conv_transpose",
    "conv_weight_shape",
    "data_parallel_grad",
    "default_impl",
    "global_avg_pool",
    "global_max_pool",
    "init_batch_norm",
    "init_conv",
    "inverse_conv",
    "local",
    "params_from_state_dict",
    "spconv_1x1_weight",
    "plan",
    "repad",
    "set_default_impl",
    "sparse_add",
    "sparse_avg_pool",
    "sparse_conv",
    "sparse_max_pool",
    "stack",
    "subm_conv",
    "to_dense",
    "voxelize",
    "voxels_to_points",
]
