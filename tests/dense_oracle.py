"""Independent oracles for the sparse feature passes: dense PyTorch ops in float64.

Every expected value in the oracle tests comes from here, never from sparsecore:

* random sparse inputs (seeded ``np.random.default_rng``, random density, unique
  coordinates in random row order, features bounded away from zero);
* densification to ``[B, C, *spatial]`` float64 torch tensors (differentiable in
  the features), and reading a dense result back at sparse sites;
* the mapping of a sparsecore weight ``[out, *k, in // groups]`` onto the
  weights of ``torch.nn.functional.conv{1,2,3}d`` and ``conv_transpose{1,2,3}d``;
* the active output sites of each layer kind, from dense ops on the occupancy
  mask (a ones kernel over the mask is > 0 exactly where an input is in reach);
* gradients of ``loss = sum(out[active sites] * G)`` by torch autograd through
  the dense computation;
* a naive pair enumeration (plain Python loops over sites and kernel offsets,
  no hashing shared with the library) for 4D, where torch has no dense op.

Conventions follow ``docs/api.md``: indices are ``[N, 1 + D]`` with the batch
index first, and a pair at kernel offset ``k`` (row-major over the kernel axes)
means ``output[o] += features[i] @ weight[:, k, :].T``. For a regular conv the
input position of offset ``k`` is ``out * stride - padding + k * dilation``
(cross-correlation, as torch); a transposed conv sends an input at ``x`` to
``x * stride - padding + k * dilation``.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F

DTYPE = torch.float64

_CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
_CONV_T = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}
_MAX_POOL = {1: F.max_pool1d, 2: F.max_pool2d, 3: F.max_pool3d}


def as_tuple(value: int | Sequence[int], ndim: int) -> tuple[int, ...]:
    """Expands an int to ``ndim`` copies; checks a sequence's length."""
    if isinstance(value, (int, np.integer)):
        return (int(value),) * ndim
    value = tuple(int(v) for v in value)
    assert len(value) == ndim, (value, ndim)
    return value


def make_rng(*seed: int) -> np.random.Generator:
    """A fresh generator for one test case (seed parts mixed by SeedSequence)."""
    return np.random.default_rng(list(seed))


# --------------------------------------------------------------------------- inputs


def random_indices(
    rng: np.random.Generator,
    spatial_shape: Sequence[int],
    batch_size: int,
    density: float | None = None,
    num: int | None = None,
    empty_batches: Sequence[int] = (),
) -> np.ndarray:
    """Unique random sites ``[N, 1 + D]`` int32 in random row order.

    Args:
        rng: the case's generator.
        spatial_shape: grid extent per spatial axis.
        batch_size: number of batch elements.
        density: fraction of the grid that is active (random in [0.05, 0.7] if None).
        num: exact number of sites (overrides density); at least 1 unless 0 is given.
        empty_batches: batch elements that get no site at all.
    """
    spatial_shape = tuple(int(s) for s in spatial_shape)
    volume = int(np.prod(spatial_shape))
    allowed = [b for b in range(batch_size) if b not in set(empty_batches)]
    candidates = (np.array(allowed, dtype=np.int64)[:, None] * volume + np.arange(volume)).ravel()
    if num is None:
        if density is None:
            density = rng.uniform(0.05, 0.7)
        num = max(1, int(round(density * candidates.size)))
    num = min(num, candidates.size)
    flat = rng.choice(candidates, size=num, replace=False) if num else np.zeros(0, np.int64)
    coords = np.unravel_index(flat, (batch_size,) + spatial_shape)
    return np.stack(coords, axis=1).astype(np.int32).reshape(num, 1 + len(spatial_shape))


def random_features(rng: np.random.Generator, num: int, channels: int, dtype=np.float64) -> np.ndarray:
    """Standard-normal features of both signs, with |x| >= 0.05 (never zero)."""
    x = rng.standard_normal((num, channels))
    x = np.where(np.abs(x) < 0.05, np.copysign(0.05, x) + x, x)
    return x.astype(dtype)


def random_weight(
    rng: np.random.Generator, out_channels: int, kernel_size: Sequence[int], in_per_group: int, dtype=np.float64
) -> np.ndarray:
    """A sparsecore-layout weight ``[out, *kernel_size, in // groups]``."""
    return (rng.standard_normal((out_channels, *kernel_size, in_per_group)) / math.sqrt(in_per_group)).astype(dtype)


def to_torch(x, requires_grad: bool = False) -> torch.Tensor:
    """A float64 torch copy of a NumPy array (or float64 view of a tensor)."""
    t = torch.as_tensor(np.asarray(x, dtype=np.float64)).clone()
    return t.requires_grad_(requires_grad)


# ------------------------------------------------------------------ dense <-> sparse


def _index_tuple(indices) -> tuple[torch.Tensor, ...]:
    idx = torch.as_tensor(np.asarray(indices, dtype=np.int64))
    return tuple(idx[:, j] for j in range(idx.shape[1]))


def densify(features, indices, spatial_shape, batch_size, fill: float = 0.0) -> torch.Tensor:
    """``[B, C, *spatial]`` float64; differentiable when ``features`` is a tensor.

    Args:
        features: ``[N, C]`` NumPy array or float64 torch tensor.
        indices: ``[N, 1 + D]`` sites.
        spatial_shape: grid extent.
        batch_size: B.
        fill: the value of inactive sites (``-inf`` for max pooling).
    """
    if not isinstance(features, torch.Tensor):
        features = to_torch(features)
    channels = features.shape[1]
    base = torch.full((batch_size, *spatial_shape, channels), fill, dtype=DTYPE)
    dense = base.index_put(_index_tuple(indices), features)
    return dense.movedim(-1, 1)


def occupancy(indices, spatial_shape, batch_size) -> torch.Tensor:
    """The active-site mask ``[B, 1, *spatial]`` as float64 ones and zeros."""
    n = np.asarray(indices).shape[0]
    return densify(np.ones((n, 1)), indices, spatial_shape, batch_size)


def read_sites(dense: torch.Tensor, indices) -> torch.Tensor:
    """Rows ``dense[b, :, *coords]`` for each site: ``[N, C]``."""
    return dense.movedim(1, -1)[_index_tuple(indices)]


def sites_of(mask: torch.Tensor) -> np.ndarray:
    """Sites where a ``[B, 1, *spatial]`` mask is > 0, sorted by (batch, coords), int32."""
    return torch.nonzero(mask[:, 0] > 0.5).numpy().astype(np.int32)


# ------------------------------------------------------------------------ weights


def conv_weight_to_torch(weight: torch.Tensor) -> torch.Tensor:
    """``[out, *k, in/g]`` -> torch conv weight ``[out, in/g, *k]`` (any groups)."""
    ndim = weight.dim() - 2
    return weight.permute(0, ndim + 1, *range(1, ndim + 1))


def conv_transpose_weight_to_torch(weight: torch.Tensor, groups: int) -> torch.Tensor:
    """``[out, *k, in/g]`` -> torch conv_transpose weight ``[in, out/g, *k]``.

    Output channel ``g * (out/g) + j`` reads input channel ``g * (in/g) + i`` in
    both libraries, so the grouped layout is a block reshuffle, not a plain
    permute: ``torch_w[g * (in/g) + i, j, *k] = w[g * (out/g) + j, *k, i]``.
    """
    ndim = weight.dim() - 2
    out_channels, *kernel, in_per_group = weight.shape
    w = weight.reshape(groups, out_channels // groups, *kernel, in_per_group)
    w = w.permute(0, ndim + 2, 1, *range(2, ndim + 2))
    return w.reshape(groups * in_per_group, out_channels // groups, *kernel)


# ----------------------------------------------------------------------- dense ops


def dense_conv(x, weight, stride, padding, dilation, groups=1, bias=None) -> torch.Tensor:
    """torch conv{D}d with a sparsecore-layout weight (tensor, may require grad)."""
    ndim = x.dim() - 2
    return _CONV[ndim](
        x, conv_weight_to_torch(weight), bias, stride=as_tuple(stride, ndim),
        padding=as_tuple(padding, ndim), dilation=as_tuple(dilation, ndim), groups=groups,
    )


def dense_conv_transpose(x, weight, stride, padding, dilation, output_padding=0, groups=1, bias=None):
    """torch conv_transpose{D}d with a sparsecore-layout weight."""
    ndim = x.dim() - 2
    return _CONV_T[ndim](
        x, conv_transpose_weight_to_torch(weight, groups), bias, stride=as_tuple(stride, ndim),
        padding=as_tuple(padding, ndim), output_padding=as_tuple(output_padding, ndim),
        groups=groups, dilation=as_tuple(dilation, ndim),
    )


def _pad(x: torch.Tensor, padding, value: float) -> torch.Tensor:
    ndim = x.dim() - 2
    padding = as_tuple(padding, ndim)
    pads = []
    for p in reversed(padding):
        pads += [p, p]
    return F.pad(x, pads, mode="constant", value=value)


def dense_max_pool(x_filled, kernel_size, stride, padding, dilation) -> torch.Tensor:
    """torch max_pool on an input whose inactive sites hold -inf.

    The padding is applied by hand (with -inf) so any padding works, not only
    the ``padding <= kernel // 2`` that torch's pooling accepts.
    """
    ndim = x_filled.dim() - 2
    return _MAX_POOL[ndim](
        _pad(x_filled, padding, -math.inf), as_tuple(kernel_size, ndim),
        stride=as_tuple(stride, ndim), padding=0, dilation=as_tuple(dilation, ndim),
    )


def dense_window_sum(x, kernel_size, stride, padding, dilation) -> torch.Tensor:
    """Per-channel sum over each (dilated) window: a depthwise conv with a ones kernel."""
    return _depthwise_ones(_CONV, x, kernel_size, stride=stride, padding=padding, dilation=dilation)


def dense_window_sum_transpose(x, kernel_size, stride, padding, dilation, output_padding=0):
    """Per-channel scatter of a transposed conv with a ones kernel."""
    return _depthwise_ones(_CONV_T, x, kernel_size, stride=stride, padding=padding, dilation=dilation,
                           output_padding=output_padding)


def _depthwise_ones(functions, x, kernel_size, **per_axis) -> torch.Tensor:
    """``functions[ndim]`` (torch's conv or transposed conv) of ``x`` with a depthwise ones kernel."""
    ndim = x.dim() - 2
    channels = x.shape[1]
    ones = torch.ones((channels, 1, *as_tuple(kernel_size, ndim)), dtype=DTYPE)
    return functions[ndim](x, ones, None, groups=channels,
                           **{name: as_tuple(value, ndim) for name, value in per_axis.items()})


def subm_padding(kernel_size, dilation, ndim) -> tuple[int, ...]:
    """``dilation * (k - 1) / 2`` per axis: the padding that keeps a subm layer's shape."""
    k = as_tuple(kernel_size, ndim)
    d = as_tuple(dilation, ndim)
    return tuple(dd * (kk - 1) // 2 for kk, dd in zip(k, d))


# ------------------------------------------------------------------ output sites


def regular_sites(indices, spatial_shape, batch_size, kernel_size, stride, padding, dilation) -> np.ndarray:
    """Dense output positions with an active input in their receptive field."""
    mask = occupancy(indices, spatial_shape, batch_size)
    return sites_of(dense_window_sum(mask, kernel_size, stride, padding, dilation))


def transposed_sites(indices, spatial_shape, batch_size, kernel_size, stride, padding, dilation, output_padding):
    """Dense positions a transposed conv of the occupancy with ones reaches."""
    mask = occupancy(indices, spatial_shape, batch_size)
    return sites_of(dense_window_sum_transpose(mask, kernel_size, stride, padding, dilation, output_padding))


# ----------------------------------------------------------------- grad oracles


@dataclasses.dataclass
class Oracle:
    """Expected values (and gradients) of one dense computation at sparse sites."""

    values: np.ndarray
    grad_features: np.ndarray | None = None
    grad_weight: np.ndarray | None = None
    grad_bias: np.ndarray | None = None


def evaluate(
    dense_fn: Callable[..., torch.Tensor],
    features: np.ndarray,
    out_indices: np.ndarray,
    weight: np.ndarray | None = None,
    bias: np.ndarray | None = None,
    grad_output: np.ndarray | None = None,
) -> Oracle:
    """Runs ``dense_fn(features_t[, weight_t[, bias_t]])`` in float64 and reads it at sites.

    Args:
        dense_fn: builds the dense output ``[B, C, *spatial]`` from float64 leaf
            tensors (the sparse features, the sparsecore-layout weight, the bias).
        features: ``[N, C]`` sparse input features.
        out_indices: sites to read the output at.
        weight, bias: optional parameters passed on to ``dense_fn``.
        grad_output: ``G`` of the loss ``sum(out[sites] * G)``; gradients are
            computed when given.
    """
    return _evaluate_rows(lambda *leaves: read_sites(dense_fn(*leaves), out_indices), features, weight, bias,
                          grad_output)


def _evaluate_rows(rows_fn, features, weight, bias, grad_output) -> Oracle:
    """``rows_fn(features_t[, weight_t][, bias_t])`` on float64 leaves; with ``grad_output``, the gradients of
    ``sum(rows * grad_output)`` with respect to each leaf."""
    want_grad = grad_output is not None
    feats = to_torch(features, want_grad)
    parameters = [None if value is None else to_torch(value, want_grad) for value in (weight, bias)]
    values = rows_fn(feats, *[leaf for leaf in parameters if leaf is not None])
    result = Oracle(values=values.detach().numpy().copy())
    if want_grad:
        loss = (values * to_torch(grad_output)).sum()
        if loss.requires_grad:
            loss.backward()
        result.grad_features = _grad(feats)
        result.grad_weight, result.grad_bias = (None if leaf is None else _grad(leaf) for leaf in parameters)
    return result


def _grad(t: torch.Tensor) -> np.ndarray:
    return np.zeros(tuple(t.shape)) if t.grad is None else t.grad.numpy().copy()


# ------------------------------------------------------------- naive reference


@dataclasses.dataclass
class NaiveRulebook:
    """Pairs found by brute force: ``pairs[k] = (input_rows, output_rows)``."""

    output_indices: np.ndarray
    output_spatial_shape: tuple[int, ...]
    pairs: list[tuple[np.ndarray, np.ndarray]]


def output_shape(kind, spatial_shape, kernel_size, stride=1, padding=0, dilation=1, output_padding=0):
    """The dense (PyTorch) output shape formulas, written out per axis."""
    ndim = len(spatial_shape)
    k, s, p, d, op = (as_tuple(v, ndim) for v in (kernel_size, stride, padding, dilation, output_padding))
    if kind == "subm":
        return tuple(spatial_shape)
    if kind == "regular":
        return tuple((n + 2 * p[a] - d[a] * (k[a] - 1) - 1) // s[a] + 1 for a, n in enumerate(spatial_shape))
    if kind == "transposed":
        return tuple((n - 1) * s[a] - 2 * p[a] + d[a] * (k[a] - 1) + op[a] + 1 for a, n in enumerate(spatial_shape))
    raise ValueError(kind)


def naive_rulebook(
    indices, spatial_shape, batch_size, kind, kernel_size, stride=1, padding=0, dilation=1, output_padding=0
) -> NaiveRulebook:
    """Brute-force pairs for ``kind`` in {"subm", "regular", "transposed"}, any D.

    Output sites of "regular"/"transposed" come sorted by (batch, coords); "subm"
    keeps the input rows. Padding of "subm" is ``dilation * (k - 1) / 2``.
    """
    ndim = len(spatial_shape)
    k, s, p, d = (as_tuple(v, ndim) for v in (kernel_size, stride, padding, dilation))
    out_shape = output_shape(kind, spatial_shape, k, s, p, d, output_padding)
    offsets = list(itertools.product(*[range(kk) for kk in k]))
    rows = [tuple(r) for r in np.asarray(indices).tolist()]
    raw: list[list[tuple[int, tuple[int, ...]]]] = [[] for _ in offsets]
    if kind == "subm":
        half = subm_padding(k, d, ndim)
        where = {r: i for i, r in enumerate(rows)}
        for kk, off in enumerate(offsets):
            for o, r in enumerate(rows):
                pos = (r[0],) + tuple(r[1 + a] - half[a] + off[a] * d[a] for a in range(ndim))
                i = where.get(pos)
                if i is not None:
                    raw[kk].append((i, r))
        out_rows = rows
    else:
        for kk, off in enumerate(offsets):
            for i, r in enumerate(rows):
                q = []
                for a in range(ndim):
                    if kind == "regular":
                        num = r[1 + a] + p[a] - off[a] * d[a]
                        if num < 0 or num % s[a]:
                            break
                        qa = num // s[a]
                    else:
                        qa = r[1 + a] * s[a] - p[a] + off[a] * d[a]
                    if not 0 <= qa < out_shape[a]:
                        break
                    q.append(qa)
                else:
                    raw[kk].append((i, (r[0],) + tuple(q)))
        out_rows = sorted({site for per in raw for _, site in per})
    where_out = {r: o for o, r in enumerate(out_rows)}
    pairs = []
    for per in raw:
        ins = np.array([i for i, _ in per], dtype=np.int64)
        outs = np.array([where_out[site] for _, site in per], dtype=np.int64)
        pairs.append((ins, outs))
    out_idx = np.array(out_rows, dtype=np.int32).reshape(len(out_rows), 1 + ndim)
    return NaiveRulebook(out_idx, out_shape, pairs)


def naive_conv(features: torch.Tensor, weight: torch.Tensor, rb: NaiveRulebook, groups: int = 1, bias=None):
    """``out[o] += x[i] @ W[:, k, :].T`` over the naive pairs (grouped), in torch."""
    out_channels = weight.shape[0]
    in_per_group = weight.shape[-1]
    w = weight.reshape(out_channels, -1, in_per_group)
    out = torch.zeros((rb.output_indices.shape[0], out_channels), dtype=DTYPE)
    for kk, (ins, outs) in enumerate(rb.pairs):
        if ins.size == 0:
            continue
        x = features[torch.as_tensor(ins)].reshape(-1, groups, in_per_group)
        wk = w[:, kk, :].reshape(groups, out_channels // groups, in_per_group)
        y = torch.einsum("pgi,goi->pgo", x, wk).reshape(-1, out_channels)
        out = out.index_add(0, torch.as_tensor(outs), y)
    if bias is not None:
        out = out + bias
    return out


def _gather_pairs(rb: NaiveRulebook) -> tuple[torch.Tensor, torch.Tensor]:
    ins = [i for i, _ in rb.pairs if i.size]
    outs = [o for _, o in rb.pairs if o.size]
    if not ins:
        return torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long)
    return torch.as_tensor(np.concatenate(ins)), torch.as_tensor(np.concatenate(outs))


def naive_max_pool(features: torch.Tensor, rb: NaiveRulebook) -> torch.Tensor:
    """Max over the active inputs paired with each output."""
    ins, outs = _gather_pairs(rb)
    n_out = rb.output_indices.shape[0]
    base = torch.full((n_out, features.shape[1]), -math.inf, dtype=DTYPE)
    index = outs[:, None].expand(-1, features.shape[1])
    return base.scatter_reduce(0, index, features[ins], reduce="amax", include_self=False)


def naive_avg_pool(features: torch.Tensor, rb: NaiveRulebook) -> torch.Tensor:
    """Mean over the active inputs paired with each output."""
    ins, outs = _gather_pairs(rb)
    n_out = rb.output_indices.shape[0]
    total = torch.zeros((n_out, features.shape[1]), dtype=DTYPE).index_add(0, outs, features[ins])
    count = torch.zeros(n_out, dtype=DTYPE).index_add(0, outs, torch.ones(outs.shape[0], dtype=DTYPE))
    return total / count[:, None]


def evaluate_sparse(fn, features, weight=None, grad_output=None) -> Oracle:
    """Like `evaluate` for a function that returns sparse rows directly (naive path)."""
    return _evaluate_rows(fn, features, weight, None, grad_output)


# ---------------------------------------------------------------- case sampling


@dataclasses.dataclass(frozen=True)
class ConvCase:
    """One sampled layer configuration and input (everything a test needs)."""

    seed: int
    kind: str
    ndim: int
    kernel_size: tuple[int, ...]
    stride: tuple[int, ...]
    padding: tuple[int, ...]
    dilation: tuple[int, ...]
    output_padding: tuple[int, ...]
    groups: int
    in_channels: int
    out_channels: int
    batch_size: int
    spatial_shape: tuple[int, ...]
    density: float

    def __str__(self) -> str:
        def fmt(t):
            return "x".join(map(str, t))

        parts = [
            f"s{self.seed}", f"{self.ndim}d", f"k{fmt(self.kernel_size)}", f"st{fmt(self.stride)}",
            f"p{fmt(self.padding)}", f"d{fmt(self.dilation)}",
        ]
        if any(self.output_padding):
            parts.append(f"op{fmt(self.output_padding)}")
        parts += [f"g{self.groups}", f"c{self.in_channels}-{self.out_channels}", f"b{self.batch_size}",
                  f"sh{fmt(self.spatial_shape)}"]
        return "-".join(parts)

    def rng(self) -> np.random.Generator:
        """The generator of this case's data (separate from the config stream)."""
        return make_rng(self.seed, 7919)

    def inputs(self, dtype=np.float64):
        """``(features, indices, weight)`` for this case."""
        rng = self.rng()
        empty = ()
        if self.batch_size > 1 and self.seed % 5 == 0:
            empty = (int(rng.integers(self.batch_size)),)  # an empty batch element
        indices = random_indices(rng, self.spatial_shape, self.batch_size, self.density, empty_batches=empty)
        features = random_features(rng, indices.shape[0], self.in_channels, dtype)
        weight = random_weight(rng, self.out_channels, self.kernel_size, self.in_channels // self.groups, dtype)
        return features, indices, weight


_MIN_SIZE = {1: 6, 2: 4, 3: 3, 4: 2}
_MAX_EXTRA = {1: 14, 2: 6, 3: 3, 4: 2}


def _per_axis(rng, ndim, low, high, isotropic_prob=0.6, choices=None):
    pick = (lambda: int(rng.choice(choices))) if choices is not None else (lambda: int(rng.integers(low, high + 1)))
    if rng.random() < isotropic_prob:
        return (pick(),) * ndim
    return tuple(pick() for _ in range(ndim))


def sample_case(
    seed: int,
    kind: str,
    ndim: int,
    grouped: bool = True,
    max_kernel: int = 5,
    max_stride: int = 3,
    max_padding: int = 2,
    max_dilation: int = 3,
) -> ConvCase:
    """A random valid configuration of ``kind`` ("regular", "subm", "transposed")."""
    rng = make_rng(seed, ndim, len(kind))
    if kind == "subm":
        kernel = _per_axis(rng, ndim, 1, 5, choices=[k for k in (1, 3, 5) if k <= max_kernel])
        stride = (1,) * ndim
        padding = (0,) * ndim
    else:
        kernel = _per_axis(rng, ndim, 1, max_kernel)
        stride = _per_axis(rng, ndim, 1, max_stride)
        padding = _per_axis(rng, ndim, 0, max_padding)
    if ndim >= 3:  # keep the dense volume small
        max_dilation = min(max_dilation, 2)
    dilation = _per_axis(rng, ndim, 1, max_dilation, isotropic_prob=0.7)
    output_padding = (0,) * ndim
    if kind == "transposed":
        output_padding = tuple(int(rng.integers(0, max(s, d))) for s, d in zip(stride, dilation))
    shape = []
    for a in range(ndim):
        extent = dilation[a] * (kernel[a] - 1) + 1
        low = max(1, extent - 2 * padding[a]) if kind == "regular" else 1
        if kind == "transposed":
            # output extent (n-1)s - 2p + d(k-1) + op + 1 must be >= 1
            n = 1
            while (n - 1) * stride[a] - 2 * padding[a] + extent + output_padding[a] < 1:
                n += 1
            low = n
        low = max(low, _MIN_SIZE[ndim])
        shape.append(int(rng.integers(low, low + _MAX_EXTRA[ndim] + 1)))
    groups, cin, cout = 1, int(rng.integers(1, 4)), int(rng.integers(1, 4))
    if grouped:
        mode = rng.random()
        if mode < 0.2:  # depthwise (optionally with a channel multiplier)
            groups = int(rng.integers(2, 4))
            cin, cout = groups, groups * int(rng.integers(1, 3))
        elif mode < 0.45:
            groups = int(rng.integers(2, 4))
            cin, cout = groups * int(rng.integers(1, 3)), groups * int(rng.integers(1, 3))
    density = float(rng.choice([rng.uniform(0.05, 0.2), rng.uniform(0.2, 0.8)]))
    return ConvCase(
        seed=seed, kind=kind, ndim=ndim, kernel_size=kernel, stride=stride, padding=padding,
        dilation=dilation, output_padding=output_padding, groups=groups, in_channels=cin,
        out_channels=cout, batch_size=int(rng.integers(1, 4)), spatial_shape=tuple(shape),
        density=density,
    )


def sample_cases(kind: str, count: int, ndims=(1, 2, 3), base_seed: int = 0, **kwargs) -> list[ConvCase]:
    """``count`` cases cycling through ``ndims``."""
    return [sample_case(base_seed + i, kind, ndims[i % len(ndims)], **kwargs) for i in range(count)]


def assert_close(actual, expected, what: str, rtol: float = 1e-9, atol: float = 1e-9) -> None:
    """`np.testing.assert_allclose` on float64 copies with a labelled message."""
    actual = np.asarray(actual)
    expected = np.asarray(expected)
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape}, expected {expected.shape}"
    np.testing.assert_allclose(actual.astype(np.float64), expected.astype(np.float64), rtol=rtol, atol=atol,
                               err_msg=what)


def assert_sites(actual, expected, what: str = "output indices") -> None:
    """Exact equality of two site lists, in order."""
    actual = np.asarray(actual)
    expected = np.asarray(expected)
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape}, expected {expected.shape}"
    if actual.size:
        bad = np.nonzero((actual != expected).any(axis=1))[0]
        assert bad.size == 0, (
            f"{what}: {bad.size} rows differ; first at row {bad[0]}: got {actual[bad[0]].tolist()}, "
            f"expected {expected[bad[0]].tolist()}"
        )


# ------------------------------------------------------------ pooling oracles (core and torch tests)

def pool_padding(case):
    """Dense padding of a pooling case (a subm window is centred)."""
    return subm_padding(case.kernel_size, case.dilation, case.ndim) if case.kind == "subm" else case.padding


def pool_sites(case, indices):
    """Expected output sites of a pooling case."""
    if case.kind == "subm":
        return indices
    return regular_sites(indices, case.spatial_shape, case.batch_size, case.kernel_size, case.stride,
                         case.padding, case.dilation)


def max_pool_oracle(case, indices):
    """Dense max over active sites only (inactive cells are -inf)."""
    def fn(feats):
        x = densify(feats, indices, case.spatial_shape, case.batch_size, fill=-math.inf)
        return dense_max_pool(x, case.kernel_size, case.stride, pool_padding(case), case.dilation)

    return fn


def avg_pool_oracle(case, indices):
    """Dense window sum divided by the active count in the window."""
    mask = occupancy(indices, case.spatial_shape, case.batch_size)
    count = dense_window_sum(mask, case.kernel_size, case.stride, pool_padding(case), case.dilation)

    def fn(feats):
        x = densify(feats, indices, case.spatial_shape, case.batch_size)
        total = dense_window_sum(x, case.kernel_size, case.stride, pool_padding(case), case.dilation)
        return total / count.clamp(min=1.0)

    return fn
