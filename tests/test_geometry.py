"""Tests of `ConvGeometry`: normalisation, hashing, validation and output shapes.

Output shapes are checked against torch's own shape inference (meta tensors
through ``conv{1,2,3}d`` / ``conv_transpose{1,2,3}d``) over many seeded
combinations, and against the written-out formulas in 4D.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import sparsecore as sc

try:
    from . import dense_oracle as do
except ImportError:
    import dense_oracle as do

_CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
_CONV_T = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}


def _random_combo(seed):
    rng = do.make_rng(seed, 42)
    ndim = int(rng.integers(1, 4))
    pick = lambda lo, hi: tuple(int(v) for v in rng.integers(lo, hi + 1, size=ndim))  # noqa: E731
    kernel, stride, padding, dilation = pick(1, 5), pick(1, 3), pick(0, 2), pick(1, 3)
    output_padding = tuple(int(rng.integers(0, max(s, d))) for s, d in zip(stride, dilation))
    shape = pick(1, 12)
    return ndim, kernel, stride, padding, dilation, output_padding, shape


def _torch_shape(transposed, kernel, stride, padding, dilation, output_padding, shape):
    ndim = len(shape)
    x = torch.empty((1, 1, *shape), device="meta")
    w = torch.empty((1, 1, *kernel), device="meta")
    try:
        if transposed:
            y = _CONV_T[ndim](x, w, stride=stride, padding=padding, output_padding=output_padding,
                              dilation=dilation)
        else:
            y = _CONV[ndim](x, w, stride=stride, padding=padding, dilation=dilation)
    except RuntimeError:
        return None
    out = tuple(y.shape[2:])
    return out if all(n >= 1 for n in out) else None


@pytest.mark.parametrize("seed", range(120))
def test_output_shape_matches_torch(seed):
    ndim, kernel, stride, padding, dilation, output_padding, shape = _random_combo(seed)
    for kind in ("regular", "transposed"):
        op = output_padding if kind == "transposed" else 0
        geom = sc.ConvGeometry.create(ndim, kernel, stride, padding, dilation, op, kind=kind)
        expected = _torch_shape(kind == "transposed", kernel, stride, padding, dilation,
                                do.as_tuple(op, ndim), shape)
        if expected is None:
            with pytest.raises(ValueError):
                geom.output_spatial_shape(shape)
        else:
            assert tuple(geom.output_spatial_shape(shape)) == expected, (kind, geom, shape)
    subm_kernel = tuple(k | 1 for k in kernel)
    subm = sc.ConvGeometry.create(ndim, subm_kernel, dilation=dilation, kind="subm")
    assert tuple(subm.output_spatial_shape(shape)) == shape


def test_output_shape_4d_formula():
    geom = sc.ConvGeometry.create(4, (3, 2, 1, 4), (2, 1, 3, 1), (1, 0, 2, 1), (1, 2, 1, 3))
    shape = (9, 5, 7, 12)
    assert tuple(geom.output_spatial_shape(shape)) == do.output_shape("regular", shape, (3, 2, 1, 4),
                                                                    (2, 1, 3, 1), (1, 0, 2, 1), (1, 2, 1, 3))
    geom_t = sc.ConvGeometry.create(4, (3, 2, 1, 4), (2, 1, 3, 1), (1, 0, 2, 1), (1, 2, 1, 3), (1, 0, 2, 2),
                                    kind="transposed")
    assert tuple(geom_t.output_spatial_shape(shape)) == do.output_shape(
        "transposed", shape, (3, 2, 1, 4), (2, 1, 3, 1), (1, 0, 2, 1), (1, 2, 1, 3), (1, 0, 2, 2))


def test_inverse_shape_raises():
    geom = sc.ConvGeometry.create(3, 3, stride=2, kind="inverse")
    with pytest.raises(ValueError):
        geom.output_spatial_shape((8, 8, 8))


def test_non_positive_output_shape_raises():
    geom = sc.ConvGeometry.create(2, 5)
    with pytest.raises(ValueError):
        geom.output_spatial_shape((3, 8))
    with pytest.raises(ValueError):
        sc.ConvGeometry.create(1, 1, padding=2, kind="transposed").output_spatial_shape((3,))


def test_frozen_and_hashable():
    a = sc.ConvGeometry.create(3, 3, stride=2, padding=1)
    b = sc.ConvGeometry.create(3, (3, 3, 3), stride=(2, 2, 2), padding=[1, 1, 1], dilation=(1, 1, 1))
    assert a == b and hash(a) == hash(b)
    assert len({a, b, sc.ConvGeometry.create(3, 3, stride=2, padding=0)}) == 2
    assert {a: "x"}[b] == "x"
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.stride = (1, 1, 1)
    assert a != sc.ConvGeometry.create(3, 3, stride=2, padding=1, kind="transposed")


def test_per_axis_normalisation():
    g = sc.ConvGeometry.create(3, (1, 3, 3), stride=(1, 2, 2), padding=(0, 1, 1), dilation=2)
    assert g.kernel_size == (1, 3, 3) and g.stride == (1, 2, 2) and g.padding == (0, 1, 1)
    assert g.dilation == (2, 2, 2) and g.output_padding == (0, 0, 0)
    assert g.ndim == 3 and g.kernel_volume == 9 and g.kind == "regular"
    for field in (g.kernel_size, g.stride, g.padding, g.dilation, g.output_padding):
        assert isinstance(field, tuple) and all(type(v) is int for v in field)
    g2 = sc.ConvGeometry.create(2, np.int64(3), stride=np.array([2, 1]))
    assert g2.kernel_size == (3, 3) and g2.stride == (2, 1)
    g1 = sc.ConvGeometry.create(1, 4, kind="transposed", stride=3, output_padding=2)
    assert g1.output_padding == (2,) and g1.kernel_volume == 4


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(kernel_size=(3, 3)), "kernel_size"),
        (dict(kernel_size=3, stride=(1, 2)), "stride"),
        (dict(kernel_size=3, padding=(1, 1, 1, 1)), "padding"),
        (dict(kernel_size=3, dilation=(1, 1)), "dilation"),
        (dict(kernel_size=3, output_padding=(1, 1), stride=2, kind="transposed"), "output_padding"),
        (dict(kernel_size=0), "kernel_size"),
        (dict(kernel_size=(3, -1, 3)), "kernel_size"),
        (dict(kernel_size=3, stride=0), "stride"),
        (dict(kernel_size=3, dilation=0), "dilation"),
        (dict(kernel_size=3, padding=-1), "padding"),
        (dict(kernel_size=3, output_padding=-1, kind="transposed"), "output_padding"),
        (dict(kernel_size=(3, 2, 3), kind="subm"), "kernel_size"),
        (dict(kernel_size=4, kind="subm"), "kernel_size"),
        (dict(kernel_size=3, kind="dense"), "kind"),
        (dict(kernel_size=3, stride=2, output_padding=2, kind="transposed"), "output_padding"),
    ],
    ids=["k-len", "s-len", "p-len", "d-len", "op-len", "k0", "k-neg", "s0", "d0", "p-neg", "op-neg",
         "subm-even-axis", "subm-even", "kind", "op-too-large"],
)
def test_invalid_geometry(kwargs, match):
    with pytest.raises(ValueError, match=match):
        sc.ConvGeometry.create(3, **kwargs)


def test_kernel_offsets_match_weight_flattening():
    """Offset k of the table is the k-th kernel position of weight.reshape(out, K, in)."""
    kernel = (2, 3, 4)
    geom = sc.ConvGeometry.create(3, kernel)
    offsets = geom.kernel_offsets()
    assert offsets.shape == (24, 3)
    weight = np.arange(24).reshape(1, *kernel, 1)
    flat = weight.reshape(1, -1, 1)
    for k, off in enumerate(offsets.tolist()):
        assert flat[0, k, 0] == weight[(0, *off, 0)]
