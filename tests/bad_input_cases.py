"""A seeded generator of malformed calls to the public entry points, and their judge.

Each *entry* is a valid call (``make`` draws its arguments from a seeded
generator, ``run`` calls the library, ``expect`` computes the answer with the
dense float64 oracle of ``dense_oracle.py``, never with sparsecore). Each
*mutation* changes one argument: a dtype, a rank, NaN / inf, an out-of-range
value, a duplicate site, an empty input, a strided view, a mismatched length,
a wrong weight layout, a wrong type. A mutation says whether the call stays
valid (then the library must return the oracle's answer, or refuse clearly)
and which argument names a clear message may mention.

Outcomes of one case:

* ``clear``: a ValueError / TypeError / IndexError raised from sparsecore's own
  code (``sparsecore/`` or ``frontends/``) whose message names the argument;
* ``correct``: a valid call returned the oracle's answer;
* ``obscure``: any other exception (raised inside NumPy / torch, or a message
  that does not name the argument);
* ``silent``: an invalid call returned, or a valid call returned a wrong answer;
* ``crash`` / ``hang``: counted by the runner in ``test_bad_inputs.py``.

Run ``python tests/bad_input_cases.py`` for the counts and the cases that fail.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import sys
import traceback
from typing import Any, Callable

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if HERE not in sys.path:
    sys.path.insert(0, HERE)

SHAPE = (4, 5, 6)
BATCH = 2
C_IN, C_OUT = 4, 2  # C_IN != kernel size: torch's [out, in, *k] layout is told apart
CASE_SECONDS = 10
OUTCOMES = ("clear", "correct", "obscure", "silent", "crash", "hang")
_LIBRARY_DIRS = (os.path.join(ROOT, "sparsecore") + os.sep, os.path.join(ROOT, "frontends") + os.sep)


@dataclasses.dataclass(frozen=True)
class Mutation:
    """One change to one argument kind.

    Attributes:
        name: short label.
        kind: the argument kind it applies to (``indices``, ``features``, ...).
        apply: ``(value, rng) -> new value``.
        valid: the call stays valid (the oracle's answer is expected).
        names: substrings of which a clear message must contain one.
    """

    name: str
    kind: str
    apply: Callable[[Any, np.random.Generator], Any]
    valid: bool
    names: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Entry:
    """A public entry point: ``make(rng) -> args``, ``run(args) -> result``, ``check(args, result) -> bool``.

    ``check`` compares the result with the dense float64 oracle computed from
    ``args`` (never with sparsecore). ``kinds`` maps an argument of ``args`` to
    its mutation kind; ``rows`` lists the arguments with one row per site (an
    "empty" mutation empties all of them at once).
    """

    name: str
    make: Callable[[np.random.Generator], dict]
    run: Callable[[dict], Any]
    check: Callable[[dict, Any], bool]
    kinds: dict
    rows: tuple[str, ...] = ()
    valid_here: tuple[str, ...] = ()


# ----------------------------------------------------------------------------- oracle helpers


def _oracle():
    import dense_oracle

    return dense_oracle


def _torch():
    import torch

    return torch


def _np(value: Any) -> np.ndarray:
    if hasattr(value, "detach"):
        value = value.detach().cpu().numpy()
    return np.asarray(value, dtype=np.float64)


def _tolerance(args: dict) -> float:
    dtypes = [np.asarray(v).dtype for k, v in args.items() if k in ("features", "other_features", "weight")
              and hasattr(v, "dtype")]
    dtypes += [np.dtype(str(v.dtype).replace("torch.", "")) for k, v in args.items()
               if k in ("features", "weight") and hasattr(v, "detach")]
    worst = min((d.itemsize for d in dtypes if d.kind == "f"), default=8)
    return {2: 3e-2, 4: 1e-4}.get(worst, 1e-9)


def close(actual: Any, expected: Any, args: dict) -> bool:
    """Same shape, values within the dtype's tolerance, NaN where NaN is expected."""
    actual, expected = _np(actual), _np(expected)
    if actual.shape != expected.shape:
        return False
    tol = _tolerance(args)
    return bool(np.allclose(actual, expected, rtol=tol, atol=tol, equal_nan=True))


def _base(rng: np.random.Generator) -> dict:
    indices = _oracle().random_indices(rng, SHAPE, BATCH, density=rng.uniform(0.1, 0.4))
    features = _oracle().random_features(rng, indices.shape[0], C_IN)
    return {"features": features, "indices": indices, "spatial_shape": SHAPE, "batch_size": BATCH}


def _dense(features: Any, indices: Any, fill: float = 0.0, batch: int = BATCH):
    """The oracle's dense grid ``[B, C, *SHAPE]`` float64."""
    return _oracle().densify(_np(features), np.asarray(indices).astype(np.int64), SHAPE, batch, fill)


def _expected_sites(args: dict, kind: str):
    """``(features [M, C], sites [M, 4])`` of a conv (``subm`` / ``regular``) or ``maxpool`` by dense ops."""
    do, torch = _oracle(), _torch()
    indices = np.asarray(args["indices"]).astype(np.int64)
    batch = int(args["batch_size"])
    if kind == "maxpool":
        out = do.dense_max_pool(_dense(args["features"], indices, -np.inf, batch), 2, 2, 0, 1)
        sites = do.regular_sites(indices, SHAPE, batch, 2, 2, 0, 1)
        return _np(do.read_sites(out, sites)), sites
    weight = torch.as_tensor(_np(args["weight"]))
    if not torch.isfinite(weight).all():
        # a dense conv multiplies the NaN / inf weight by the zeros of inactive sites; the
        # sparse conv sums over active neighbours only: the naive pair enumeration is the oracle
        stride, padding = (1, 0) if kind == "subm" else (2, 1)
        padding = 1 if kind == "transposed" else padding
        naive = do.naive_rulebook(indices, SHAPE, batch, kind, 3, stride, padding)
        return _np(do.naive_conv(torch.as_tensor(_np(args["features"])), weight, naive)), naive.output_indices
    dense = _dense(args["features"], indices, 0.0, batch)
    if kind == "subm":
        return _np(do.read_sites(do.dense_conv(dense, weight, 1, 1, 1), indices)), indices
    if kind == "transposed":
        out = do.dense_conv_transpose(dense, weight, 2, 1, 1)
        sites = do.transposed_sites(indices, SHAPE, batch, 3, 2, 1, 1, 0)
        return _np(do.read_sites(out, sites)), sites
    out = do.dense_conv(dense, weight, 2, 1, 1)
    sites = do.regular_sites(indices, SHAPE, batch, 3, 2, 1, 1)
    return _np(do.read_sites(out, sites)), sites


def same_sites(features: Any, indices: Any, expected: tuple[Any, Any], args: dict) -> bool:
    """The result's (features, sites) equal the expected ones as a map from site to row."""
    want = {tuple(int(v) for v in row): n for n, row in enumerate(np.asarray(expected[1]))}
    got = [tuple(int(v) for v in row) for row in np.asarray(_np(indices)).astype(np.int64)]
    if len(got) != len(want) or set(got) != set(want):
        return False
    order = [want[site] for site in got]
    return close(features, _np(expected[0])[order], args)


# ----------------------------------------------------------------------------- core entries


def _core_tensor(args: dict, prefix: str = ""):
    import sparsecore as sc

    return sc.SparseTensor(args[prefix + "features"], args[prefix + "indices"], args["spatial_shape"],
                           args["batch_size"])


_SITE_KINDS = {"features": "features", "indices": "indices", "spatial_shape": "spatial_shape",
               "batch_size": "batch_size"}


def _make_conv(rng: np.random.Generator) -> dict:
    args = _base(rng)
    args["weight"] = _oracle().random_weight(rng, C_OUT, (3, 3, 3), C_IN)
    return args


def _conv_entry(kind: str) -> Entry:
    def run(args: dict):
        import sparsecore as sc

        stride, padding = (1, 0) if kind == "subm" else (2, 1)
        out = sc.sparse_conv(_core_tensor(args), args["weight"], kind=kind, stride=stride, padding=padding)
        return out.features, out.indices

    return Entry(f"core.sparse_conv[{kind}]", _make_conv, run,
                 lambda args, out: same_sites(*out, _expected_sites(args, kind), args),
                 dict(_SITE_KINDS, weight="weight"), ("features", "indices"))


def _run_max_pool(args: dict):
    import sparsecore as sc

    out = sc.sparse_max_pool(_core_tensor(args), 2)
    return out.features, out.indices


def _global_oracle(args: dict, reduce: str) -> np.ndarray:
    features, indices = _np(args["features"]), np.asarray(args["indices"])
    out = np.zeros((int(args["batch_size"]), features.shape[1]))
    for batch in range(out.shape[0]):
        rows = features[indices[:, 0] == batch]
        if rows.shape[0]:
            out[batch] = rows.max(0) if reduce == "max" else rows.mean(0)
    return out


def _global_entry(reduce: str) -> Entry:
    def run(args: dict):
        import sparsecore as sc

        return (sc.global_max_pool if reduce == "max" else sc.global_avg_pool)(_core_tensor(args))

    return Entry(f"core.global_{reduce}_pool", _base, run,
                 lambda args, out: close(out, _global_oracle(args, reduce), args), _SITE_KINDS,
                 ("features", "indices"))


def _make_two(rng: np.random.Generator) -> dict:
    args = _base(rng)
    other = _base(rng)
    args["other_features"], args["other_indices"] = other["features"], other["indices"]
    return args


def _run_sparse_add(args: dict):
    import sparsecore as sc

    out = sc.sparse_add(_core_tensor(args), _core_tensor(args, "other_"))
    return out.features, out.indices


def _check_sparse_add(args: dict, out: Any) -> bool:
    do = _oracle()
    batch = int(args["batch_size"])
    expected = (_dense(args["features"], args["indices"], 0.0, batch)
                + _dense(args["other_features"], args["other_indices"], 0.0, batch))
    sites = np.unique(np.concatenate([np.asarray(args["indices"]), np.asarray(args["other_indices"])]), axis=0)
    return same_sites(*out, (_np(do.read_sites(expected, sites)), sites), args)


def _run_union(args: dict):
    import sparsecore as sc

    return sc.union_sites([args["indices"], args["other_indices"]], args["spatial_shape"], args["batch_size"])


def _check_union(args: dict, out: Any) -> bool:
    union, rows = np.asarray(out[0]), out[1]
    expected = {tuple(int(v) for v in r) for part in ("indices", "other_indices") for r in np.asarray(args[part])}
    if sorted(expected) != [tuple(int(v) for v in r) for r in union]:
        return False
    return all(np.array_equal(union[np.asarray(part_rows)], np.asarray(args[part]))
               for part, part_rows in zip(("indices", "other_indices"), rows))


def _run_pack(args: dict):
    import sparsecore as sc

    return sc.pack_keys(args["indices"], args["spatial_shape"], args["batch_size"])


def _check_pack(args: dict, out: Any) -> bool:
    indices = np.asarray(args["indices"]).astype(np.int64)
    dims = (int(args["batch_size"]),) + tuple(int(v) for v in args["spatial_shape"])
    return np.array_equal(np.asarray(out), np.ravel_multi_index(indices.T, dims))


def _make_table(rng: np.random.Generator) -> dict:
    keys = rng.choice(1000, size=int(rng.integers(1, 40)), replace=False).astype(np.int64)
    return {"keys": keys, "queries": np.concatenate([rng.choice(keys, 10), rng.integers(0, 1000, 10)])}


def _run_lookup(args: dict):
    import sparsecore as sc

    return sc.HashTable(args["keys"]).lookup(args["queries"])


def _check_lookup(args: dict, out: Any) -> bool:
    table = {int(k): n for n, k in enumerate(np.asarray(args["keys"]))}
    return np.array_equal(np.asarray(out), [table.get(int(q), -1) for q in np.asarray(args["queries"])])


def _make_pair_map(rng: np.random.Generator) -> dict:
    args = _make_conv(rng)
    naive = _oracle().naive_rulebook(args["indices"], SHAPE, BATCH, "subm", 3)
    args["pair_input"] = np.concatenate([ins for ins, _ in naive.pairs]).astype(np.int32)
    args["pair_output"] = np.concatenate([outs for _, outs in naive.pairs]).astype(np.int32)
    args["offset_starts"] = tuple(int(v) for v in np.cumsum([0] + [len(ins) for ins, _ in naive.pairs]))
    return args


def _run_conv_forward(args: dict):
    import sparsecore as sc

    rows = int(np.asarray(args["indices"]).shape[0])
    pairs = sc.PairMap(args["pair_input"], args["pair_output"], args["offset_starts"], rows, rows, (3, 3, 3))
    return sc.conv_forward(args["features"], args["weight"], pairs)


def _make_points(rng: np.random.Generator) -> dict:
    return {"points": rng.uniform(-1.0, 5.0, (int(rng.integers(1, 60)), 4)), "voxel_size": (1.0, 1.0, 1.0),
            "coordinate_range": (0.0, 0.0, 0.0, 4.0, 4.0, 4.0),
            "max_num_points_per_voxel": int(rng.integers(1, 6)), "max_num_voxels": 1000}


def _run_voxelize(args: dict):
    import sparsecore as sc

    return sc.voxelize(args["points"], args["voxel_size"], args["coordinate_range"],
                       args["max_num_points_per_voxel"], args["max_num_voxels"])


def _check_voxelize(args: dict, out: Any) -> bool:
    points = _np(args["points"])
    low, high = np.asarray(args["coordinate_range"][:3], float), np.asarray(args["coordinate_range"][3:], float)
    inside = np.all((points[:, :3] >= low) & (points[:, :3] < high), axis=1)
    cells = [tuple(c) for c in np.floor((points[inside, :3] - low) / np.asarray(args["voxel_size"]))]
    counts = {cell: min(cells.count(cell), int(args["max_num_points_per_voxel"])) for cell in set(cells)}
    got = {tuple(int(v) for v in row[::-1]): int(n) for row, n in
           zip(np.asarray(out.indices), np.asarray(out.num_points_per_voxel))}
    return np.array_equal(np.asarray(out.point_voxel_id) >= 0, inside) and got == counts


def _run_to_dense(args: dict):
    import sparsecore as sc

    return sc.to_dense(args["features"], args["indices"], args["spatial_shape"], args["batch_size"])


def _run_tensor_dense(args: dict):
    return _core_tensor(args).dense()


def _check_dense(args: dict, out: Any) -> bool:
    return close(out, _dense(args["features"], args["indices"], 0.0, int(args["batch_size"])), args)


def _make_grid(rng: np.random.Generator) -> dict:
    args = _base(rng)
    return {"dense": _np(_dense(args["features"], args["indices"])).transpose(0, 2, 3, 4, 1).copy()}


def _run_from_dense(args: dict):
    import sparsecore as sc

    return sc.from_dense(args["dense"])


def _check_from_dense(args: dict, out: Any) -> bool:
    dense = _np(args["dense"])
    sites = np.argwhere(np.any(dense != 0, axis=-1))
    return same_sites(out[0], out[1], (dense[tuple(sites.T)], sites), {"features": dense})


# ----------------------------------------------------------------------------- sparsecore.torch entries


def _t(value: Any) -> Any:
    """A NumPy argument as the torch tensor a user would pass (other values unchanged)."""
    if isinstance(value, np.ndarray):
        try:
            return _torch().from_numpy(value)
        except (TypeError, ValueError):
            return value
    return value


def _torch_tensor(args: dict, prefix: str = ""):
    import sparsecore.torch as spconv

    return spconv.SparseConvTensor(_t(args[prefix + "features"]), _t(args[prefix + "indices"]),
                                   args["spatial_shape"], args["batch_size"])


def _torch_conv_entry(kind: str) -> Entry:
    def run(args: dict):
        import sparsecore.torch as spconv

        torch = _torch()
        if kind == "subm":
            layer = spconv.SubMConv3d(C_IN, C_OUT, 3, bias=False)
        elif kind == "transposed":
            layer = spconv.SparseConvTranspose3d(C_IN, C_OUT, 3, stride=2, padding=1, bias=False)
        else:
            layer = spconv.SparseConv3d(C_IN, C_OUT, 3, stride=2, padding=1, bias=False)
        weight = _t(args["weight"])
        layer.weight = torch.nn.Parameter(weight) if isinstance(weight, torch.Tensor) and weight.is_floating_point() \
            else weight
        out = layer(_torch_tensor(args))
        return out.features, out.indices

    name = {"subm": "SubMConv3d", "regular": "SparseConv3d", "transposed": "SparseConvTranspose3d"}[kind]
    return Entry(f"torch.{name}", _make_conv, run,
                 lambda args, out: same_sites(*out, _expected_sites(args, kind), args),
                 dict(_SITE_KINDS, weight="module_weight"), ("features", "indices"))


def _run_torch_max_pool(args: dict):
    import sparsecore.torch as spconv

    out = spconv.SparseMaxPool3d(2)(_torch_tensor(args))
    return out.features, out.indices


def _torch_global_entry(reduce: str) -> Entry:
    def run(args: dict):
        import sparsecore.torch as spconv

        pool = spconv.SparseGlobalMaxPool() if reduce == "max" else spconv.SparseGlobalAvgPool()
        return pool(_torch_tensor(args))

    return Entry(f"torch.SparseGlobal{reduce.title()}Pool", _base, run,
                 lambda args, out: close(out, _global_oracle(args, reduce), args), _SITE_KINDS,
                 ("features", "indices"))


def _run_torch_dense(args: dict):
    return _torch_tensor(args).dense()


def _run_torch_sparse_add(args: dict):
    import sparsecore.torch as spconv

    out = spconv.functional.sparse_add(_torch_tensor(args), _torch_tensor(args, "other_"))
    return out.features, out.indices


def _run_torch_join(args: dict):
    import sparsecore.torch as spconv

    x = _torch_tensor(args)
    y = x.replace_feature(_t(args["other_features"]))
    return spconv.JoinTable()([x, y]).dense()


def _check_join(args: dict, out: Any) -> bool:
    torch = _torch()
    batch = int(args["batch_size"])
    return close(out, torch.cat([_dense(args["features"], args["indices"], 0.0, batch),
                                 _dense(args["other_features"], args["indices"], 0.0, batch)], 1), args)


def _make_join(rng: np.random.Generator) -> dict:
    args = _base(rng)
    args["other_features"] = _oracle().random_features(rng, args["indices"].shape[0], 2)
    return args


def _run_avg_pool(args: dict):
    import sparsecore as sc

    out = sc.sparse_avg_pool(_core_tensor(args), 2)
    return out.features, out.indices


def _check_avg_pool(args: dict, out: Any) -> bool:
    do = _oracle()
    indices = np.asarray(args["indices"]).astype(np.int64)
    batch = int(args["batch_size"])
    total = do.dense_window_sum(_dense(args["features"], indices, 0.0, batch), 2, 2, 0, 1)
    count = do.dense_window_sum(do.occupancy(indices, SHAPE, batch), 2, 2, 0, 1)
    sites = do.regular_sites(indices, SHAPE, batch, 2, 2, 0, 1)
    mean = _np(do.read_sites(total, sites)) / np.maximum(_np(do.read_sites(count, sites)), 1)
    return same_sites(*out, (mean, sites), args)


def _run_torch_sequential_batch_norm(args: dict):
    import sparsecore.torch as spconv

    torch = _torch()
    x = _torch_tensor(args)
    return spconv.SparseSequential(torch.nn.BatchNorm1d(C_IN).double())(x).features


def _check_batch_norm(args: dict, out: Any) -> bool:
    features = _np(args["features"])
    if features.shape[0] == 0:
        return close(out, features, args)  # SparseSequential passes an empty tensor through
    expected = (features - features.mean(0)) / np.sqrt(features.var(0) + 1e-5)
    return close(out, expected, args)


def _run_torch_add(args: dict):
    x = _torch_tensor(args)
    return (x + _t(args["other_features"])).dense()


def _check_torch_add(args: dict, out: Any) -> bool:
    total = _np(args["features"]) + _np(args["other_features"])
    return close(out, _dense(total, args["indices"], 0.0, int(args["batch_size"])), args)


def _make_same_sites(rng: np.random.Generator) -> dict:
    args = _base(rng)
    args["other_features"] = _oracle().random_features(rng, args["indices"].shape[0], C_IN)
    return args


def _make_backward(rng: np.random.Generator) -> dict:
    import sparsecore as sc

    args = _make_conv(rng)
    geometry = sc.ConvGeometry.create(3, 3, kind="subm")
    args["rulebook"] = sc.build_rulebook(args["indices"], SHAPE, BATCH, geometry)
    args["grad_output"] = _oracle().random_features(rng, args["indices"].shape[0], C_OUT)
    return args


def _run_conv_backward(args: dict):
    import sparsecore as sc

    return sc.conv_backward(args["grad_output"], args["features"], args["weight"], args["rulebook"])


def _check_conv_backward(args: dict, out: Any) -> bool:
    """Gradients of ``sum(conv(x)[sites] * G)`` by torch autograd through the dense conv."""
    do, torch = _oracle(), _torch()
    features = torch.as_tensor(_np(args["features"])).requires_grad_()
    weight = torch.as_tensor(_np(args["weight"])).requires_grad_()
    indices = np.asarray(args["indices"]).astype(np.int64)
    finite = all(np.isfinite(_np(args[name])).all() for name in ("features", "weight", "grad_output"))
    if finite:
        dense = do.densify(features, indices, SHAPE, BATCH)
        result = do.read_sites(do.dense_conv(dense, weight, 1, 1, 1), indices)
    else:  # the dense conv's zeros would meet the NaN / inf: sum over the naive pairs instead
        result = do.naive_conv(features, weight, do.naive_rulebook(indices, SHAPE, BATCH, "subm", 3))
    (result * torch.as_tensor(_np(args["grad_output"]))).sum().backward()
    return close(out[0], features.grad, args) and close(out[1], weight.grad, args)


def _run_torch_from_dense(args: dict):
    import sparsecore.torch as spconv

    out = spconv.SparseConvTensor.from_dense(_t(args["dense"]))
    return out.features, out.indices


def _make_assigned(rng: np.random.Generator) -> dict:
    args = _make_conv(rng)
    args["assigned_indices"] = args["indices"][::-1].copy()  # the same sites in another order
    return args


def _run_torch_assigned(args: dict):
    """spconv code that assigns ``x.indices`` before the next layer."""
    import sparsecore.torch as spconv

    torch = _torch()
    x = _torch_tensor(args)
    x.indices = _t(args["assigned_indices"])
    layer = spconv.SubMConv3d(C_IN, C_OUT, 3, bias=False)
    layer.weight = torch.nn.Parameter(_t(args["weight"]))
    out = layer(x)
    return out.features, out.indices


def _check_assigned(args: dict, out: Any) -> bool:
    moved = dict(args, indices=args["assigned_indices"])
    return same_sites(*out, _expected_sites(moved, "subm"), args)


def entries() -> list[Entry]:
    """Every public entry point the suite mutates (core first, then sparsecore.torch)."""
    two = dict(_SITE_KINDS, other_features="features", other_indices="indices")
    return [
        Entry("core.SparseTensor.dense", _base, _run_tensor_dense, _check_dense, _SITE_KINDS, ("features", "indices")),
        Entry("core.to_dense", _base, _run_to_dense, _check_dense, _SITE_KINDS, ("features", "indices")),
        Entry("core.from_dense", _make_grid, _run_from_dense, _check_from_dense, {"dense": "dense"}),
        _conv_entry("subm"),
        _conv_entry("regular"),
        _conv_entry("transposed"),
        Entry("core.conv_backward", _make_backward, _run_conv_backward, _check_conv_backward,
              {"features": "features", "weight": "weight", "grad_output": "features"}),
        Entry("core.sparse_max_pool", _base, _run_max_pool,
              lambda args, out: same_sites(*out, _expected_sites(args, "maxpool"), args), _SITE_KINDS,
              ("features", "indices")),
        Entry("core.sparse_avg_pool", _base, _run_avg_pool, _check_avg_pool, _SITE_KINDS, ("features", "indices")),
        _global_entry("max"),
        _global_entry("avg"),
        Entry("core.sparse_add", _make_two, _run_sparse_add, _check_sparse_add, two,
              ("features", "indices", "other_features", "other_indices")),
        Entry("core.union_sites", _make_two, _run_union, _check_union,
              {"indices": "indices", "other_indices": "indices", "spatial_shape": "spatial_shape",
               "batch_size": "batch_size"}),
        Entry("core.pack_keys", _base, _run_pack, _check_pack,
              {"indices": "indices", "spatial_shape": "spatial_shape", "batch_size": "batch_size"},
              valid_here=("duplicate site",)),
        Entry("core.HashTable.lookup", _make_table, _run_lookup, _check_lookup, {"keys": "keys", "queries": "queries"}),
        Entry("core.conv_forward(PairMap)", _make_pair_map, _run_conv_forward,
              lambda args, out: close(out, _expected_sites(args, "subm")[0], args),
              {"features": "features", "weight": "weight", "pair_input": "pairs", "pair_output": "pairs"}),
        Entry("core.voxelize", _make_points, _run_voxelize, _check_voxelize,
              {"points": "points", "voxel_size": "voxel_size", "coordinate_range": "coordinate_range",
               "max_num_points_per_voxel": "max_points", "max_num_voxels": "max_voxels"}, ("points",)),
        Entry("torch.SparseConvTensor.dense", _base, _run_torch_dense, _check_dense, _SITE_KINDS,
              ("features", "indices")),
        _torch_conv_entry("subm"),
        _torch_conv_entry("regular"),
        _torch_conv_entry("transposed"),
        Entry("torch.SparseMaxPool3d", _base, _run_torch_max_pool,
              lambda args, out: same_sites(*out, _expected_sites(args, "maxpool"), args), _SITE_KINDS,
              ("features", "indices")),
        _torch_global_entry("max"),
        _torch_global_entry("avg"),
        Entry("torch.functional.sparse_add", _make_two, _run_torch_sparse_add, _check_sparse_add, two,
              ("features", "indices", "other_features", "other_indices")),
        Entry("torch.JoinTable", _make_join, _run_torch_join, _check_join,
              dict(_SITE_KINDS, other_features="features"), ("features", "indices", "other_features")),
        # the site checks before a plain torch module sees the rows (its own dtype rules are torch's)
        Entry("torch.SparseSequential(BatchNorm1d)", _base, _run_torch_sequential_batch_norm, _check_batch_norm,
              {"indices": "indices", "spatial_shape": "spatial_shape", "batch_size": "batch_size"},
              ("features", "indices")),
        Entry("torch.SparseConvTensor + tensor", _make_same_sites, _run_torch_add, _check_torch_add,
              dict(_SITE_KINDS, other_features="features"), ("features", "indices", "other_features")),
        Entry("torch.SparseConvTensor.from_dense", _make_grid, _run_torch_from_dense, _check_from_dense,
              {"dense": "dense"}),
        Entry("torch.assigned indices -> SubMConv3d", _make_assigned, _run_torch_assigned, _check_assigned,
              {"assigned_indices": "indices", "weight": "module_weight"}),
    ]


# ----------------------------------------------------------------------------- mutations


def _row(value: np.ndarray, rng: np.random.Generator) -> int:
    return int(rng.integers(0, value.shape[0]))


def _set(value: np.ndarray, rng: np.random.Generator, column: int | None, new: Any) -> np.ndarray:
    out = np.array(value, copy=True)
    if out.shape[0] == 0:
        return out
    row = _row(out, rng)
    if column is None:
        out.reshape(out.shape[0], -1)[row, int(rng.integers(0, out.reshape(out.shape[0], -1).shape[1]))] = new
    else:
        out[row, column] = new
    return out


def _duplicate(value: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    out = np.array(value, copy=True)
    if out.shape[0] >= 2:
        first, second = rng.choice(out.shape[0], 2, replace=False)
        out[second] = out[first]
    return out


def _strided(value: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    return np.repeat(value, 2, axis=0)[::2]


def _huge(value: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    out = np.array(value, dtype=np.int64, copy=True)
    out.reshape(-1)[int(rng.integers(0, max(out.size, 1)))] = 2**40
    return out


def _m(name: str, kind: str, apply: Callable, valid: bool, *names: str) -> Mutation:
    return Mutation(name, kind, apply, valid, names)


_IDX = ("indices",)
_FEAT = ("features",)
_SHAPE = ("spatial_shape", "indices")
_BATCH = ("batch_size",)
_W = ("weight",)

MUTATIONS = [
    # indices
    _m("float dtype", "indices", lambda v, r: v.astype(np.float64), False, *_IDX),
    _m("int64", "indices", lambda v, r: v.astype(np.int64), True, *_IDX),
    _m("int16", "indices", lambda v, r: v.astype(np.int16), True, *_IDX),
    _m("uint8", "indices", lambda v, r: v.astype(np.uint8), True, *_IDX),
    _m("negative coordinate", "indices", lambda v, r: _set(v, r, int(r.integers(1, 4)), -1), False, *_IDX),
    _m("coordinate == shape", "indices", lambda v, r: _set(v, r, 3, SHAPE[2]), False, *_IDX),
    _m("batch index == batch_size", "indices", lambda v, r: _set(v, r, 0, BATCH), False, "indices", "batch"),
    _m("beyond int32", "indices", _huge, False, *_IDX),
    _m("duplicate site", "indices", _duplicate, False, *_IDX),
    _m("rank 1", "indices", lambda v, r: v.reshape(-1), False, *_IDX),
    _m("rank 3", "indices", lambda v, r: v[:, :, None], False, *_IDX),
    _m("extra column", "indices", lambda v, r: np.concatenate([v, v[:, :1]], 1), False, *_IDX),
    _m("missing column", "indices", lambda v, r: v[:, :-1].copy(), False, *_IDX),
    _m("strided view", "indices", _strided, True, *_IDX),
    _m("Fortran order", "indices", lambda v, r: np.asfortranarray(v), True, *_IDX),
    _m("nested list", "indices", lambda v, r: v.tolist(), True, *_IDX),
    _m("None", "indices", lambda v, r: None, False, *_IDX),
    _m("string", "indices", lambda v, r: "0,1,2,3", False, *_IDX),
    # features
    _m("int dtype", "features", lambda v, r: (v * 4).astype(np.int64), True, *_FEAT),
    _m("float32", "features", lambda v, r: v.astype(np.float32), True, *_FEAT),
    _m("float16", "features", lambda v, r: v.astype(np.float16), True, *_FEAT),
    _m("bool", "features", lambda v, r: v > 0, True, *_FEAT),
    _m("complex", "features", lambda v, r: v.astype(np.complex128), False, *_FEAT),
    _m("NaN", "features", lambda v, r: _set(v, r, None, np.nan), True, *_FEAT),
    _m("inf", "features", lambda v, r: _set(v, r, None, np.inf), True, *_FEAT),
    _m("-inf", "features", lambda v, r: _set(v, r, None, -np.inf), True, *_FEAT),
    _m("rank 1", "features", lambda v, r: v[:, 0].copy(), False, *_FEAT),
    _m("rank 3", "features", lambda v, r: v[:, :, None], False, *_FEAT),
    _m("one row fewer", "features", lambda v, r: v[:-1], False, "features", "rows"),
    _m("one row more", "features", lambda v, r: np.concatenate([v, v[:1]]), False, "features", "rows"),
    _m("strided view", "features", _strided, True, *_FEAT),
    _m("column view", "features", lambda v, r: np.concatenate([v, v], 1)[:, ::2], True, *_FEAT),
    _m("Fortran order", "features", lambda v, r: np.asfortranarray(v), True, *_FEAT),
    _m("nested list", "features", lambda v, r: v.tolist(), True, *_FEAT),
    _m("None", "features", lambda v, r: None, False, *_FEAT),
    # spatial_shape
    _m("float 1.9", "spatial_shape", lambda v, r: (1.9, 5, 6), False, *_SHAPE),
    _m("whole floats", "spatial_shape", lambda v, r: (4.0, 5.0, 6.0), False, *_SHAPE),
    _m("NaN", "spatial_shape", lambda v, r: (float("nan"), 5, 6), False, *_SHAPE),
    _m("string", "spatial_shape", lambda v, r: "456", False, *_SHAPE),
    _m("zero axis", "spatial_shape", lambda v, r: (4, 0, 6), False, *_SHAPE),
    _m("negative axis", "spatial_shape", lambda v, r: (4, -5, 6), False, *_SHAPE),
    _m("too few axes", "spatial_shape", lambda v, r: (4, 5), False, *_SHAPE),
    _m("too many axes", "spatial_shape", lambda v, r: (4, 5, 6, 7), False, *_SHAPE),
    _m("smaller than the sites", "spatial_shape", lambda v, r: (2, 2, 2), False, *_SHAPE),
    _m("NumPy int array", "spatial_shape", lambda v, r: np.array(v, dtype=np.int64), True, *_SHAPE),
    _m("None", "spatial_shape", lambda v, r: None, False, *_SHAPE),
    # batch_size
    _m("zero", "batch_size", lambda v, r: 0, False, *_BATCH),
    _m("negative", "batch_size", lambda v, r: -2, False, *_BATCH),
    _m("float", "batch_size", lambda v, r: 2.0, False, *_BATCH),
    _m("bool", "batch_size", lambda v, r: True, False, *_BATCH),
    _m("string", "batch_size", lambda v, r: "2", False, *_BATCH),
    _m("None", "batch_size", lambda v, r: None, False, *_BATCH),
    _m("smaller than the sites", "batch_size", lambda v, r: 1, False, "batch_size", "indices"),
    _m("larger", "batch_size", lambda v, r: 3, True, *_BATCH),
    _m("NumPy int", "batch_size", lambda v, r: np.int64(2), True, *_BATCH),
    # weights (functional: the kernel size comes from the weight)
    _m("[in, *k, out] layout", "weight", lambda v, r: np.ascontiguousarray(np.moveaxis(v, [0, -1], [-1, 0])),
       False, *_W),
    _m("torch [out, in, *k] layout", "weight", lambda v, r: np.ascontiguousarray(np.moveaxis(v, -1, 1)), False, *_W),
    _m("rank 4", "weight", lambda v, r: v[..., 0], False, *_W),
    _m("int dtype", "weight", lambda v, r: (v * 4).astype(np.int64), True, *_W),
    _m("float32", "weight", lambda v, r: v.astype(np.float32), True, *_W),
    _m("NaN", "weight", lambda v, r: _set(v, r, None, np.nan), True, *_W),
    _m("strided view", "weight", _strided, True, *_W),
    _m("None", "weight", lambda v, r: None, False, *_W),
    # module weights (the layer's kernel size is fixed)
    _m("[in, *k, out] layout", "module_weight",
       lambda v, r: np.ascontiguousarray(np.moveaxis(v, [0, -1], [-1, 0])), False, *_W),
    _m("torch [out, in, *k] layout", "module_weight", lambda v, r: np.ascontiguousarray(np.moveaxis(v, -1, 1)),
       False, *_W),
    _m("kernel 2", "module_weight", lambda v, r: v[:, :2, :2, :2].copy(), False, *_W),
    _m("float32", "module_weight", lambda v, r: v.astype(np.float32), True, *_W),
    _m("NaN", "module_weight", lambda v, r: _set(v, r, None, np.nan), True, *_W),
    _m("strided view", "module_weight", _strided, True, *_W),
    # hash table keys and queries
    _m("float dtype", "keys", lambda v, r: v.astype(np.float64), False, "keys"),
    _m("negative", "keys", lambda v, r: _set(v[:, None], r, 0, -3)[:, 0], False, "keys"),
    _m("duplicate", "keys", _duplicate, False, "keys", "unique"),
    _m("rank 2", "keys", lambda v, r: v[:, None], False, "keys"),
    _m("int32", "keys", lambda v, r: v.astype(np.int32), True, "keys"),
    _m("strided view", "keys", _strided, True, "keys"),
    _m("float 20.7", "queries", lambda v, r: v.astype(np.float64) + 0.7, False, "queries"),
    _m("whole floats", "queries", lambda v, r: v.astype(np.float64), False, "queries"),
    _m("rank 2", "queries", lambda v, r: v[:, None], False, "queries"),
    _m("empty", "queries", lambda v, r: v[:0], True, "queries"),
    _m("negative", "queries", lambda v, r: -v - 1, True, "queries"),
    _m("int32", "queries", lambda v, r: v.astype(np.int32), True, "queries"),
    _m("huge", "queries", lambda v, r: v + 2**62, True, "queries"),
    # pair rows of a PairMap
    _m("negative row", "pairs", lambda v, r: _set(v[:, None], r, 0, -1)[:, 0], False, "pair_"),
    _m("row == count", "pairs", lambda v, r: _set(v[:, None], r, 0, 10**6)[:, 0], False, "pair_"),
    _m("float dtype", "pairs", lambda v, r: v.astype(np.float64), False, "pair_"),
    _m("one entry fewer", "pairs", lambda v, r: v[:-1], False, "pair", "offset_starts"),
    _m("int64", "pairs", lambda v, r: v.astype(np.int64), True, "pair_"),
    _m("strided view", "pairs", _strided, True, "pair_"),
    # points and voxelization parameters
    _m("NaN", "points", lambda v, r: _set(v, r, 0, np.nan), True, "points"),
    _m("inf", "points", lambda v, r: _set(v, r, 1, np.inf), True, "points"),
    _m("int dtype", "points", lambda v, r: v.astype(np.int64), False, "points"),
    _m("float32", "points", lambda v, r: v.astype(np.float32), True, "points"),
    _m("two columns", "points", lambda v, r: v[:, :2].copy(), False, "points", "voxel_size"),
    _m("rank 1", "points", lambda v, r: v.reshape(-1), False, "points"),
    _m("strided view", "points", _strided, True, "points"),
    _m("zero", "voxel_size", lambda v, r: (1.0, 0.0, 1.0), False, "voxel_size"),
    _m("negative", "voxel_size", lambda v, r: (1.0, -1.0, 1.0), False, "voxel_size"),
    _m("NaN", "voxel_size", lambda v, r: (1.0, float("nan"), 1.0), False, "voxel_size"),
    _m("two entries", "voxel_size", lambda v, r: (1.0, 1.0), False, "voxel_size", "coordinate_range"),
    _m("inverted", "coordinate_range", lambda v, r: (4.0, 0.0, 0.0, 0.0, 4.0, 4.0), False, "coordinate_range"),
    _m("NaN", "coordinate_range", lambda v, r: (0.0, float("nan"), 0.0, 4.0, 4.0, 4.0), False, "coordinate_range"),
    _m("five entries", "coordinate_range", lambda v, r: (0.0, 0.0, 0.0, 4.0, 4.0), False, "coordinate_range"),
    _m("zero", "max_points", lambda v, r: 0, False, "max_num_points_per_voxel"),
    _m("float", "max_points", lambda v, r: 2.5, False, "max_num_points_per_voxel"),
    _m("bool", "max_points", lambda v, r: True, False, "max_num_points_per_voxel"),
    _m("10**9", "max_points", lambda v, r: 10**9, False, "max_num_points_per_voxel"),
    _m("more than the points", "max_points", lambda v, r: 100, True, "max_num_points_per_voxel"),
    _m("NumPy int", "max_points", lambda v, r: np.int64(v), True, "max_num_points_per_voxel"),
    _m("zero", "max_voxels", lambda v, r: 0, False, "max_num_voxels"),
    _m("float", "max_voxels", lambda v, r: 2.5, False, "max_num_voxels"),
    _m("bool", "max_voxels", lambda v, r: True, False, "max_num_voxels"),
    _m("10**9", "max_voxels", lambda v, r: 10**9, True, "max_num_voxels"),
    _m("NumPy int", "max_voxels", lambda v, r: np.int64(v), True, "max_num_voxels"),
    # dense grids
    _m("rank 2", "dense", lambda v, r: v[0, 0, 0], False, "dense", "from_dense"),
    _m("NaN", "dense", lambda v, r: _set(v, r, None, np.nan), True, "dense"),
    _m("float32", "dense", lambda v, r: v.astype(np.float32), True, "dense"),
    _m("strided view", "dense", _strided, True, "dense"),
    _m("empty batch", "dense", lambda v, r: v[:0], True, "dense"),
]

EMPTY = Mutation("empty (every row argument)", "rows", lambda v, r: v[:0], True, ("features", "indices"))


def cases() -> list[tuple[int, int, str]]:
    """``(entry index, mutation index, argument)``; mutation -1 is the unmutated call, -2 the empty one."""
    out = []
    for position, entry in enumerate(entries()):
        out.append((position, -1, ""))
        if entry.rows:
            out.append((position, -2, ""))
        for argument, kind in entry.kinds.items():
            for number, mutation in enumerate(MUTATIONS):
                if mutation.kind == kind:
                    out.append((position, number, argument))
    return out


class _Hang(Exception):
    pass


def _alarm(signum: int, frame: Any) -> None:
    raise _Hang()


def _from_library(error: BaseException) -> bool:
    frames = traceback.extract_tb(error.__traceback__)
    return bool(frames) and frames[-1].filename.startswith(_LIBRARY_DIRS)


def judge(case: tuple[int, int, str]) -> tuple[str, str]:
    """Runs one case: ``(outcome, detail)`` with outcome in `OUTCOMES`."""
    position, number, argument = case
    entry = entries()[position]
    rng = np.random.default_rng([16, position, number + 2, sum(map(ord, argument))])
    args = entry.make(rng)
    if number == -1:
        mutation = Mutation("none", "", lambda v, r: v, True, ())
    elif number == -2:
        mutation = EMPTY
        for name in entry.rows:
            args[name] = args[name][:0]
    else:
        mutation = MUTATIONS[number]
        args[argument] = mutation.apply(args[argument], rng)
    if mutation.name in entry.valid_here:
        mutation = dataclasses.replace(mutation, valid=True)
    label = f"{entry.name} / {argument or '-'}: {mutation.name}"
    try:
        result = entry.run(args)
    except _Hang:
        raise
    except (ValueError, TypeError, IndexError) as error:
        message = str(error)
        names = mutation.names + ((argument,) if argument else ())
        if _from_library(error) and any(name in message for name in names):
            return "clear", label
        return "obscure", f"{label}: {type(error).__name__}: {message[:300]} [at {_where(error)}]"
    except Exception as error:  # noqa: BLE001 - the judge classifies every failure
        return "obscure", f"{label}: {type(error).__name__}: {str(error)[:300]} [at {_where(error)}]"
    if not mutation.valid:
        return "silent", f"{label}: returned instead of refusing"
    try:
        correct = entry.check(args, result)
    except Exception as error:  # noqa: BLE001 - an unreadable result is not a correct one
        return "silent", f"{label}: result not comparable ({type(error).__name__}: {error})"
    return ("correct", label) if correct else ("silent", f"{label}: differs from the dense oracle")


def _where(error: BaseException) -> str:
    frames = traceback.extract_tb(error.__traceback__)
    return f"{os.path.relpath(frames[-1].filename, ROOT)}:{frames[-1].lineno}" if frames else "?"


def run_batch(batch: list[tuple[int, int, str]]) -> list[tuple[tuple[int, int, str], str, str]]:
    """Judges ``batch`` in this process, each case under a `CASE_SECONDS` alarm (a hang fails one case)."""
    import warnings

    warnings.simplefilter("ignore")
    try:
        import torch

        torch.set_num_threads(1)
    except ImportError:
        pass
    # imports, torch op registration and numba's first compiles take seconds on a busy
    # machine: run each entry's valid call once before the per-case alarms start
    for position in range(len(entries())):
        try:
            judge((position, -1, ""))
        except Exception:  # noqa: BLE001 - judged again below, under the alarm
            pass
    previous = signal.signal(signal.SIGALRM, _alarm)
    results = []
    try:
        for case in batch:
            signal.alarm(CASE_SECONDS)
            try:
                outcome, detail = judge(case)
            except _Hang:
                outcome, detail = "hang", f"case {case}: over {CASE_SECONDS} s"
            finally:
                signal.alarm(0)
            results.append((case, outcome, detail))
    finally:
        signal.signal(signal.SIGALRM, previous)
    return results


def run_all(workers: int = 2, batch_seconds: float = 300.0) -> tuple[dict, list[str]]:
    """Judges every case in ``workers`` spawned processes; a crashed or stuck batch counts its cases."""
    import concurrent.futures
    import multiprocessing

    all_cases = cases()
    batches = [all_cases[start::workers * 4] for start in range(workers * 4)]
    counts = {outcome: 0 for outcome in OUTCOMES}
    failures: list[str] = []
    context = multiprocessing.get_context("spawn")
    pool = concurrent.futures.ProcessPoolExecutor(max_workers=workers, mp_context=context)
    try:
        futures = {pool.submit(run_batch, batch): batch for batch in batches}
        for future, batch in futures.items():
            try:
                results = future.result(timeout=batch_seconds)
            except concurrent.futures.TimeoutError:
                results = [(case, "hang", f"batch stuck: {case}") for case in batch]
            except concurrent.futures.process.BrokenProcessPool:
                results = [(case, "crash", f"worker died: {case}") for case in batch]
            for case, outcome, detail in results:
                counts[outcome] += 1
                if outcome not in ("clear", "correct"):
                    failures.append(f"{outcome}: {detail}")
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
    counts["cases"] = len(all_cases)
    return counts, failures


if __name__ == "__main__":
    summary, problems = run_all()
    print(", ".join(f"{key} {value}" for key, value in summary.items()))
    for line in problems:
        print(line)
