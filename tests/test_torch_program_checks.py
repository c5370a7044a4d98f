"""sparsecore.torch.load_program's graph checks (program_checks.py): edited sparsecore op arguments are refused
at load, naming the node and the argument, before any rulebook is built; an unedited program runs and equals
the eager model (the oracle)."""

from __future__ import annotations

import io
import json
import zipfile
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import sparsecore.torch as spconv  # noqa: E402
from sparsecore.torch.exportable import sites_dynamic_shapes  # noqa: E402
from tests.dense_oracle import make_rng  # noqa: E402


def _input(seed: int, sites: int = 300) -> "spconv.SparseConvTensor":
    rng = make_rng(seed)
    coordinates = np.unique(rng.integers(0, 24, (sites, 3)), axis=0)
    indices = np.concatenate([np.zeros((len(coordinates), 1), np.int64), coordinates], axis=1).astype(np.int32)
    features = torch.from_numpy(rng.standard_normal((len(indices), 4)).astype(np.float32))
    return spconv.SparseConvTensor(features, torch.from_numpy(indices), [24, 24, 24], 1)


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    torch.manual_seed(41)
    model = spconv.SparseSequential(
        spconv.SubMConv3d(4, 16, 3, bias=True, indice_key="subm1"),
        spconv.SparseConv3d(16, 8, 3, stride=2, padding=1, bias=False),
        spconv.SparseMaxPool3d(2, stride=2),
    ).eval()
    path = tmp_path_factory.mktemp("program") / "model.pt2"
    torch.export.save(torch.export.export(model, (_input(42),), dynamic_shapes=(sites_dynamic_shapes(),)), path)
    return path, model


def _edited(path: Path, target: Path, edit: Callable[[list], None]) -> Path:
    """A copy of the archive at ``path`` whose graph nodes went through ``edit``."""
    source = zipfile.ZipFile(path)
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as copy:
        for member in source.infolist():
            data = source.read(member)
            if member.filename.endswith("models/model.json"):
                graph = json.loads(data)
                edit(graph["graph_module"]["graph"]["nodes"])
                data = json.dumps(graph).encode()
            copy.writestr(member, data)
    target.write_bytes(buffer.getvalue())
    return target


def _set(op: str, argument: str, value: dict, which: int = 0) -> Callable[[list], None]:
    """An edit setting ``argument`` of the ``which``-th node calling sparsecore's ``op``."""
    def edit(nodes: list) -> None:
        calls = [node for node in nodes if node["target"] == f"torch.ops.sparsecore.{op}.default"]
        for entry in calls[which]["inputs"]:
            if entry["name"] == argument:
                entry["arg"] = value
    return edit


def _all(*edits: Callable[[list], None]) -> Callable[[list], None]:
    def edit(nodes: list) -> None:
        for one in edits:
            one(nodes)
    return edit


def _copy(op: str, argument: str, source: int, target: int, source_argument: str = "") -> Callable[[list], None]:
    """An edit giving the ``target``-th ``op`` node the ``argument`` of the ``source``-th (a value defined earlier)."""
    def edit(nodes: list) -> None:
        calls = [node for node in nodes if node["target"] == f"torch.ops.sparsecore.{op}.default"]
        value = next(e["arg"] for e in calls[source]["inputs"] if e["name"] == (source_argument or argument))
        next(e for e in calls[target]["inputs"] if e["name"] == argument)["arg"] = value
    return edit


def _copy_across(argument: str, source_op: str, target_op: str) -> Callable[[list], None]:
    def edit(nodes: list) -> None:
        source = next(n for n in nodes if n["target"] == f"torch.ops.sparsecore.{source_op}.default")
        target = next(n for n in nodes if n["target"] == f"torch.ops.sparsecore.{target_op}.default")
        value = next(e["arg"] for e in source["inputs"] if e["name"] == argument)
        next(e for e in target["inputs"] if e["name"] == argument)["arg"] = value
    return edit


_KERNEL_101 = {"as_ints": [101, 101, 101]}
_CASES = {
    # the probe's case: every kernel_size 3 -> 101 (rulebooks and convs agree; the stored weights do not)
    "kernel-everywhere": (_all(_set("export_rulebook", "kernel_size", _KERNEL_101, 0),
                               _set("export_conv", "kernel_size", _KERNEL_101, 0),
                               _set("export_rulebook", "kernel_size", _KERNEL_101, 1),
                               _set("export_conv", "kernel_size", _KERNEL_101, 1)),
                          "'export_conv' (export_conv) has kernel_size [101, 101, 101] and a weight of shape "
                          "[16, 3, 3, 3, 4]"),
    "kernel-of-a-rulebook": (_set("export_rulebook", "kernel_size", _KERNEL_101, 0),
                             "reads the pairs of 'export_rulebook', built for kernel_size [101, 101, 101]"),
    "kernel-of-a-pool": (_set("export_pool", "kernel_size", {"as_ints": [5, 5, 5]}),
                         "(export_pool) has kernel_size [5, 5, 5] but reads the pairs of"),
    "kind": (_set("export_rulebook", "kind", {"as_string": "sideways"}), "has kind 'sideways'; expected one of"),
    "stride": (_set("export_rulebook", "stride", {"as_ints": [0, 2, 2]}, 1), "has a geometry the core refuses"),
    "axes": (_set("export_rulebook", "spatial_shape", {"as_ints": [24, 24]}), "has a 2-axis spatial_shape"),
    "grid": (_set("export_rulebook", "spatial_shape", {"as_ints": [24, -1, 24]}), "expected positive sizes"),
    "batch": (_set("export_rulebook", "batch_size", {"as_int": 0}), "has batch_size 0; expected at least 1"),
    "groups": (_set("export_conv", "groups", {"as_int": 3}), "has groups=3; expected a positive divisor"),
    "pool-mode": (_set("export_pool", "mode", {"as_string": "min"}), "has mode 'min'; expected one of"),
    # issue 39: pairs of another rulebook, sites of another rulebook, a grid that does not follow from the layers
    "pairs-of-two-rulebooks": (_copy("export_conv", "pair_output", 0, 1),
                               "(export_conv) reads pair tensors of several rulebooks"),
    "pairs-swapped": (_all(_copy("export_conv", "pair_input", 1, 1, "pair_output"),
                           _copy("export_conv", "pair_output", 0, 1, "pair_input")),
                      "(export_conv) reads pair tensors of several rulebooks"),
    "sites-of-another-rulebook": (_copy_across("out_indices", "export_conv", "export_pool"),
                                  "(export_pool) writes onto the sites 'input_indices', which are not the output sites"),
    "grid-of-a-later-rulebook": (_set("export_rulebook", "spatial_shape", {"as_ints": [24, 24, 24]}, 2),
                                 "whose grid is [12, 12, 12] (the output grid of 'export_rulebook_1')"),
}


@pytest.mark.parametrize("case", sorted(_CASES))
def test_an_edited_graph_is_refused_at_load_naming_the_node(case: str, exported: tuple[Path, Any],
                                                            tmp_path: Path) -> None:
    edit, message = _CASES[case]
    path = _edited(exported[0], tmp_path / "edited.pt2", edit)
    with pytest.raises(ValueError, match="load_program: .*edited.pt2: node ") as raised:
        spconv.load_program(path)
    assert message in str(raised.value)
    assert "export the program again with sparsecore.torch" in str(raised.value)


def test_an_unedited_program_loads_and_equals_the_eager_model(exported: tuple[Path, Any], tmp_path: Path) -> None:
    # the same JSON rewritten without edits: the checks pass what torch.export wrote
    path = _edited(exported[0], tmp_path / "same.pt2", lambda nodes: None)
    program = spconv.load_program(path)
    other = _input(43, sites=400)
    with torch.no_grad():
        expected = exported[1](other)
        got = program.module()(other)
    got_features = got[0] if isinstance(got, (tuple, list)) else got.features
    np.testing.assert_allclose(got_features.numpy(), expected.features.numpy(), rtol=1e-5, atol=1e-5)
    assert expected.features.abs().max() > 0.1
