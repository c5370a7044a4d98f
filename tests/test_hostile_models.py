"""Hostile model files: each loaded and run in a child process under an address-space cap (RLIMIT_AS).

The files (tests/hostile_cases.py) mutate valid hand-written libspconv graphs by the
classes of issue 31. A sound runtime gives every file one of two outcomes: a clear
error of the expected type whose message names the node, initializer or attribute,
or, for a valid file, the dense oracle's answer. Counted against that: ``silent``
(ran where it should have refused, or a wrong answer), ``obscure`` (another error or
a message naming the wrong thing), ``blow-up`` (a raw MemoryError under the cap) and
``crash`` (the child died). Cases that cannot crash share one child; each case whose
sizes could allocate many GiB gets its own (one zygote process imports onnx once
and forks the children, each setting its own cap). Checkpoints (``SPCONV_SAVED_WEIGHT_LAYOUT``)
and threads sharing a session under numba's ``workqueue`` layer run in children too.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
pytest.importorskip("torch")

from tests import hostile_cases, hostile_child, hostile_data_cases  # noqa: E402
from tests.runtime_graphs import BATCH, SHAPE, base_expected, base_model  # noqa: E402
from tests.dense_oracle import make_rng, random_features, random_indices  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
CAP = 3 * 2**30  # address space of a child: about 0.5 GiB after imports, so a default budget of about 1.2 GiB
MEMORY_CASES = ("kernel_81", "padding_300", "subm_kernel_101")
DATA_MEMORY_CASES = ("external_aliased_8gib", "shared_weight_300_nodes")  # tests/hostile_data_cases.py


def _environment(**extra: str) -> dict:
    environment = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
                       OMP_NUM_THREADS="2", OPENBLAS_NUM_THREADS="1")
    environment.pop("SPARSECORE_MEMORY_BUDGET", None)  # the children run under the default budget
    environment.update(extra)
    return environment


@dataclasses.dataclass(frozen=True)
class Run:
    """The zygote's output: per case name its record, per group its exit status; the cases and folders."""

    records: dict
    statuses: dict
    cases: list
    memory: dict
    folder: Path
    stderr: str
    threads: dict


@pytest.fixture(scope="module")
def hostile_run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    """Writes every file, then one zygote process (onnx imported once) forks a capped child per group: all
    the cases that cannot allocate much together, each allocation case alone, the threads alone."""
    folder = tmp_path_factory.mktemp("hostile")
    cases = hostile_cases.write_cases(folder / "grouped")
    memory = {name: hostile_cases.memory_case(folder / name, name) for name in MEMORY_CASES}
    _, alias_indices, alias_features = hostile_cases.case_input(3103)
    aliased_inputs = hostile_cases._save_input(folder, "aliased", alias_features, alias_indices, BATCH, SHAPE)
    memory["external_aliased_8gib"] = hostile_data_cases.aliased_case(
        base_model(make_rng(3104)).model(4, "2"), folder / "aliased", aliased_inputs)
    memory["shared_weight_300_nodes"] = hostile_data_cases.shared_weight_case(folder / "shared")
    rng = make_rng(3130)
    indices = random_indices(rng, SHAPE, BATCH, num=500)
    features = random_features(rng, len(indices), 4).astype(np.float32).astype(np.float64)
    builder = base_model(rng)
    onnx.save(builder.model(4, "2"), str(folder / "threads.onnx"))
    np.savez(folder / "threads.npz", features=features.astype(np.float32), indices=indices)
    threads = {"name": "threads", "file": str(folder / "threads.onnx"), "input": str(folder / "threads.npz"),
               "output": str(folder / "threads.out.npz"), "expected": base_expected(builder, features, indices)}
    groups = [{"name": "grouped", "cap": CAP, "cases": cases}]
    groups += [{"name": name, "cap": CAP, "cases": [case]} for name, case in memory.items()]
    groups.append({"name": "threads", "cap": CAP, "environment": {"NUMBA_THREADING_LAYER": "workqueue",
                                                                  "NUMBA_NUM_THREADS": "2"},
                   "threads": {key: value for key, value in threads.items() if key != "expected"}})
    plan = hostile_cases.write_groups(groups, folder)
    done = subprocess.run([sys.executable, "-c", hostile_child.ZYGOTE, str(plan)], capture_output=True, text=True,
                          timeout=600, env=_environment(), cwd=folder)
    records, statuses = {}, {}
    for line in done.stdout.splitlines():
        if line.startswith("{"):
            record = json.loads(line)
            if "group" in record:
                statuses[record["group"]] = record["status"]
            else:
                records[record["name"]] = record
    return Run(records, statuses, cases, memory, folder, done.stderr, threads)


def _tally(cases: list, records: dict, folder: Path) -> tuple[collections.Counter, list[str]]:
    counts: collections.Counter = collections.Counter()
    failures = []
    for case in cases:
        outcome = hostile_cases.judge(case, records.get(case.name), folder)
        counts[outcome] += 1
        if outcome not in ("clear", "correct"):
            record = records.get(case.name, {})
            failures.append(f"{case.name} ({case.klass}): {outcome}: {record.get('type')}: "
                            f"{str(record.get('message'))[:400]}")
    return counts, failures


def _summary(label: str, cases: list, counts: collections.Counter) -> str:
    classes = collections.Counter(case.klass for case in cases)
    return (f"{label}: {len(cases)} files, " + ", ".join(f"{key} {counts[key]}" for key in hostile_cases.OUTCOMES)
            + "; classes: " + ", ".join(f"{key} {value}" for key, value in sorted(classes.items())))


def test_hostile_onnx_files_give_clear_errors_or_the_oracle_answer(hostile_run: Run) -> None:
    cases = hostile_run.cases
    counts, failures = _tally(cases, hostile_run.records, hostile_run.folder)
    summary = _summary("hostile ONNX files", cases, counts)
    print("\n" + summary)
    assert counts["clear"] + counts["correct"] == len(cases), (
        summary + "\n" + "\n".join(failures) + "\n--- zygote stderr\n" + hostile_run.stderr[-3000:])
    assert hostile_run.statuses.get("grouped") == 0, hostile_run.stderr[-3000:]
    assert counts["correct"] >= 9 and counts["clear"] >= 50, summary


@pytest.mark.parametrize("name", MEMORY_CASES)
def test_sizes_from_a_file_are_refused_before_they_allocate(hostile_run: Run, name: str) -> None:
    case = hostile_run.memory[name]
    outcome = hostile_cases.judge(case, hostile_run.records.get(name), hostile_run.folder)
    assert outcome == "clear", (outcome, hostile_run.records.get(name), hostile_run.statuses.get(name),
                                hostile_run.stderr[-3000:])


@pytest.mark.parametrize("name", DATA_MEMORY_CASES)
def test_aliased_external_data_and_a_shared_weight_stay_within_the_cap(hostile_run: Run, name: str) -> None:
    # before issue 39: onnx read the aliased range 2000 times (8 GiB, SIGSEGV under the cap), and the session kept a
    # float32 copy of the shared weight per node (3.2 GiB here, a MemoryError); now a refusal naming two
    # initializers, and one converted copy giving the oracle's answer
    case = hostile_run.memory[name]
    record = hostile_run.records.get(name)
    outcome = hostile_cases.judge(case, record, hostile_run.folder)
    assert outcome == ("clear" if case.error else "correct"), (
        outcome, record, hostile_run.statuses.get(name), hostile_run.stderr[-3000:])
    # peak RSS of the child: its imports, the file and one converted weight (11 MiB), far below 8 GiB or 3.2 GiB
    assert record["maxrss_kib"] < 2**20, record


def test_four_threads_share_a_session_under_the_workqueue_layer(hostile_run: Run) -> None:
    report = hostile_run.records.get("threads")
    # before the lock: the child died of SIGABRT, "Concurrent access has been detected"
    assert report is not None and hostile_run.statuses.get("threads") == 0, hostile_run.stderr[-3000:]
    assert report["layer"] == "workqueue" and report["equal"] == [True] * 24, report
    sites, values = hostile_run.threads["expected"]
    with np.load(hostile_run.threads["output"]) as out:
        np.testing.assert_array_equal(out["indices"], sites)
        np.testing.assert_allclose(out["features"], values, rtol=1e-4, atol=1e-4)


CHECKPOINTS = textwrap.dedent(r"""
    import json, os, resource, sys, warnings
    resource.setrlimit(resource.RLIMIT_AS, (int(sys.argv[1]), int(sys.argv[1])))
    import numpy as np
    import torch
    import sparsecore.torch as spconv
    rng = np.random.default_rng(3140)
    def case(name, layout, make_layer, weight, expected=None):
        os.environ["SPCONV_SAVED_WEIGHT_LAYOUT"] = layout
        record = {"name": name}
        layer = make_layer()
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                layer.load_state_dict({"weight": weight}, strict=False)
            loaded = layer.weight.detach().numpy()
            record.update(outcome="ran", warnings=[str(w.message) for w in caught],
                          correct=bool(expected is not None and np.array_equal(loaded, expected)))
        except Exception as error:
            record.update(outcome="error", type=type(error).__name__, message=str(error))
        print(json.dumps(record), flush=True)
    w = rng.standard_normal((4, 3, 2, 1, 5)).astype(np.float32)  # [out, *k, in]
    wide = lambda: spconv.SparseConv3d(5, 4, (3, 2, 1), bias=False)
    case("rskc_valid", "RSKC", wide, torch.from_numpy(np.ascontiguousarray(w.transpose(1, 2, 3, 0, 4))), w)
    case("rsck_valid", "RSCK", wide, torch.from_numpy(np.ascontiguousarray(w.transpose(1, 2, 3, 4, 0))), w)
    case("rskc_2d", "RSKC", wide, torch.zeros(4, 30))
    case("rskc_numpy", "RSKC", wide, np.ascontiguousarray(w.transpose(1, 2, 3, 0, 4)))
    case("rskc_given_krsc", "RSKC", wide, torch.from_numpy(w))
    case("rsck_wrong_kernel", "RSCK", wide, torch.zeros(3, 3, 3, 5, 4))
    cube = rng.standard_normal((3, 3, 3, 3, 3)).astype(np.float32)
    case("rskc_ambiguous", "RSKC", lambda: spconv.SubMConv3d(3, 3, 3, bias=False), torch.from_numpy(cube),
         np.ascontiguousarray(cube.transpose(3, 0, 1, 2, 4)))
    # issue 39: values torch copies silently, and layouts mistaken for spconv's (strict and loose loads)
    def values(name, key, value, strict, environment="", expected=None):
        os.environ.update(SPARSECORE_CHECKPOINT_CHECKS=environment, SPCONV_SAVED_WEIGHT_LAYOUT="")
        layer = spconv.SubMConv3d(4, 5, 3, bias=True, indice_key="k")
        state = {k: v.clone() for k, v in layer.state_dict().items()}
        state[key] = value
        record = {"name": name}
        try:
            layer.load_state_dict(state, strict=strict)
            loaded = getattr(layer, key.split(".")[-1]).detach().numpy()
            record.update(outcome="ran", warnings=[], correct=bool(
                expected is not None and np.array_equal(loaded, expected, equal_nan=True)))
        except Exception as error:
            record.update(outcome="error", type=type(error).__name__, message=str(error))
        os.environ["SPARSECORE_CHECKPOINT_CHECKS"] = ""
        print(json.dumps(record), flush=True)
    w = rng.standard_normal((5, 3, 3, 3, 4)).astype(np.float32)
    nan = w.copy(); nan[1, 2, 0, 1, 3] = np.nan
    values("nan_weight_strict", "weight", torch.from_numpy(nan), True)
    values("nan_weight_loose", "weight", torch.from_numpy(nan), False)
    values("inf_bias", "bias", torch.tensor([0.0, -np.inf, 1.0, 2.0, 3.0]), True)
    values("int_weight", "weight", torch.from_numpy((w * 10).astype(np.int64)), True)
    values("bool_bias", "bias", torch.tensor([True, False, True, True, False]), False)
    values("nan_weight_switch_off", "weight", torch.from_numpy(nan), True, "off", nan)
    values("torch_dense_layout", "weight", torch.from_numpy(np.ascontiguousarray(w.transpose(0, 4, 1, 2, 3))), True)
    pointwise = rng.standard_normal((6, 1, 1, 1, 4)).astype(np.float32)
    one = lambda: spconv.SubMConv3d(4, 6, 1, bias=False)
    case("transposed_1x1", "", one, torch.from_numpy(np.ascontiguousarray(pointwise.transpose(4, 1, 2, 3, 0))))
    case("spconv_1x1", "", one, torch.from_numpy(pointwise), pointwise)
""")

CHECKPOINT_EXPECTED = {
    "rskc_valid": None, "rsck_valid": None,
    "rskc_2d": ("ValueError", r"state_dict\['weight'\] has shape \[4, 30\] \(2-D\).*RSKC.*\[3, 2, 1, 4, 5\]"),
    "rskc_numpy": ("TypeError", r"state_dict\['weight'\] is a numpy.ndarray, not a torch.Tensor"),
    "rskc_given_krsc": ("ValueError", r"state_dict\['weight'\] has shape \[4, 3, 2, 1, 5\]: the layout \[out, "
                                      r"\*kernel, in\].*unset the variable"),
    "rsck_wrong_kernel": ("ValueError", r"state_dict\['weight'\] has shape \[3, 3, 3, 5, 4\].*RSCK.*\[3, 2, 1, 5, 4\]"),
    "rskc_ambiguous": "warning",
    "nan_weight_strict": ("ValueError", r"state_dict\['weight'\] holds 1 non-finite value\(s\) of 540 \(first: nan at "
                                        r"\[1, 2, 0, 1, 3\]\).*SPARSECORE_CHECKPOINT_CHECKS=off"),
    "nan_weight_loose": ("ValueError", r"state_dict\['weight'\] holds 1 non-finite value"),
    "inf_bias": ("ValueError", r"state_dict\['bias'\] holds 1 non-finite value\(s\) of 5 \(first: -inf at \[1\]\)"),
    "int_weight": ("TypeError", r"state_dict\['weight'\] has dtype torch.int64, but SubMConv3d.weight is a "
                                r"torch.float32 parameter"),
    "bool_bias": ("TypeError", r"state_dict\['bias'\] has dtype torch.bool"),
    "nan_weight_switch_off": None,
    "torch_dense_layout": ("ValueError", r"state_dict\['weight'\] has shape \[5, 4, 3, 3, 3\]: torch's dense layout "
                                         r"\[out, in, \*kernel\].*weight.permute\(0, 2, 3, 4, 1\)"),
    "transposed_1x1": ("ValueError", r"state_dict\['weight'\] has shape \[4, 1, 1, 1, 6\]: a 1x1 weight saved "
                                     r"transposed.*weight.view\(in, out\)"),
    "spconv_1x1": None,
}


def test_hostile_checkpoints_name_the_key(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-c", CHECKPOINTS, str(6 * 2**30)], capture_output=True, text=True,
                          timeout=300, env=_environment(), cwd=tmp_path)
    records = {json.loads(line)["name"]: json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")}
    counts: collections.Counter = collections.Counter()
    for name, expected in CHECKPOINT_EXPECTED.items():
        record = records.get(name)
        if record is None:
            outcome = "crash"
        elif expected == "warning":  # loaded as the layout asks, with a warning naming the key
            outcome = "clear" if record.get("correct") and any(
                "state_dict['weight']" in text and "both the RSKC layout" in text for text in record["warnings"]) \
                else "silent"
        elif expected is None:
            outcome = "correct" if record.get("correct") and not record.get("warnings") else "silent"
        elif record["outcome"] != "error":
            outcome = "silent"
        else:
            outcome = "clear" if record["type"] == expected[0] and re.search(expected[1], record["message"]) \
                else "obscure"
        counts[outcome] += 1
        assert outcome in ("clear", "correct"), (name, outcome, record, done.stderr[-2000:])
    print(f"\nhostile checkpoints: {len(CHECKPOINT_EXPECTED)} cases, "
          + ", ".join(f"{key} {counts[key]}" for key in hostile_cases.OUTCOMES))


# ----------------------------------------------------------------------------- programs (.pt2, load_program)

class _DenseNet(__import__("sparsecore.torch", fromlist=["SparseSequential"]).SparseSequential):
    """subm conv + BatchNorm + ReLU, a strided conv, then .dense(): the pieces the hostile programs edit."""

    def forward(self, x):  # noqa: D102 - the sequential's forward, densified
        return super().forward(x).dense()


def test_hostile_programs_are_refused_before_anything_runs(tmp_path: Path) -> None:
    import torch

    import sparsecore.torch as spconv
    from sparsecore.torch.exportable import sites_dynamic_shapes
    from tests import hostile_programs

    torch.manual_seed(3901)
    model = _DenseNet(spconv.SubMConv3d(4, 8, 3, indice_key="a"), torch.nn.BatchNorm1d(8), torch.nn.ReLU(),
                      spconv.SparseConv3d(8, 8, 3, stride=2, padding=1, bias=False)).eval()
    with torch.no_grad():
        model[1].running_mean.uniform_(-0.5, 0.5)
        model[1].running_var.uniform_(0.5, 1.5)
    rng = make_rng(3902)
    indices = random_indices(rng, (24, 24, 24), 1, num=300)
    features = random_features(rng, len(indices), 4).astype(np.float32)
    example = spconv.SparseConvTensor(torch.from_numpy(features), torch.from_numpy(indices), [24, 24, 24], 1)
    source = tmp_path / "valid.pt2"
    torch.export.save(torch.export.export(model, (example,), dynamic_shapes=(sites_dynamic_shapes(),)), source)
    other = random_indices(rng, (24, 24, 24), 1, num=260)  # other sites than the example's: a fresh input
    other_features = random_features(rng, len(other), 4).astype(np.float32)
    np.savez(tmp_path / "input.npz", features=other_features, indices=other, shape=np.array([24, 24, 24]), batch=1)
    with torch.no_grad():
        expected = model(spconv.SparseConvTensor(torch.from_numpy(other_features), torch.from_numpy(other),
                                                 [24, 24, 24], 1)).numpy()
    marker = tmp_path / "code_ran"
    cases = hostile_programs.write_program_cases(source, tmp_path, marker)
    plan = tmp_path / "programs.json"
    oracles = [{"name": "torch_oracle_two_archives", "marker": str(tmp_path / "torch_ran_two_archives"),
                "file": str(hostile_programs.two_archives(source, tmp_path / "twin.pt2",
                                                          tmp_path / "torch_ran_two_archives"))},
               {"name": "torch_oracle_sympy", "marker": str(tmp_path / "torch_ran_sympy"),
                "file": str(hostile_programs.sympy_injection(source, tmp_path / "twin_sympy.pt2",
                                                             tmp_path / "torch_ran_sympy"))}]
    plan.write_text(json.dumps({"input": str(tmp_path / "input.npz"), "torch_oracles": oracles, "cases": [
        {"name": name, "file": file, "output": str(tmp_path / f"{name}.out.npy")} for name, file, _ in cases]}))
    done = subprocess.run([sys.executable, "-c", hostile_programs.CHILD, str(plan), str(CAP)], capture_output=True,
                          text=True, timeout=300, env=_environment(), cwd=tmp_path)
    records = {json.loads(line)["name"]: json.loads(line) for line in done.stdout.splitlines()
               if line.startswith("{")}
    counts: collections.Counter = collections.Counter()
    failures = []
    for name, _, error in cases:
        record = records.get(name)
        if record is None:
            outcome = "crash"
        elif record["outcome"] == "error":
            outcome = "blow-up" if record["raw_memory"] else "obscure" if error is None else (
                "clear" if record["type"] == error[0] and re.search(error[1], record["message"], re.S) else "obscure")
        elif error is not None:
            outcome = "silent"
        else:
            got = np.load(tmp_path / f"{name}.out.npy")
            outcome = "correct" if np.allclose(got, expected, rtol=1e-5, atol=1e-5) else "silent"
        counts[outcome] += 1
        if outcome not in ("clear", "correct"):
            failures.append(f"{name}: {outcome}: {record}")
    summary = f"hostile programs: {len(cases)} files, " + ", ".join(
        f"{key} {counts[key]}" for key in hostile_cases.OUTCOMES)
    print("\n" + summary)
    assert not marker.exists(), "a hostile program ran code while loading"
    for oracle in oracles:  # torch.export.load runs the code of each twin: the cases are exploits
        assert records.pop(oracle["name"])["marker"] and Path(oracle["marker"]).exists(), oracle
    assert not failures, summary + "\n" + "\n".join(failures) + "\n--- child stderr\n" + done.stderr[-3000:]
    assert np.abs(expected).max() > 0.1
    # every refusal came at load, without inflating the bomb or allocating the new_zeros: peak RSS stays far below
    # the 3.5 GiB member and the 11.8 GB allocation (the child's imports take about 0.5 GiB)
    assert max(record["maxrss_kib"] for record in records.values()) < 1.5 * 2**20, records
