"""``load(..., capture=True)``: a session's runs in capacity mode, recorded as one CUDA graph per capacity on CuPy.

Capacity mode (`sparsecore.capacity`) builds every rulebook at a capacity, with
no read back, so a whole run can be recorded once and replayed. `CapturedRuns`
holds, per input capacity (the input's rows rounded up on the session's
`sparsecore.buckets.Buckets` ladder), static input buffers and the recorded
graph:

1. the first run of a capacity runs eagerly in capacity mode on the padded
   input, and `sparsecore.check_capacity` teaches the session's
   `LearnedCapacity` every layer's count (one read);
2. the second run of that capacity records the run into a CUDA graph on a
   capture stream (CuPy's ``Stream.begin_capture`` / ``end_capture``);
3. every later run copies its input into the static buffers (padding rows of
   -1), replays the graph, and reads the counts once (`check_capacity`); a layer
   that overflowed is learned, its graph dropped, and the run repeated eagerly
   (the next run records again). The output's true rows are returned.

On NumPy (no GPU) the same steps run without a graph: capacity mode, the same
outputs on the true rows as exact mode. Nothing here imports cupy unless CuPy
arrays arrive.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from ..buckets import Buckets
from ..capacity import CapacityOverflowError, LearnedCapacity, check_capacity, true_rows
from ..interop import array_module, is_cupy_array
from ..tensor import SparseTensor

__all__ = ["CapturedRuns", "RecordedRun"]


@dataclass
class RecordedRun:
    """One capacity's static buffers and, once recorded, its CUDA graph and output.

    Attributes:
        features: float ``[capacity, C]`` static input features.
        indices: int32 ``[capacity, 1 + D]`` static input sites (padding rows -1).
        runs: runs of this capacity so far.
        graph: the recorded ``cupy.cuda.Graph``, or None.
        output: what the recorded run returned (its arrays are the graph's outputs).
    """

    features: Any
    indices: Any
    runs: int = 0
    graph: Any = None
    output: Any = None


@dataclass
class CapturedRuns:
    """A session's capacity-mode runs, recorded per input capacity (see the module docstring).

    Attributes:
        policy: the layers' capacity policy (learned from the runs).
        buckets: the ladder the input's rows are rounded up on.
        recorded: the `RecordedRun` of each input capacity (this session's state).
    """

    policy: LearnedCapacity = field(default_factory=LearnedCapacity)
    buckets: Buckets = field(default_factory=lambda: Buckets(minimum=256, steps_per_octave=4))
    recorded: dict = field(default_factory=dict)

    def _buffers(self, features: Any, indices: Any) -> RecordedRun:
        xp = array_module(features)
        rows = int(features.shape[0])
        capacity = self.buckets.round_up(rows)
        key = (capacity, str(features.dtype), int(features.shape[1]), int(indices.shape[1]))
        entry = self.recorded.get(key)
        if entry is None:
            entry = RecordedRun(xp.zeros((capacity, features.shape[1]), dtype=features.dtype),
                                xp.full((capacity, indices.shape[1]), -1, dtype=xp.int32))
            self.recorded[key] = entry
        entry.features[:rows] = features
        entry.features[rows:] = 0
        entry.indices[:rows] = indices
        entry.indices[rows:] = -1
        return entry

    def run(self, features: Any, indices: Any, batch_size: int, spatial_shape: Any,
            run_graph: Callable[[SparseTensor], Any]) -> Any:
        """One run of ``run_graph`` in capacity mode.

        Args:
            run_graph: the session's nodes on a `SparseTensor`: ``first -> (output, rulebooks)``, the rulebooks
                every layer used (their counts are read once after the run).

        Returns:
            The run's output; a sparse output cut to its true rows.
        """
        indices = indices.astype("int32", copy=False)
        entry = self._buffers(features, indices)

        def eager() -> Any:
            return run_graph(SparseTensor(entry.features, entry.indices, spatial_shape, batch_size,
                                          capacity=self.policy))

        entry.runs += 1
        if entry.graph is not None:
            entry.graph.launch()
            output, rulebooks = entry.output
        elif entry.runs >= 2 and is_cupy_array(features):
            entry.output, entry.graph = _record(eager)
            entry.graph.launch()
            output, rulebooks = entry.output
        else:
            output, rulebooks = eager()
        try:
            check_capacity(rulebooks, self.policy)  # the run's one read: every layer's count
        except CapacityOverflowError:  # learned now: run again eagerly, record at the next run
            entry.graph, entry.output, entry.runs = None, None, 0
            output, rulebooks = eager()
            check_capacity(rulebooks, self.policy)
        return _true_rows(output)


def _sparse(output: Any) -> Any:
    return getattr(output, "sparse", None)


def _true_rows(output: Any) -> Any:
    """A copy of the output (a recorded graph's next replay overwrites its arrays): a sparse output cut to its
    true rows (one read of the count), a dense one whole."""
    tensor = _sparse(output)
    if tensor is None:
        return type(output)(output.dense.copy(), None)
    rows = true_rows(tensor.core_indices)
    cut = SparseTensor(tensor.core_features[:rows].copy(), tensor.core_indices[:rows].copy(), tensor.spatial_shape,
                       tensor.batch_size, _checked=True)
    return type(output)(output.dense, cut)


def _record(eager: Callable[[], Any]) -> tuple[Any, Any]:  # pragma: no cover - needs a GPU
    """``(output, graph)``: ``eager`` recorded on a capture stream (CuPy)."""
    import cupy

    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        try:
            output = eager()
        finally:
            graph = stream.end_capture()
    return output, graph
