"""sparsecore.torch.example_inputs: counts of a structure equal a plain tree walk's (the oracle) on trees, come in
time linear in its distinct objects on DAGs a tree walk would take 2^n steps on, and refuse each bound named."""

from __future__ import annotations

import io
import time

import pytest

torch = pytest.importorskip("torch")

from sparsecore.torch.example_inputs import InputBounds, count_structure, load_example_inputs  # noqa: E402
from tests.dense_oracle import make_rng  # noqa: E402


def _tree_walk(value) -> tuple[int, int, int]:
    """(depth, leaves, bytes) by visiting every path: the oracle on small structures."""
    if isinstance(value, torch.Tensor):
        return 0, 1, value.numel() * value.element_size()
    children = list(value) if isinstance(value, (tuple, list)) else \
        list(value.keys()) + list(value.values()) if isinstance(value, dict) else []
    if not children:
        return 0, 1, 0
    parts = [_tree_walk(child) for child in children]
    return 1 + max(p[0] for p in parts), sum(p[1] for p in parts), sum(p[2] for p in parts)


def test_counts_equal_a_tree_walk_on_shared_and_unshared_structures() -> None:
    rng = make_rng(3970)
    leaf = torch.from_numpy(rng.standard_normal(7))
    shared = (leaf, [leaf, {"a": leaf}])
    value = ({"x": shared, "y": (shared, 3, "s")}, [torch.from_numpy(rng.standard_normal((2, 3))), None])
    counts = count_structure(value, InputBounds())
    assert (counts.depth, counts.leaves, counts.nbytes) == _tree_walk(value)


def test_a_dag_of_shared_tuples_is_refused_on_its_counts_without_walking_it() -> None:
    value = torch.ones(1)
    for _ in range(30):
        value = (value, value)
    start = time.process_time()
    with pytest.raises(ValueError, match="more than 10000 leaves as a walk meets them"):
        count_structure(value, InputBounds(depth=40))
    assert time.process_time() - start < 5  # 2^30 leaves: a tree walk would not end in minutes
    with pytest.raises(ValueError, match="nest deeper than 16 levels"):
        count_structure(value, InputBounds(depth=16))
    with pytest.raises(ValueError, match="tensors of 4096 bytes"):
        count_structure((torch.ones(1024),), InputBounds(nbytes=4000))
    cycle: list = []
    cycle.append(cycle)
    with pytest.raises(ValueError, match="nest deeper"):
        count_structure(cycle, InputBounds())


def test_inputs_are_loaded_weights_only_and_saved_again() -> None:
    rng = make_rng(3971)
    inputs = ((torch.from_numpy(rng.standard_normal((3, 2))),), {})
    buffer = io.BytesIO()
    torch.save(inputs, buffer)
    again = torch.load(io.BytesIO(load_example_inputs("m.pt", buffer.getvalue(), InputBounds(), 2**20)),
                       weights_only=True)
    torch.testing.assert_close(again[0][0], inputs[0][0])
    with pytest.raises(ValueError, match="m.pt: the example inputs are not a plain torch.save archive"):
        load_example_inputs("m.pt", b"not a zip", InputBounds(), 2**20)
    buffer = io.BytesIO()
    torch.save([1, 2], buffer)
    with pytest.raises(ValueError, match="are a list, not the \\(args, kwargs\\) tuple"):
        load_example_inputs("m.pt", buffer.getvalue(), InputBounds(), 2**20)
