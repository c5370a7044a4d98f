"""spconv's benchmark mode: per-layer times in ``input.benchmark_record``, outside the layers' forward.

A `SparseConvTensor` made with ``benchmark=True`` asks every named sparse layer
it meets to record, as spconv's layers do, ``{"type", "indice_gen_time",
"time", "num_points", "num_out_points", "params"}`` under the layer's name.
The layers' forward (`sparsecore.torch.layer`) hands such an input here, with
its steps (`sparsecore.torch.layer.LayerSteps`), instead of running them itself: the timing, the
device synchronisations and the record live in this module alone, and a plain
forward never enters it. The rulebook and the feature pass run in one device
and stream context, as in the plain forward.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Optional

import torch

from ._convert import core_context

__all__ = ["recorded_forward", "start_benchmark"]


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _BenchmarkRecord:
    """Fills ``input.benchmark_record[name]`` like spconv's benchmark mode."""

    def __init__(self, entry: dict, device: torch.device) -> None:
        self.entry = entry
        self.device = device
        _synchronize(device)
        self.start = time.perf_counter()

    def indices_done(self) -> None:
        _synchronize(self.device)
        now = time.perf_counter()
        self.entry["indice_gen_time"].append(now - self.start)
        self.start = now

    def done(self, num_points: int, num_out_points: int) -> None:
        _synchronize(self.device)
        self.entry["time"].append(time.perf_counter() - self.start)
        self.entry["num_points"].append(int(num_points))
        self.entry["num_out_points"].append(int(num_out_points))


@torch.compiler.disable
def start_benchmark(module: Any, input: Any, kind: str, params: Callable[[], dict]) -> _BenchmarkRecord:
    """Starts timing one layer call in benchmark mode (``SparseConvTensor(..., benchmark=True)``).

    Raises:
        ValueError: for a layer without a name.
    """
    name = module.name
    if name is None:
        raise ValueError(
            "benchmark mode needs named sparse modules: pass name=... to the layers (or give them "
            "names with assign_name_for_sparse_modules and set .name)"
        )
    if name not in input.benchmark_record:
        input.benchmark_record[name] = {"type": kind, "indice_gen_time": [], "time": [], "num_points": [],
                                        "num_out_points": [], "params": params()}
    return _BenchmarkRecord(input.benchmark_record[name], input.features.device)


def recorded_forward(module: Any, input: Any, kind: str, steps: Any,
                     params: Optional[Callable[[], dict]] = None) -> Any:
    """Runs a layer's ``steps`` on ``input`` with spconv's benchmark record around them.

    Args:
        module: the (named) layer.
        input: the layer's input (``benchmark=True``).
        kind: the record's ``type`` ("SparseConvolution", "SparseMaxPool", ...).
        steps: the layer call, cut at the clock readings (a `sparsecore.torch.layer.LayerSteps`:
            ``check() -> device``, ``rulebook() -> (data, indice_dict)``, ``features(data)``,
            ``output(data, indice_dict, out_features)``).
        params: the record's ``params`` (default: the module's ``_benchmark_params()``).

    Returns:
        What ``steps.output`` returns.
    """
    device = steps.check()
    record = start_benchmark(module, input, kind, params if params is not None else module._benchmark_params)
    with core_context(device):
        data, indice_dict = steps.rulebook()
        record.indices_done()
        out_features = steps.features(data)
    record.done(input.features.shape[0], out_features.shape[0])
    return steps.output(data, indice_dict, out_features)
