"""sparsecore.memory_budget: the budget's settings, its estimates against the rulebooks actually built, and the
public passes refusing (and only refusing) what passes the budget."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import sparsecore as sc
import sparsecore.memory_budget as memory
from sparsecore import cpu_dataflow
from sparsecore.memory_budget import MemoryBudgetError
from tests.dense_oracle import make_rng, random_features, random_indices


@pytest.fixture(autouse=True)
def _no_process_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(memory.BUDGET_VARIABLE, raising=False)


def test_budgets_parse_from_bytes_suffixes_and_shares(monkeypatch: pytest.MonkeyPatch) -> None:
    assert memory.parse_budget(123456) == 123456
    assert memory.parse_budget("512M") == 512 * 2**20
    assert memory.parse_budget("1.5GiB") == int(1.5 * 2**30)
    assert memory.parse_budget(" 8g ") == 8 * 2**30
    monkeypatch.setattr(memory, "available_memory", lambda like=None: 1000)
    assert memory.parse_budget("30%") == 300
    for bad in ("lots", "-5G", "0", "150%", "0%", True, 0, float("nan")):
        with pytest.raises(ValueError, match=memory.BUDGET_VARIABLE):
            memory.parse_budget(bad)


def test_the_innermost_block_wins_then_the_variable_then_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(memory, "available_memory", lambda like=None: 10 * 2**30)
    assert memory.current_budget() == 5 * 2**30  # DEFAULT_FRACTION of what is available
    monkeypatch.setenv(memory.BUDGET_VARIABLE, "3G")
    assert memory.current_budget() == 3 * 2**30
    with memory.budget("1G") as inner:
        assert inner == memory.current_budget() == 2**30
        seen = []
        other = threading.Thread(target=lambda: seen.append(memory.current_budget()))
        other.start()
        other.join()
        assert seen == [3 * 2**30]  # a block holds for its own thread only
    assert memory.current_budget() == 3 * 2**30


def test_a_refusal_names_the_step_its_size_and_the_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    with memory.budget(2**20):
        memory.check_bytes(2**20, "a step")  # at the budget: allowed
        with pytest.raises(MemoryBudgetError, match=r"copying a thing would allocate about 2 MiB, more than the "
                                                    r"memory budget of 1 MiB \(the budget set\)\. Copy less\."):
            memory.check_bytes(2 * 2**20, "copying a thing", "Copy less.")
    monkeypatch.setattr(memory, "available_memory", lambda like=None: pytest.fail("small steps read no file"))
    memory.check_bytes(memory.UNCHECKED_BYTES - 1, "a small step")  # under the default: not checked


@pytest.mark.parametrize("kind, kernel, stride, padding", [("subm", 3, 1, 0), ("subm", 5, 1, 0), ("regular", 3, 2, 1),
                                                           ("regular", 4, 1, 0), ("regular", 3, 3, 2),
                                                           ("transposed", 2, 2, 0), ("transposed", 3, 2, 1)])
def test_estimates_bound_the_rulebooks_built(kind: str, kernel: int, stride: int, padding: int) -> None:
    rng = make_rng(3150, kernel, stride)
    shape = (10, 12, 9)
    indices = random_indices(rng, shape, 2, num=300)
    geometry = sc.ConvGeometry.create(3, kernel, stride, padding, kind=kind)
    rulebook = sc.build_rulebook(indices, shape, 2, geometry)
    estimate = memory.rulebook_build_bytes(geometry, len(indices), shape, 2)
    per_pair = 8 if kind == "subm" else 40  # the pairs and, for strided layers, their candidates' keys and sort
    assert estimate >= per_pair * rulebook.num_pairs + 4 * rulebook.output_indices.size
    assert estimate <= 64 * len(indices) * geometry.kernel_volume + 64 * len(indices)


def test_public_passes_refuse_beyond_the_budget_and_compute_within_it() -> None:
    rng = make_rng(3151)
    shape = (24, 24, 24)
    indices = random_indices(rng, shape, 1, num=5000)
    features = random_features(rng, len(indices), 32).astype(np.float32)
    weight = (rng.standard_normal((32, 3, 3, 3, 32)) / 16).astype(np.float32)
    geometry = sc.ConvGeometry.create(3, 3, 2, 1, kind="regular")
    rulebook = sc.build_rulebook(indices, shape, 1, geometry)
    expected = sc.conv_forward(features, weight, rulebook)
    with memory.budget("1M"):  # every step below is an estimate above 1 MiB
        with pytest.raises(MemoryBudgetError, match=r"building the rulebook of a regular geometry kernel_size=\(3, 3, "
                                                    r"3\).* on 5000 sites of grid \(24, 24, 24\)"):
            sc.build_rulebook(indices, shape, 1, geometry)
        with pytest.raises(MemoryBudgetError, match=rf"conv_forward \({rulebook.num_output} output rows x 32 channels"):
            sc.conv_forward(features, weight, rulebook)
        with pytest.raises(MemoryBudgetError, match=r"conv_backward \(5000 output rows x 32 channels\)"):
            sc.conv_backward(expected, features, weight, rulebook)
        with pytest.raises(MemoryBudgetError, match=r"a dense grid of batch_size 1 x 32 channels x spatial_shape "
                                                    r"\(24, 24, 24\)"):
            sc.to_dense(features, indices, shape, 1)
        small = sc.build_rulebook(indices[:100], shape, 1, geometry)  # estimates below 1 MiB: never checked
        sc.conv_forward(features[:100], weight, small)
    wide = sc.build_rulebook(indices, shape, 1, sc.ConvGeometry.create(3, 9, kind="subm"))  # layouts not built yet
    with memory.budget("1M"):
        with pytest.raises(MemoryBudgetError, match=r"the tile plan of a rulebook of 729 kernel offsets, "
                                                    rf"5000 rows and {wide.num_pairs} pairs"):
            cpu_dataflow.tile_plan(wide, "forward", 1)
        with pytest.raises(MemoryBudgetError, match=r"the neighbour table of a rulebook of 729 kernel offsets"):
            cpu_dataflow.neighbour_table(wide, "backward")
    with memory.budget("1G"):
        np.testing.assert_array_equal(sc.conv_forward(features, weight, rulebook), expected)
