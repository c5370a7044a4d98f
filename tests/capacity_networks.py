"""A small network with every layer kind, run through the core (forward with its builds, then backward), in
exact mode or capacity mode: the shared body of the capacity tests (tests/test_capacity.py and the frontends').

Layers (any of 1-4 spatial axes): a grouped submanifold conv, a strided conv (padding 1), a max pool, a
dilated submanifold conv, the inverse of the pool, an average pool of stride 1, a transposed conv.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

import sparsecore as sc


@dataclass(frozen=True)
class Step:
    """One layer: ``kind`` is ``"subm"``, ``"regular"``, ``"transposed"``, ``"inverse"``, ``"max"`` or ``"avg"``."""

    kind: str
    kernel: int
    stride: int = 1
    padding: int = 0
    dilation: int = 1
    groups: int = 1
    key: str | None = None


STEPS = (Step("subm", 3, groups=2, key="s0"), Step("regular", 3, 2, 1, key="d0"), Step("max", 2, 2, key="p0"),
         Step("subm", 3, dilation=2), Step("inverse", 2, key="p0"), Step("avg", 2, 1),
         Step("transposed", 2, 2))
CHANNELS = 4


def geometry(step: Step, ndim: int) -> sc.ConvGeometry:
    if step.kind == "inverse":
        return sc.ConvGeometry("inverse", (step.kernel,) * ndim, (1,) * ndim, (0,) * ndim, (1,) * ndim, (0,) * ndim)
    kind = {"max": "regular", "avg": "regular"}.get(step.kind, step.kind)
    return sc.ConvGeometry.create(ndim, step.kernel, step.stride, step.padding, step.dilation, kind=kind)


def parameters(ndim: int, seed: int) -> list[tuple[Any, Any] | None]:
    """Float32 ``(weight, bias)`` per conv step (None for the pools), from a seeded generator."""
    rng = np.random.default_rng(seed)
    made = []
    for step in STEPS:
        if step.kind in ("max", "avg"):
            made.append(None)
            continue
        shape = (CHANNELS,) + (step.kernel,) * ndim + (CHANNELS // step.groups,)
        made.append((rng.uniform(-1, 1, shape).astype(np.float32), rng.uniform(-1, 1, CHANNELS).astype(np.float32)))
    return made


@dataclass
class Run:
    """A forward's output and what the backward needs."""

    output: Any
    output_indices: Any
    tensor: sc.SparseTensor
    saved: list


def forward(features: Any, indices: Any, shape: tuple[int, ...], batch: int, params: list, capacity: Any = None,
            put: Callable[[Any], Any] = lambda array: array) -> Run:
    """The network's forward in exact mode (``capacity=None``) or capacity mode."""
    x = sc.SparseTensor(put(features), put(indices), shape, batch, capacity=capacity)
    saved = []
    ndim = len(shape)
    for step, weights in zip(STEPS, params):
        rulebook = sc.layer_rulebook(x, geometry(step, ndim), step.key)
        argmax = None
        if weights is not None:
            out = sc.conv_forward(x.core_features, put(weights[0]), rulebook, put(weights[1]), step.groups)
        elif step.kind == "max":
            out, argmax = sc.max_pool_forward(x.core_features, rulebook)
        else:
            out = sc.avg_pool_forward(x.core_features, rulebook)
        saved.append((step, rulebook, x.core_features, argmax))
        if rulebook.output_indices is x.core_indices:
            x = x.replace(out)
        else:
            x = x.with_sites(out, rulebook.output_indices, rulebook.output_spatial_shape,
                             core_indices=rulebook.output_indices)
    return Run(x.core_features, x.core_indices, x, saved)


def backward(run: Run, grad: Any, params: list, put: Callable[[Any], Any] = lambda array: array) -> tuple:
    """``(grad of the input features, [weight grads])`` through the saved layers."""
    weight_grads: list[Any] = [None] * len(STEPS)
    for position in range(len(STEPS) - 1, -1, -1):
        step, rulebook, inputs, argmax = run.saved[position]
        if params[position] is not None:
            grad, weight_grads[position] = sc.conv_backward(grad, inputs, put(params[position][0]), rulebook,
                                                            step.groups)
        elif step.kind == "max":
            grad = sc.max_pool_backward(grad, argmax, rulebook.num_input, rulebook=rulebook)
        else:
            grad = sc.avg_pool_backward(grad, rulebook)
    return grad, weight_grads


def rulebooks(run: Run) -> list:
    return [rulebook for _, rulebook, _, _ in run.saved]
