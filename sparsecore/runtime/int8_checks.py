"""The int8 dynamic ranges of a libspconv graph, checked when the file is loaded.

A dynamic range is a tensor's absolute maximum; libspconv's scale is
``float32(range) / 127`` (`sparsecore.runtime.quantized.range_scale`). A range
that is finite and positive can still describe nothing a file could mean, and
the run would then saturate or vanish without a word. Refused, naming the node
and the attribute:

- an activation range (``input_dynamic_range``, ``input0_dynamic_range``,
  ``input1_dynamic_range``) whose scale is not a normal float32, or that no
  FP16 tensor has (libspconv's float tensors are FP16): above 65504, or a step
  (``range / 127``) below FP16's smallest, 2**-24;
- a weight range (``weight_dynamic_ranges[c]``) whose scale is not a normal
  float32, or that does not describe its channel's FP16 weights: a weight
  beyond ``128.5`` steps (more than half a step past int8's end: the range is
  smaller than the weights, which would saturate; `sparsecore.torch.export_onnx`
  writes the channel's largest magnitude, torch's rule gives 127.5 steps), or a
  channel with nonzero weights whose largest weight is below `MIN_WEIGHT_STEPS`
  steps (the range more than 16 times its largest weight: most of the channel's
  weights would round to zero);
- an int8 conv whose input scale times a weight scale (the first factor of its
  float32 epilogue) is not a normal float32.

Nothing here imports torch or jax.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from .nodes import AddNode, ConvNode, GraphError, Node, ScatterDenseNode

__all__ = ["FP16_MAX", "FP16_SMALLEST_STEP", "MAX_WEIGHT_STEPS", "MIN_WEIGHT_STEPS", "check_int8_ranges"]

FP16_MAX = 65504.0
"""The largest FP16 value: no FP16 activation has a larger absolute maximum."""

FP16_SMALLEST_STEP = 2.0**-24
"""FP16's smallest (subnormal) step: an int8 step below it quantizes no FP16 tensor."""

MAX_WEIGHT_STEPS = 128.5
"""The most steps (``|w| / scale``) a weight may span: int8's 127, plus torch's 127.5 rule, plus FP16 rounding."""

MIN_WEIGHT_STEPS = 127.0 / 16
"""The fewest steps the largest weight of a channel with nonzero weights must span (range <= 16 x max |w|)."""

_TINY = float(np.finfo(np.float32).tiny)


def _scale(dynamic_range: float) -> float:
    return float(np.float32(dynamic_range) / np.float32(127))


def _check_activation(where: str, attribute: str, dynamic_range: float) -> None:
    if dynamic_range == 0:  # read as float (an Add's float input): nothing to check
        return
    scale = _scale(dynamic_range)
    if not _TINY <= scale < np.inf:
        raise GraphError(f"{where}: {attribute}={dynamic_range:.6g} gives the scale {scale:.6g} (range / 127 in "
                         "float32), which is not a normal float32 number; a dynamic range must be a tensor's "
                         "absolute maximum, e.g. 4.5")
    if dynamic_range > FP16_MAX or scale < FP16_SMALLEST_STEP:
        raise GraphError(f"{where}: {attribute}={dynamic_range:.6g} describes no FP16 tensor (libspconv's float "
                         f"tensors are FP16: an absolute maximum of at most {FP16_MAX:g}, and an int8 step "
                         f"range / 127 of at least 2**-24); the values read with it would all saturate or vanish")


def _check_weights(where: str, node: ConvNode) -> None:
    ranges = np.asarray(node.weight_dynamic_ranges, dtype=np.float32)
    scales = ranges / np.float32(127)
    for channel, (dynamic_range, scale) in enumerate(zip(ranges.tolist(), scales.tolist())):
        if not _TINY <= scale < np.inf:
            raise GraphError(f"{where}: weight_dynamic_ranges[{channel}]={dynamic_range:.6g} gives the scale "
                             f"{scale:.6g} (range / 127 in float32), which is not a normal float32 number")
    largest = np.abs(node.weight.astype(np.float32)).reshape(node.weight.shape[0], -1).max(axis=1)
    steps = largest.astype(np.float64) / scales.astype(np.float64)
    for channel in range(len(steps)):
        if steps[channel] > MAX_WEIGHT_STEPS:
            raise GraphError(
                f"{where}: weight_dynamic_ranges[{channel}]={float(ranges[channel]):.6g} is smaller than the channel's "
                f"largest weight {float(largest[channel]):.6g} ({steps[channel]:.4g} int8 steps; at most 127 fit), so "
                "its weights would saturate; the range must be the channel's largest weight magnitude")
        if largest[channel] > 0 and steps[channel] < MIN_WEIGHT_STEPS:
            raise GraphError(
                f"{where}: weight_dynamic_ranges[{channel}]={float(ranges[channel]):.6g} is more than 16 times the "
                f"channel's largest weight {float(largest[channel]):.6g} (it spans {steps[channel]:.3g} of 127 int8 "
                "steps), so its weights would round to zero; the range must be the channel's largest weight "
                "magnitude")


def _check_epilogue(where: str, node: ConvNode) -> None:
    input_scale = np.float32(node.input_dynamic_range) / np.float32(127)
    scales = np.asarray(node.weight_dynamic_ranges, dtype=np.float32) / np.float32(127)
    products = input_scale * scales
    if products.size and not (products >= _TINY).all():
        channel = int(np.argmin(products))
        raise GraphError(f"{where}: input_dynamic_range={node.input_dynamic_range:.6g} and weight_dynamic_ranges"
                         f"[{channel}]={float(node.weight_dynamic_ranges[channel]):.6g} multiply to the scale "
                         f"{float(products[channel]):.6g}, below float32's normal range: the layer's outputs would "
                         "vanish")


def check_int8_ranges(nodes: Sequence[Node], wheres: Sequence[str]) -> None:
    """Checks every int8 node's dynamic ranges (see the module docstring).

    Ranges absent where int8 needs them (an int8 conv without an input range, a weight range per
    channel missing) are `sparsecore.runtime.quantized.tensor_scales`' errors; this checks the
    values that are there.

    Raises:
        GraphError: naming the node and the attribute.
    """
    for node, where in zip(nodes, wheres):
        if isinstance(node, ConvNode) and "int8" in (node.precision, node.output_precision):
            if node.input_dynamic_range > 0:
                _check_activation(where, "input_dynamic_range", node.input_dynamic_range)
            if len(node.weight_dynamic_ranges) == node.out_channels and all(
                    value > 0 for value in node.weight_dynamic_ranges):
                _check_weights(where, node)
                if node.input_dynamic_range > 0:
                    _check_epilogue(where, node)
        elif isinstance(node, AddNode):
            for position, dynamic_range in enumerate(node.input_dynamic_ranges):
                _check_activation(where, f"input{position}_dynamic_range", dynamic_range)
        elif isinstance(node, ScatterDenseNode):
            _check_activation(where, "input_dynamic_range", node.input_dynamic_range)
