"""Hostile model files for sparsecore.runtime: each a file on disk, its inputs, and what a sound runtime does with it.

Every case starts from a valid hand-written libspconv graph (tests/runtime_graphs.py)
and changes one thing, by the classes of issue 31: values accepted silently before
(duplicate names, NaN / inf, contradictory flags, absurd int8 ranges, float16
overflow), errors that blamed the wrong thing (sites of another dimensionality,
declared channels, zero scales), structure and corruption, external-data paths,
sizes that decide allocations, and valid variants that must compute the oracle's
answer. A case expects either an error (its type and a pattern its message must
match: the node, initializer or attribute it names) or a correct result.

The mutations are in tests/hostile_mutations.py. The cases run in child processes under an
address-space cap (test_hostile_models.py, with tests/hostile_child.py's program);
`judge` turns one child record into an outcome of `OUTCOMES`.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import re
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import onnx
from onnx import helper

from tests.dense_oracle import make_rng
from tests.hostile_mutations import BASE_MUTATIONS, _float_weight, _poke, _set
from tests.runtime_graphs import BATCH, SHAPE, GraphBuilder, base_expected, base_model, case_input, int8_expected, \
    int8_model

OUTCOMES = ("clear", "correct", "silent", "obscure", "blow-up", "crash")


@dataclasses.dataclass(frozen=True)
class Case:
    """One hostile file: ``error`` is (exception type, message pattern), or None for a valid file whose output
    ``check`` compares with the oracle."""

    name: str
    klass: str
    file: str
    input: str
    error: Optional[tuple[str, str]] = None
    check: Optional[Callable[[dict], bool]] = None
    load: dict = dataclasses.field(default_factory=dict)

    def spec(self, folder: Path) -> dict:
        return {"name": self.name, "file": self.file, "input": self.input, "load": self.load,
                "output": str(folder / f"{self.name}.out.npz")}


def judge(case: Case, record: Optional[dict], folder: Path) -> str:
    """The outcome of one case from its child record (None: the child died before reporting it)."""
    if record is None:
        return "crash"
    if record["outcome"] == "error":
        if record.get("raw_memory"):
            return "blow-up"
        if case.error is None:
            return "obscure"
        kind, pattern = case.error
        return "clear" if record["type"] == kind and re.search(pattern, record["message"], re.S) else "obscure"
    if case.error is not None:
        return "silent"
    with np.load(folder / f"{case.name}.out.npz") as output:
        return "correct" if case.check(dict(output)) else "silent"


# ----------------------------------------------------------------------------- inputs and oracles

def _save_input(folder: Path, name: str, features: np.ndarray, indices: np.ndarray, batch: int, shape) -> str:
    path = folder / f"{name}.input.npz"
    np.savez(path, features=features.astype(np.float32), indices=indices.astype(np.int32), batch=batch,
             shape=np.asarray(shape))
    return str(path)


def _sparse_check(expected: tuple[np.ndarray, np.ndarray], tolerance: float) -> Callable[[dict], bool]:
    sites, values = expected

    def check(output: dict) -> bool:
        if "features" not in output or output["indices"].shape != sites.shape:
            return False
        return bool(np.array_equal(output["indices"], sites)
                    and np.allclose(output["features"].astype(np.float64), values, rtol=tolerance, atol=tolerance))
    return check


def _graph(seed: int, build: Callable[[GraphBuilder], str], channels: int = 4) -> Any:
    builder = GraphBuilder(make_rng(seed))
    output = build(builder)
    return builder.model(channels, output)


def _chain(builder: GraphBuilder) -> str:
    builder.conv("conv0", "0", "1", 4, 6, rulebook="a")
    builder.conv("conv1", "1", "2", 8, 6, rulebook="a")
    return "2"


def _add_channels(builder: GraphBuilder) -> str:
    builder.conv("conv0", "0", "1", 4, 8, rulebook="a")
    builder.conv("conv1", "0", "2", 4, 6, rulebook="a")
    builder.op("Add", ["1", "2"], "3", "add0")
    return "3"


def _mixed_ndim(builder: GraphBuilder) -> str:
    builder.conv("conv0", "0", "1", 4, 8, rulebook="a")
    builder.conv("conv1", "1", "2", 8, 6, rulebook="b", ndim=2)
    return "2"


def _scatter_channels(builder: GraphBuilder) -> str:
    builder.conv("conv0", "0", "1", 4, 6, rulebook="a")
    builder.op("ScatterDense", ["1"], "2", "scatter0", format="zyx", output_layout="NCHW",
               output_shape=[BATCH, 5, *SHAPE])
    return "2"


def _int8_graph(features: np.ndarray, poke: Optional[tuple[str, float]] = None, tail: Optional[str] = None,
                **overrides) -> Any:
    builder = int8_model(make_rng(31), features, **overrides)
    output = "1"
    if tail == "scatter":
        builder.op("ScatterDense", ["1"], "2", "scatter0", format="zyx", output_layout="NCHW",
                   output_shape=[BATCH, 6, *SHAPE], input_dynamic_range=1e6)
        output = "2"
    elif tail == "add":
        builder.op("Add", ["1", "1"], "2", "add0", precision="int8", output_precision="fp16",
                   input0_dynamic_range=0.0, input1_dynamic_range=1e-40)
        output = "2"
    model = builder.model(4, output)
    if poke is not None:
        _poke(model, "conv0.weight", poke[1]) if poke[0] == "weight" else _set(model, "conv0", activation="LeakyReLU",
                                                                               act_alpha=poke[1])
    return builder, model


def _write_external(model: Any, folder: Path, location: str = "weights.bin") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "model.onnx"
    onnx.save_model(copy.deepcopy(model), str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                    location=location, size_threshold=0)
    return path


def _relocate(path: Path, location: str, offset: Optional[int] = None) -> None:
    """Points every external tensor of the saved model at ``location`` (and ``offset``)."""
    model = onnx.load(str(path), load_external_data=False)
    for tensor in model.graph.initializer:
        for entry in tensor.external_data:
            if entry.key == "location":
                entry.value = location
            if entry.key == "offset" and offset is not None:
                entry.value = str(offset)
    onnx.save_model(model, str(path))


def _external_cases(model: Any, folder: Path, inputs: str, check: Callable) -> list[Case]:
    """External data: valid beside the model, then each path a file from elsewhere may name."""
    outside = folder / "outside"
    outside.mkdir(parents=True, exist_ok=True)
    secret = outside / "secret.bin"
    cases = [Case("external_valid", "external data", str(_write_external(model, folder / "ext_valid")), inputs,
                  check=check)]
    data = (folder / "ext_valid" / "weights.bin").read_bytes()
    secret.write_bytes(data)
    pattern = "initializer 'conv0.weight' keeps its data in {}: .*{}"
    variants = {
        "external_parent": ("../outside/secret.bin", "the path leaves the model's folder"),
        "external_absolute": (str(secret), "an absolute path"),
        "external_proc": ("/proc/self/environ", "an absolute path"),
        "external_symlink": ("link.bin", "is a symbolic link"),
        "external_fifo": ("fifo.bin", "not a regular file"),
        "external_folder": ("sub", "not a regular file"),
        "external_missing": ("absent.bin", "cannot be read"),
        "external_offset": ("weights.bin", "passes the file's end"),
    }
    for name, (location, problem) in variants.items():
        target = folder / name
        path = _write_external(model, target)
        if name == "external_symlink":
            os.symlink(secret, target / "link.bin")
        elif name == "external_fifo":
            os.mkfifo(target / "fifo.bin")
        elif name == "external_folder":
            (target / "sub").mkdir()
        _relocate(path, location, offset=10**9 if name == "external_offset" else None)
        cases.append(Case(name, "external data", str(path), inputs,
                          error=("GraphError", pattern.format(re.escape(repr(location)), problem))))
    return cases


def write_cases(folder: Path) -> list[Case]:
    """Writes every hostile file of the grouped child (no case here can allocate much) and returns the cases."""
    folder.mkdir(parents=True, exist_ok=True)
    _, indices, features = case_input(3101)
    features = features.astype(np.float32).astype(np.float64)
    inputs = _save_input(folder, "base", features, indices, BATCH, SHAPE)
    builder = base_model(make_rng(3102))
    base = builder.model(4, "2")
    check = _sparse_check(base_expected(builder, features, indices), 1e-4)
    cases: list[Case] = []

    def add(name: str, klass: str, model: Any, error=None, **extra) -> None:
        path = folder / f"{name}.onnx"
        onnx.save(model, str(path))
        cases.append(Case(name, klass, str(path), extra.pop("input", inputs), error=error, **extra))

    for name, klass, mutate, error in BASE_MUTATIONS:
        add(name, klass, mutate(copy.deepcopy(base)), error)
    add("in_channels_chain", "wrong blame", _graph(3103, _chain),
        ("GraphError", "node 1 'conv1'.*takes 8 input channels.*input '1' has 6 \\(the output of node 0 'conv0'"))
    add("add_channels", "wrong blame", _graph(3104, _add_channels),
        ("GraphError", "node 2 'add0' \\(Add\\) adds '1' \\(8 channels.*'2' \\(6 channels"))
    add("mixed_ndim", "wrong blame", _graph(3105, _mixed_ndim),
        ("GraphError", "node 1 'conv1'.*is 2-D, but node 0 'conv0'.*is 3-D"))
    add("scatter_channels", "wrong blame", _graph(3106, _scatter_channels),
        ("GraphError", "node 1 'scatter0'.*traced output_shape \\[2, 5, 9, 11, 7\\].*C = 6"))
    # the sites of another dimensionality, a grid of another rank: named as such at run time
    sites_4d = np.concatenate([indices, indices[:, 1:2]], axis=1)
    add("sites_4d", "wrong blame", base,
        ("ValueError", "indices must be \\[N, 4\\].*layers are 3-D.*sites given are 4-D"),
        input=_save_input(folder, "sites4d", features, sites_4d, BATCH, (*SHAPE, 5)))
    add("spatial_shape_2d", "wrong blame", base, ("ValueError", "spatial_shape must have 3 entries"),
        input=_save_input(folder, "shape2d", features, indices, BATCH, SHAPE[:2]))
    # int8 ranges and values
    ranges = int8_model(make_rng(31), features)
    weight_ranges = [float(value) for value in next(
        helper.get_attribute_value(a) for a in ranges.nodes[0].attribute if a.name == "weight_dynamic_ranges")]
    int8_cases = {
        "int8_weight_ranges_over_1000": (dict(weight_dynamic_ranges=[v / 1000 for v in weight_ranges]), None, None,
                                         "node 0 'conv0'.*weight_dynamic_ranges\\[0\\].*smaller than the channel's"),
        "int8_weight_ranges_3e38": (dict(weight_dynamic_ranges=[3e38] * 6), None, None,
                                    "node 0 'conv0'.*weight_dynamic_ranges\\[0\\].*more than 16 times"),
        "int8_input_range_1e-30": (dict(input_dynamic_range=1e-30), None, None,
                                   "node 0 'conv0'.*input_dynamic_range=1e-30 describes no FP16 tensor"),
        "int8_zero_scale": (dict(input_dynamic_range=1e-44), None, None,
                            "node 0 'conv0'.*input_dynamic_range=[0-9.e+-]+ gives the scale 0 .*not a normal"),
        "int8_input_range_1e5": (dict(input_dynamic_range=1e5), None, None,
                                 "node 0 'conv0'.*input_dynamic_range=100000 describes no FP16 tensor"),
        "int8_nan_weight": ({}, ("weight", np.nan), None, "node 0 'conv0'.*the weight 'conv0.weight' holds 1 "),
        "int8_nan_act_alpha": ({}, ("alpha", np.nan), None, "node 0 'conv0'.*the attribute 'act_alpha' holds"),
        "int8_scatter_range": ({}, None, "scatter", "node 1 'scatter0'.*input_dynamic_range=1e\\+06 describes no"),
        "int8_add_range": ({}, None, "add",
                           "node 1 'add0'.*input1_dynamic_range=[0-9.e+-]+ gives the scale [0-9.e+-]+ .*not a normal"),
    }
    for name, (overrides, poke, tail, pattern) in int8_cases.items():
        add(name, "silent: int8 ranges" if "nan" not in name else "wrong blame",
            _int8_graph(features, poke, tail, **overrides)[1], ("GraphError", pattern))
    # float16: the first node whose output overflows, and weights float16 cannot hold
    loud = base_model(make_rng(3107))
    loud_model = loud.model(4, "2")
    factor = float(6e4 / np.abs(loud.weights["conv1"][0]).max())  # FLOAT weights up to 60000, their sums beyond
    _float_weight(loud_model, "conv1.weight", factor)
    add("float16_overflow", "silent: float16", loud_model,
        ("NonFiniteError", "node 'conv1' \\(SparseConvolution\\) wrote [0-9]+ non-finite value.*float16"),
        load={"dtype": "float16"})
    loud.weights["conv1"] = ((loud.weights["conv1"][0].astype(np.float32) * np.float32(factor)).astype(np.float64),
                             loud.weights["conv1"][1])
    wide = base_expected(loud, features, indices)
    add("float16_overflow_in_float32", "valid", loud_model, check=_sparse_check(wide, 1e-4 * np.abs(wide[1]).max()))
    add("float32_weights_beyond_float16", "silent: float16", _float_weight(copy.deepcopy(base), "conv0.weight", 1e6),
        ("GraphError", "node 'conv0' \\(SparseConvolution\\): its weight holds .* beyond float16"),
        load={"dtype": "float16"})
    # valid variants: the oracle's answer
    add("valid_base", "valid", base, check=check)
    add("valid_explicit_budget", "valid", base, check=check, load={"memory_budget": "2G"})
    in_domain = copy.deepcopy(base)
    for node in in_domain.graph.node:
        node.domain = "spconv"
    in_domain.opset_import.append(helper.make_operatorsetid("spconv", 1))
    add("valid_spconv_domain", "valid", in_domain, check=check)
    unnamed = copy.deepcopy(base)
    for node in unnamed.graph.node:
        node.name = ""
    add("valid_unnamed_nodes", "valid", unnamed, check=check)
    shuffled = copy.deepcopy(base)
    for node in shuffled.graph.node:
        attributes = list(node.attribute)[::-1] + [helper.make_attribute("output_bound", 200000),
                                                     helper.make_attribute("input_spatial_shape", list(SHAPE))]
        del node.attribute[:]
        node.attribute.extend(attributes)
    add("valid_shuffled_attributes", "valid", shuffled, check=check)
    shapeless = copy.deepcopy(base)
    shapeless.graph.output[0].type.tensor_type.ClearField("shape")
    add("valid_output_without_shape", "valid", shapeless, check=check)
    leaky = base_model(make_rng(3102), activation="LeakyReLU", act_alpha=0.2)
    add("valid_leaky_relu", "valid", leaky.model(4, "2"),
        check=_sparse_check(base_expected(leaky, features, indices, "LeakyReLU", 0.2), 1e-4))
    add("valid_float16", "valid", base, check=_sparse_check(base_expected(builder, features, indices), 3e-2),
        load={"dtype": "float16"})
    good, good_model = _int8_graph(features)
    expected = int8_expected(good, features, indices)
    add("valid_int8", "valid", good_model, check=lambda out: "features" in out and np.array_equal(
        out["indices"], indices) and np.allclose(out["features"], expected, rtol=1e-6, atol=1e-6))
    # corrupt files
    for name, data in (("random_bytes", make_rng(3108).bytes(400)),
                       ("truncated_file", base.SerializeToString()[:700])):
        (folder / f"{name}.onnx").write_bytes(data)
        cases.append(Case(name, "structure", str(folder / f"{name}.onnx"), inputs,
                          error=("GraphError", f"{name}.onnx' is not a readable ONNX model")))
    cases += _external_cases(base, folder, inputs, check)
    from tests.hostile_data_cases import write_data_cases  # issue 39's cases (that module imports this one)

    cases += write_data_cases(base, folder, inputs)
    return cases


def memory_case(folder: Path, name: str) -> Case:
    """One file whose sizes decide allocations of many GiB (``kernel_81``, ``padding_300``, ``subm_kernel_101``),
    run in its own capped child."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = make_rng(3120)
    grid = (300, 300, 300)
    cells = rng.choice(int(np.prod(grid)), 2000, replace=False)
    sites = np.concatenate([np.zeros((2000, 1), np.int64), np.stack(np.unravel_index(cells, grid), 1)], 1)
    channels = 4 if name == "padding_300" else 1
    features = rng.uniform(-1, 1, (2000, channels))
    count = 2000 if name == "subm_kernel_101" else 600
    inputs = _save_input(folder, name, features[:count], sites[:count], 1, grid)
    builder = GraphBuilder(rng)
    if name == "kernel_81":
        builder.conv("conv0", "0", "1", 1, 1, kind="regular", kernel=81, padding=40, rulebook="big")
        output, pattern = "1", ("node 'conv0' \\(SparseConvolution\\): building the rulebook of a regular geometry "
                                "kernel_size=\\(81, 81, 81\\).* on 600 sites.*GiB, more than the memory budget")
    elif name == "padding_300":
        builder.conv("conv0", "0", "1", 4, 4, kind="regular", kernel=3, padding=300, rulebook="wide")
        builder.op("ScatterDense", ["1"], "2", "scatter0", format="zyx", output_layout="NCHW",
                   output_shape=[1, 4, 898, 898, 898])
        output, pattern = "2", ("node 'scatter0' \\(ScatterDense\\): a dense grid of batch_size 1 x 4 channels x "
                                "spatial_shape \\(898, 898, 898\\).*GiB, more than the memory budget")
    else:
        builder.conv("conv0", "0", "1", 1, 1, kind="subm", kernel=101, rulebook="huge")
        output, pattern = "1", ("node 'conv0' \\(SparseConvolution\\): building the rulebook of a subm geometry "
                                "kernel_size=\\(101, 101, 101\\).* on 2000 sites.*GiB, more than the memory budget")
    path = folder / f"{name}.onnx"
    onnx.save(builder.model(channels, output), str(path))
    return Case(name, "memory", str(path), inputs, error=("MemoryBudgetError", pattern))


def write_groups(groups: list[dict], folder: Path) -> Path:
    """The zygote's plan: groups of ``{"name", "cap", "cases": [Case] | "threads": spec, "environment"}``."""
    plan = []
    for group in groups:
        entry = {key: value for key, value in group.items() if key != "cases"}
        if "cases" in group:
            entry["cases"] = [case.spec(folder) for case in group["cases"]]
        plan.append(entry)
    path = folder / "plan.json"
    path.write_text(json.dumps(plan))
    return path
