"""The child program of the hostile-model runs (tests/test_hostile_models.py runs it with ``python -c``).

`ZYGOTE` imports onnx and sparsecore.runtime once, then forks one child per group of cases
(tests/hostile_cases.py writes the plan): each child caps its own address space, runs its cases and
prints one JSON record per case.
"""

ZYGOTE = r'''
# Imports onnx and sparsecore.runtime once (neither starts a thread), then forks one child per group: each sets
# its own RLIMIT_AS and environment, runs its cases and prints one JSON record per case; a child that dies is
# reported with its exit status.
import json, os, resource, sys, threading
import numpy as np
import onnx, onnx.checker
import sparsecore.runtime as runtime
from sparsecore.memory_budget import MemoryBudgetError


def run_cases(cases):
    for case in cases:
        record = {"name": case["name"]}
        try:
            session = runtime.load(case["file"], **case["load"])
            data = np.load(case["input"])
            out = session.run(data["features"], data["indices"], int(data["batch"]), tuple(data["shape"].tolist()))
            if out.dense is not None:
                np.savez(case["output"], dense=out.dense)
            else:
                np.savez(case["output"], features=out.sparse.features, indices=out.sparse.indices)
            record["outcome"] = "ran"
        except BaseException as error:
            raw_memory = isinstance(error, MemoryError) and not isinstance(error, MemoryBudgetError)
            record.update(outcome="error", type=type(error).__name__, message=str(error), raw_memory=raw_memory)
        record["maxrss_kib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        print(json.dumps(record), flush=True)


def run_threads(spec):
    import numba
    import sparsecore as sc
    data = np.load(spec["input"])
    session = runtime.load(spec["file"])
    first = session.run(data["features"], data["indices"], 2, (9, 11, 7)).sparse
    results = []

    def work():
        for _ in range(4):
            out = session.run(data["features"], data["indices"], 2, (9, 11, 7)).sparse
            results.append(bool(np.array_equal(out.features, first.features)
                                and np.array_equal(out.indices, first.indices)))
    # the core's entry points without a session, on a cloud large enough for the compiled (numba) passes
    generator = np.random.default_rng(3131)
    grid = (40, 40, 40)
    cells = generator.choice(2 * 40 ** 3, size=30000, replace=False)
    sites = np.stack(np.unravel_index(cells, (2, *grid)), axis=1).astype(np.int32)
    geometry = sc.ConvGeometry.create(3, 3, 2, 1, kind="regular")
    weight = generator.standard_normal((16, 3, 3, 3, 16)).astype(np.float32)
    features = generator.standard_normal((len(sites), 16)).astype(np.float32)

    def core_once():
        rulebook = sc.build_rulebook(sites, grid, 2, geometry)
        out = sc.conv_forward(features, weight, rulebook)
        inverse = sc.inverse_rulebook(rulebook)  # the output sites pooled back onto the input sites
        pooled, argmax = sc.max_pool_forward(out, inverse)
        return out, pooled, sc.max_pool_backward(pooled, argmax, rulebook.num_output, rulebook=inverse)
    single = core_once()

    def core():
        for _ in range(4):
            results.append(all(bool(np.array_equal(a, b)) for a, b in zip(core_once(), single)))
    threads = [threading.Thread(target=work) for _ in range(4)] + [threading.Thread(target=core) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    np.savez(spec["output"], features=first.features, indices=first.indices)
    print(json.dumps({"name": spec["name"], "layer": numba.threading_layer(), "equal": results}), flush=True)


for group in json.load(open(sys.argv[1])):
    pid = os.fork()
    if pid == 0:
        try:
            resource.setrlimit(resource.RLIMIT_AS, (group["cap"], group["cap"]))
            os.environ.update(group.get("environment", {}))
            run_threads(group["threads"]) if "threads" in group else run_cases(group["cases"])
        finally:
            sys.stdout.flush()
            os._exit(0)
    _, status = os.waitpid(pid, 0)
    print(json.dumps({"group": group["name"], "status": status}), flush=True)
'''
