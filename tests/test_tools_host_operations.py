"""tools/host_operations.py and its engine tools/host_counting.py: what they count is what happened.

The counts are measured, not asserted (the GPU path is changing): these tests
check that each operation is counted once under the right kind, that every
launch, GEMM and read of a network pass is counted where an independent
record (a recording launcher, a recording GEMM, the emulation's own host-read
hook) says it happened, that per-layer counts add up to the totals, that the
mode which does not run the feature kernels counts exactly what running them
counts, and that the targets and the comparison of two runs are computed
right on made-up counts.
"""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from sparsecore.backends import kernel_registry
from sparsecore.benchmark import network, scenes

from tests.tool_modules import load_tool

ROOT = Path(__file__).resolve().parents[1]


host_operations = load_tool("host_operations")
host_counting = load_tool("host_counting")
# conv (builds its rulebook), conv (reuses it), pool (builds), conv (builds on the pool's output sites)
LAYERS = network.REFERENCE_NETWORK[:4]


def _strip_scene(width: int = 24) -> scenes.VoxelScene:
    """A strip of the small synthetic scene: 138 sites at width 24 (the emulated feature kernels run on it)."""
    scene = network.network_scene("synthetic", "small", seed=3)
    keep = scene.indices[:, 2] < width
    return scenes.VoxelScene(np.ascontiguousarray(scene.features[keep]), np.ascontiguousarray(scene.indices[keep]),
                             scene.spatial_shape, 1, "strip of the small synthetic scene")


@dataclass
class _PassRecordingLauncher:
    """Runs launches on ``inner`` and records (pass being counted, kernel name) for each."""

    inner: Any
    tally: Any
    launches: list[tuple[str | None, str]] = field(default_factory=list)

    def launch(self, expression: str, grid: int, block: int, args: tuple[Any, ...]) -> None:
        self.launches.append((self.tally.pass_name, expression.split("<")[0]))
        self.inner.launch(expression, grid, block, args)


@dataclass
class _RecordingGemm:
    """A GEMM engine (``KernelBackend.gemm``) that records the pass of each product."""

    tally: Any
    calls: list[str | None] = field(default_factory=list)

    def matmul(self, xp: Any, left: Any, right: Any) -> Any:
        self.calls.append(self.tally.pass_name)
        return xp.matmul(left, right)


@pytest.fixture(scope="module")
def counted() -> dict[str, Any]:
    """The prefix network on the strip, every kernel run, beside independent records; and the fast count."""
    from tests.cuda_emulation import device_arrays
    from tests.cuda_emulation.emulated_launcher import EmulatedLauncher

    plain = host_operations.emulation_target()
    tally = host_counting.Tally(plain.internal_files)
    launcher = _PassRecordingLauncher(EmulatedLauncher(), tally)
    gemm = _RecordingGemm(tally)
    target = dataclasses.replace(plain, backend=dataclasses.replace(plain.backend, launcher=launcher, gemm=gemm))
    refusals: list[tuple[str | None, str]] = []
    original_refuse = device_arrays._refuse

    def refuse(what: str) -> None:
        refusals.append((tally.pass_name, what))
        original_refuse(what)

    scene = _strip_scene()
    device_arrays._refuse = refuse
    try:
        document = host_operations.count_network(target, scene, "strip", LAYERS, tally=tally)
    finally:
        device_arrays._refuse = original_refuse
    fast = host_operations.count_network(plain, scene, "strip", LAYERS, skip_feature_kernels=True)
    return {"document": document, "launcher": launcher, "gemm": gemm, "refusals": refusals, "fast": fast,
            "scene": scene}


def test_each_operation_is_counted_once_under_its_kind() -> None:
    from tests.cuda_emulation import device_arrays

    target = host_operations.emulation_target()
    tally = host_counting.Tally(target.internal_files)
    library = host_counting.CountingLibrary(target.library, tally)
    backend = dataclasses.replace(target.backend, xp=library)
    rng = np.random.default_rng(11)
    values = device_arrays.to_device(rng.standard_normal(8))
    matrix = device_arrays.to_device(rng.standard_normal((3, 4)))
    with host_counting.counting(tally, backend, device_arrays.DeviceArray, ufunc_override=target.ufunc_override):
        values + 1.0  # not counted: no pass is being counted
        tally.pass_name = "forward"
        doubled = values * 2.0                     # ufunc
        summed = library.cumsum(doubled)           # xp (NumPy's own .cumsum inside is not counted again)
        window = summed[2:5]                       # index
        cast = summed.astype(np.float32)           # method
        first = int(window[0])                     # index, read
        positive = summed[summed > 0]              # ufunc (the comparison), read (a boolean mask)
        distinct = library.unique(summed)          # read (its size depends on the data)
        listed = summed.tolist()                   # read
        added = library.add(doubled, doubled)      # ufunc
        product = backend.matmul(matrix, matrix.T)  # matmul (its xp.matmul inside is not counted); index (.T: no)
        tally.pass_name = None
    kinds = Counter()
    for (pass_name, layer, stage, kind), count in tally.counts.items():
        assert (pass_name, layer, stage) == ("forward", host_counting.OUTSIDE, "other")
        kinds[kind] += count
    assert dict(kinds) == {"ufunc": 3, "xp": 1, "index": 2, "method": 1, "read": 4, "matmul": 1}
    assert all("test_tools_host_operations.py:" in site for (_, _, _, site) in tally.sites), tally.sites
    # the operations did what they do
    assert np.array_equal(np.asarray(product), np.asarray(matrix) @ np.asarray(matrix).T)
    assert first == int(np.asarray(summed)[2]) and listed == np.asarray(summed).tolist()
    assert np.array_equal(np.asarray(distinct), np.unique(np.asarray(summed)))
    assert np.array_equal(np.asarray(positive), np.asarray(summed)[np.asarray(summed) > 0])
    assert np.array_equal(np.asarray(added), 2 * np.asarray(doubled)) and cast.dtype == np.float32
    # every wrapper is gone after the block
    assert "__add__" not in device_arrays.DeviceArray.__dict__ and "astype" not in device_arrays.DeviceArray.__dict__


def _operation(refusal: str) -> str:
    for prefix, suffix in (("xp.", ""), ("numpy.", ""), ("array.", "()")):
        if refusal.startswith(prefix) and refusal.endswith(suffix):
            return refusal[len(prefix):len(refusal) - len(suffix)]
    return refusal


def _distinct_reads(refusals: list[str]) -> int:
    """Refusals of the emulation's hook, those of one call's nested re-checks counted once."""
    return sum(1 for position, what in enumerate(refusals)
               if not (what.startswith(("numpy.", "array.")) and position > 0
                       and _operation(refusals[position - 1]) == _operation(what)))


def test_launches_gemms_and_reads_are_counted_where_they_happened(counted: dict[str, Any]) -> None:
    document = counted["document"]
    for pass_name in host_operations.PASSES:
        launched = Counter(name for recorded_pass, name in counted["launcher"].launches if recorded_pass == pass_name)
        sites = Counter()
        for record in document["call_sites"]:
            if record["pass"] == pass_name and record["site"].startswith("sc_"):
                sites[record["site"].split(" at ")[0]] += record["count"]
        operations, launches, matmuls, reads = host_operations.pass_counts(document, pass_name)
        assert launched and sites == launched
        assert launches == sum(launched.values())
        assert matmuls == counted["gemm"].calls.count(pass_name)
        # the emulation's own hook; one data-sized xp call is refused by DEVICE_NUMPY ("xp.nonzero"), again by
        # NumPy's dispatch ("numpy.nonzero") and by the method NumPy calls ("array.nonzero()"): one read
        refused = [what for recorded_pass, what in counted["refusals"] if recorded_pass == pass_name]
        assert reads == _distinct_reads(refused)
        assert operations >= launches + matmuls + reads
    assert counted["gemm"].calls.count("forward") > 0 or host_operations.pass_counts(document, "forward")[2] == 0


def test_per_layer_counts_add_up_to_the_totals(counted: dict[str, Any]) -> None:
    document = counted["document"]
    for pass_name in host_operations.PASSES:
        rows = host_operations.layer_counts(document, pass_name)
        assert [row.name for row in rows[:-1]] == [layer.name for layer in LAYERS]
        total = host_operations.pass_counts(document, pass_name)
        assert tuple(sum(getattr(row, name) for row in rows)
                     for name in ("operations", "launches", "matmuls", "reads")) == total
        for row in rows:
            assert tuple(map(sum, zip(*row.per_stage.values()))) == (
                (row.operations, row.launches, row.matmuls, row.reads) if row.per_stage else ())
            assert sum(row.kinds.values()) == row.operations
        stage_totals = host_operations.stage_counts(document, pass_name)
        assert sum(sum(kinds.values()) for kinds in stage_totals.values()) == total[0]
    forward = host_operations.layer_counts(document, "forward")
    assert "rulebooks" in forward[0].per_stage and "convolution" in forward[0].per_stage
    assert set(forward[1].per_stage) == {"convolution"}  # the second conv of a block reuses its rulebook
    assert {"rulebooks", "pool"} <= set(forward[2].per_stage)
    backward = host_operations.layer_counts(document, "backward")
    assert all("rulebooks" not in row.per_stage for row in backward)


def test_not_running_the_feature_kernels_counts_the_same(counted: dict[str, Any]) -> None:
    document, fast = counted["document"], counted["fast"]
    assert fast["mode"] != document["mode"]
    assert host_operations.compare_documents(fast, document) == []
    assert fast["counts"] == document["counts"]


def _made_up(launches_per_conv: int, reads: int) -> dict[str, Any]:
    layers = [{"index": 0, "name": "L00 conv", "kind": "subm", "builds_rulebook": True},
              {"index": 1, "name": "L01 conv", "kind": "subm", "builds_rulebook": False},
              {"index": 2, "name": "L02 pool", "kind": "maxpool", "builds_rulebook": True}]

    def record(pass_name: str, layer: int | None, stage: str, kind: str, count: int) -> dict[str, Any]:
        return {"pass": pass_name, "layer": layer, "stage": stage, "kind": kind, "count": count}

    counts = [record("forward", 0, "rulebooks", "launch", 4), record("forward", 0, "rulebooks", "read", reads),
              record("forward", 0, "rulebooks", "xp", 120),
              record("forward", 0, "convolution", "launch", launches_per_conv),
              record("forward", 1, "convolution", "launch", 1), record("forward", 1, "convolution", "xp", 3),
              record("forward", 2, "pool", "launch", 1), record("forward", 2, "rulebooks", "read", 1),
              record("forward", None, "other", "xp", 2),
              record("backward", 0, "convolution", "launch", 2), record("backward", 0, "convolution", "matmul", 1),
              record("backward", 1, "convolution", "launch", 3), record("backward", 2, "pool", "launch", 1)]
    sites = [{"pass": "forward", "layer": 0, "stage": "convolution", "site": "sc_conv at conv.py:1",
              "count": launches_per_conv}]
    return {"format": host_operations.FORMAT, "device": "emulation", "mode": "made up", "scene": "none",
            "sites": 0, "commit": "none", "seconds": 0.0, "layers": layers, "counts": counts, "call_sites": sites}


def test_targets_are_computed_from_the_counts() -> None:
    results = {result.name: result for result in host_operations.target_results(_made_up(1, 2))}
    forward = results["forward with rulebook builds: host operations"]
    assert (forward.value, forward.met) == (135, True)
    assert (results["forward with rulebook builds: reads back"].value,
            results["forward with rulebook builds: reads back"].met) == (3, True)
    assert results["backward: host operations"].value == 2 + 1 + 3 + 1
    assert (results["backward: reads back"].value, results["backward: reads back"].met) == (0, True)
    launches = results["per conv layer, forward convolution: kernel launches"]
    assert (launches.value, launches.met) == (1, True)
    cublas = results["per conv layer, forward convolution: cuBLAS calls"]
    assert (cublas.value, cublas.met) == (0, True)
    backward = results["per conv layer, backward convolution: kernel launches"]
    assert (backward.value, backward.met) == (3, False) and "L01 conv" in backward.detail
    worse = {result.name: result for result in host_operations.target_results(_made_up(2, 7))}
    assert not worse["per conv layer, forward convolution: kernel launches"].met
    assert not worse["forward with rulebook builds: reads back"].met


def test_comparison_names_the_layers_and_sites_that_differ() -> None:
    same = host_operations.compare_documents(_made_up(1, 2), _made_up(1, 2))
    assert same == []
    differences = host_operations.compare_documents(_made_up(2, 2), _made_up(1, 2))
    assert differences[0] == "forward L00 conv convolution: host operations 2 vs 1, launches 2 vs 1"
    assert differences[1].strip() == "sc_conv at conv.py:1: 2 vs 1"
    assert len(differences) == 2


def test_report_lists_every_layer_and_the_targets() -> None:
    text = host_operations.format_report(_made_up(1, 2), sites=5)
    for name in ("L00 conv", "L01 conv", "L02 pool", "outside the layers", "per stage:", "top call sites:",
                 "forward with rulebook builds: 135 host operations (7 kernel launches, 0 cuBLAS calls, 3 reads back)",
                 "NOT MET  per conv layer, backward convolution: kernel launches: 3 (target <= 2)"):
        assert name in text, name


def test_feature_kernels_are_the_float_instantiations() -> None:
    assert host_counting.is_feature_kernel("sc_implicit_gemm<__half, sc::Wmma>")
    assert host_counting.is_feature_kernel("sc_int8_conv<signed char, float>")
    assert not host_counting.is_feature_kernel("sc_hash_insert<long long>")
    assert not host_counting.is_feature_kernel("sc_compact_count")
    geometry = {"hash_table.cu", "rulebook.cu", "neighbour_map.cu"}
    for entry in kernel_registry.KERNEL_FILES:
        if entry.file in geometry:
            assert not any(map(host_counting.is_feature_kernel, entry.name_expressions)), entry.file
        if entry.file in ("segment_sums.cu", "implicit_gemm.cu", "pool_maps.cu"):
            assert all(map(host_counting.is_feature_kernel, entry.name_expressions)), entry.file


def test_command_writes_json_and_compares_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    strip = _strip_scene()
    monkeypatch.setattr(host_operations.network, "network_scene", lambda name, scale: strip)
    path = tmp_path / "counts.json"
    assert host_operations.main(["--layers", "3", "--sites", "3", "--json", str(path)]) == 0
    document = json.loads(path.read_text())
    assert [layer["name"] for layer in document["layers"]] == [layer.name for layer in LAYERS[:3]]
    assert document["mode"] == "feature kernels counted, not run" and document["device"] == "emulation"
    assert "L02 SparseMaxPool3d" in capsys.readouterr().out
    assert host_operations.main(["--layers", "3", "--sites", "0", "--compare", str(path)]) == 0
    assert "every layer's counts are equal" in capsys.readouterr().out
    document["counts"][0]["count"] += 1
    path.write_text(json.dumps(document))
    assert host_operations.main(["--layers", "3", "--sites", "0", "--compare", str(path)]) == 1
    assert "lines differ" in capsys.readouterr().out


def test_peak_meter_sees_what_a_block_allocates() -> None:
    target = host_operations.emulation_target()
    with host_operations._peak_meter(target) as peak:
        kept = np.ones(1_000_000)          # 8 MB, kept
        dropped = np.ones(500_000)         # 4 MB while it lives
        del dropped
    assert 12_000_000 <= peak[0] < 12_100_000
    assert kept.nbytes == 8_000_000
    scratch = host_operations.PassScratch("forward", 1000, 1200, 1700)
    assert (scratch.scratch_bytes, scratch.ratio) == (500, 0.5)


def test_feature_pass_scratch_counts_the_results_apart() -> None:
    target = host_operations.emulation_target()
    scene = _strip_scene()
    forward, backward = host_operations.feature_pass_scratch(target, scene, 16, skip_feature_kernels=True)
    assert len(scene.indices) == 138
    sites = len(scene.indices)
    assert (forward.direction, forward.reference_bytes, forward.result_bytes) == ("forward", sites * 16 * 4,
                                                                                 sites * 16 * 4)
    assert (backward.reference_bytes, backward.result_bytes) == (sites * 16 * 4, sites * 16 * 4 + 27 * 16 * 16 * 4)
    assert forward.peak_bytes >= forward.result_bytes and backward.peak_bytes >= backward.result_bytes


def test_capacity_mode_counts_no_read_back_and_reports_its_rows(capsys: pytest.CaptureFixture[str]) -> None:
    """``--capacity``: after one warm-up the forward with its builds and the backward read nothing back (the
    emulation refuses reads: its `DeviceArray` hook is the oracle of the read count), with the same launches
    as exact mode; the rows allocated hold the rows needed."""
    import sparsecore as sc
    from tests.cuda_emulation import device_arrays

    target = host_operations.emulation_target()
    scene = _strip_scene()
    refused: list[str] = []
    original_refuse = device_arrays._refuse
    tally = host_counting.Tally(target.internal_files)

    def refuse(what: str) -> None:
        if tally.pass_name is not None:
            refused.append(what)
        original_refuse(what)

    device_arrays._refuse = refuse
    try:
        document = host_operations.count_network(target, scene, "strip", LAYERS, skip_feature_kernels=True,
                                                 tally=tally, capacity=sc.LearnedCapacity())
    finally:
        device_arrays._refuse = original_refuse
    exact = host_operations.count_network(target, scene, "strip", LAYERS, skip_feature_kernels=True)
    assert refused == []
    for pass_name in host_operations.PASSES:
        operations, launches, matmuls, reads = host_operations.pass_counts(document, pass_name)
        exact_operations, exact_launches, _, exact_reads = host_operations.pass_counts(exact, pass_name)
        assert reads == 0 and launches == exact_launches
        assert operations == exact_operations - exact_reads
    pools = [entry for entry in document["capacity"] if "Pool" in entry["layer"]]
    assert pools and all(entry["needed"] <= entry["capacity"] for entry in pools)
    text = host_operations.format_capacity(document)
    assert "layer outputs and tables" in text and pools[0]["layer"] in text
