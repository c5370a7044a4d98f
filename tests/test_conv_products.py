"""`sparsecore._conv_products`: the chunk layouts kept per rulebook and the split weight-gradient product.

The layouts are checked on the kernel backend (the CPU emulation of the GPU
kernels, and CuPy where a GPU is present): built once per rulebook and pass
direction, and the products they feed equal the NumPy backend's (float64),
itself checked against the dense convolution in ``test_conv``.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import sparsecore as sc
from sparsecore import _conv_products, conv
from sparsecore.backends import NUMPY_BACKEND

try:
    from kernel_targets import random_sites, rng_for, target  # noqa: F401
except ImportError:  # tests/ imported as a package
    from tests.kernel_targets import random_sites, rng_for, target  # noqa: F401


def _layer(target, count: int, in_channels: int, out_channels: int, groups: int = 1, seed: int = 0):
    rng = rng_for(71, count, in_channels, out_channels, groups, seed)
    shape = (9, 10, 11)
    indices = random_sites(rng, count, shape, 1)
    geometry = sc.ConvGeometry.create(3, 3, kind="subm")
    expected_rb = sc.build_rulebook(indices, shape, 1, geometry, backend=NUMPY_BACKEND)
    actual_rb = sc.build_rulebook(target.put(indices), shape, 1, geometry, backend=target.backend)
    features = rng.standard_normal((count, in_channels))
    weight = rng.standard_normal((out_channels, 3, 3, 3, in_channels // groups))
    grad_output = rng.standard_normal((count, out_channels))
    return expected_rb, actual_rb, features, weight, grad_output


def _layouts(rulebook) -> dict:
    return {key: value for key, value in rulebook.pair_map.derived.items() if key[0] == "chunk layout"}


@pytest.mark.parametrize("groups", [1, 2])
def test_split_weight_gradient_equals_the_unsplit_one(target, monkeypatch, groups):
    # long reductions split into many short ones: same gradients as the NumPy backend (float64)
    expected_rb, actual_rb, features, weight, grad_output = _layer(target, 300, 4, 6, groups)
    expected = conv.conv_backward(grad_output, features, weight, expected_rb, groups, backend=NUMPY_BACKEND)
    monkeypatch.setattr(_conv_products, "OUTER_SPLIT_MIN_WIDTH", 8)
    monkeypatch.setattr(_conv_products, "OUTER_SPLIT_ROWS", 4)
    actual = conv.conv_backward(target.put(grad_output), target.put(features), target.put(weight), actual_rb, groups,
                                backend=target.backend)
    splits = [layout.outer_split for key, layout in _layouts(actual_rb).items() if key[3] == "backward"]
    assert splits and all(split > 1 for split in splits), splits
    assert all(layout.width % 4 == 0 for layout in _layouts(actual_rb).values())
    for got, want in zip(actual, expected):
        np.testing.assert_allclose(target.get(got), want, rtol=1e-12, atol=1e-12)


def test_float16_weight_gradients_are_not_split(target, monkeypatch):
    # partial products would round to float16 before their sum: 16-bit passes keep one reduction
    # (the GPU backend multiplies float16 as float16; the emulated one is told to as well)
    backend = dataclasses.replace(target.backend, native_float16=True)
    expected_rb, actual_rb, features, weight, grad_output = _layer(target, 120, 4, 4)
    monkeypatch.setattr(_conv_products, "OUTER_SPLIT_MIN_WIDTH", 8)
    monkeypatch.setattr(_conv_products, "OUTER_SPLIT_ROWS", 4)
    half = [array.astype(np.float16) for array in (grad_output, features, weight)]
    actual = conv.conv_backward(*(target.put(array) for array in half), actual_rb, backend=backend)
    assert {layout.outer_split for layout in _layouts(actual_rb).values()} == {1}
    expected = conv.conv_backward(*(array.astype(np.float64) for array in half), expected_rb, backend=NUMPY_BACKEND)
    for got, want in zip(actual, expected):
        np.testing.assert_allclose(target.get(got).astype(np.float64), want, rtol=2e-2, atol=2e-2 * np.abs(want).max())


def test_layouts_are_built_once_per_rulebook_and_direction(target, monkeypatch):
    expected_rb, actual_rb, features, weight, grad_output = _layer(target, 200, 3, 5, seed=1)
    built = []
    for name in ("scatter_plan", "padded_chunk_layout"):  # a layout is built by one or the other
        method = getattr(type(target.backend), name)

        def counted(self, *args, method=method):
            built.append(args[-1])
            return method(self, *args)

        monkeypatch.setattr(type(target.backend), name, counted)
    device_args = (target.put(features), target.put(weight), actual_rb)
    outputs = [target.get(conv.conv_forward(*device_args, backend=target.backend)) for _ in range(3)]
    forward_plans = len(built)
    grads = [conv.conv_backward(target.put(grad_output), *device_args, backend=target.backend) for _ in range(3)]
    chunks = _conv_products.offset_chunks(target.backend, actual_rb, 3, 5)
    assert forward_plans == len(chunks) and len(built) == 2 * len(chunks), built
    expected = conv.conv_forward(features, weight, expected_rb, backend=NUMPY_BACKEND)
    expected_grads = conv.conv_backward(grad_output, features, weight, expected_rb, backend=NUMPY_BACKEND)
    for output in outputs:
        np.testing.assert_allclose(output, expected, rtol=1e-12, atol=1e-12)
    for pair in grads:
        for got, want in zip(pair, expected_grads):
            np.testing.assert_allclose(target.get(got), want, rtol=1e-12, atol=1e-12)


def test_chunk_layout_rejects_a_bad_direction(target):
    _, actual_rb, *_ = _layer(target, 20, 2, 2)
    chunk = _conv_products.offset_chunks(target.backend, actual_rb, 2, 2)[0]
    with pytest.raises(ValueError, match="direction must be 'forward' or 'backward', got 'sideways'"):
        _conv_products.chunk_layout(target.backend, actual_rb, chunk, "sideways", np.float64)


def test_batched_outer_split_must_divide_the_width():
    left = np.ones((2, 6, 3))
    with pytest.raises(ValueError, match="split 4 must divide the width 6"):
        _conv_products.batched_outer(NUMPY_BACKEND, left, left, 1, split=4)
