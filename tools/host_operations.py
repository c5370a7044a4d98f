"""How many host operations the GPU path issues, counted on the CPU emulation (no GPU needed).

On a GPU every array operation costs host time (about 20 us of CuPy on the H200
of 2026-12-04, docs/performance.md), so the forward of spconv's basic network is
bound by how many it issues, not by the device. This counts them without a
GPU: the network runs on the emulated kernel backend (the CUDA kernels compiled
by g++, tests/cuda_emulation) with `DeviceArray` inputs, and every operation
that would be a CuPy call is counted per stage (rulebooks, convolution, pool):

- ``launch``: a kernel launch; ``matmul``: a backend GEMM (one cuBLAS call on the GPU);
- ``xp``: a call of the array library (``xp.empty``, ``xp.ascontiguousarray``...);
- ``ufunc`` / ``method``: arithmetic or an array method (``astype``, ``argsort``...);
- ``index``: indexing that makes a view or a copy;
- ``read``: a read of device data back to the host (``int(x)``, ``x.get()``,
  ``xp.asnumpy``, a data-sized function such as ``xp.unique``...): on a GPU
  each one waits for every launch queued before it, so the host stops
  running ahead of the device. Counted where `tests.cuda_emulation`'s
  `forbid_host_reads` would refuse it (the same hook).

Cheap and dear operations count alike (an ``ascontiguousarray`` of a contiguous
array returns it at once on CuPy; an allocation or a launch costs microseconds),
so read the totals as an upper bound and the call sites (``--sites``) for what
to cut. Run from the repository root (needs g++, as the emulated tests do):

    python tools/host_operations.py [--scene synthetic|basic] [--sites 30]

No assertion: a measurement for docs/performance.md. Compare counts of one
scene between commits.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Iterator

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import numpy as np  # noqa: E402

from sparsecore import _dispatch, backends  # noqa: E402
from sparsecore.benchmark import network  # noqa: E402
from tests.cuda_emulation import device_arrays  # noqa: E402
from tests.kernel_targets import emulated_backend  # noqa: E402

_INTERNAL_FILES = frozenset({__file__, device_arrays.__file__})
_METHODS = ("astype", "take", "copy", "sum", "cumsum", "argsort", "max", "min", "fill", "ravel", "any", "all")


class _Tally:
    """Counts per (stage, kind) and per call site; `interval` is the network's recorder protocol."""

    def __init__(self) -> None:
        self.kinds: Counter = Counter()
        self.sites: Counter = Counter()
        self.stages = ["outside the layers"]
        self.paused = 0  # inside the emulation's own GEMM: not counted

    def add(self, kind: str, what: str) -> None:
        """Counts one operation at its call site: the first frame outside this tool, the emulation and NumPy."""
        if self.paused:
            return
        stage = self.stages[-1]
        self.kinds[(stage, kind)] += 1
        frame = sys._getframe(1)
        while frame.f_code.co_filename in _INTERNAL_FILES or "/numpy/" in frame.f_code.co_filename:
            frame = frame.f_back
        where = frame.f_code.co_filename.split("sparsecore/")[-1].split("site-packages/")[-1]
        self.sites[f"{stage}: {what} at {where}:{frame.f_lineno}"] += 1

    @contextlib.contextmanager
    def interval(self, label: str) -> Iterator[None]:
        stage = label in ("rulebooks", "convolution", "pool")
        if stage:
            self.stages.append(label)
        try:
            yield
        finally:
            if stage:
                self.stages.pop()


@contextlib.contextmanager
def _counting(tally: _Tally, backend: Any) -> Iterator[None]:
    """Wraps the device array library, the device arrays, the launcher and the backend's GEMM."""
    patches: list[tuple[Any, str, Any]] = []

    def patch(owner: Any, name: str, replacement: Any) -> None:
        patches.append((owner, name, owner.__dict__.get(name)))
        setattr(owner, name, replacement)

    library_getattr = device_arrays._DeviceNumpy.__getattr__

    def counted_getattr(self: Any, name: str) -> Any:
        attribute = library_getattr(self, name)
        if not callable(attribute) or isinstance(attribute, (type, np.ufunc)):
            return attribute

        def call(*args: Any, **kwargs: Any) -> Any:
            tally.add("xp", f"xp.{name}")
            return attribute(*args, **kwargs)

        return call

    def counted_ufunc(self: Any, ufunc: Any, method: str, *inputs: Any, **kwargs: Any) -> Any:
        tally.add("ufunc", f"ufunc {ufunc.__name__}")
        plain = tuple(np.asarray(item) if isinstance(item, device_arrays.DeviceArray) else item for item in inputs)
        if "out" in kwargs:
            kwargs["out"] = tuple(np.asarray(item) if isinstance(item, device_arrays.DeviceArray) else item
                                  for item in kwargs["out"])
        return device_arrays._to_device(getattr(ufunc, method)(*plain, **kwargs))

    def counted_method(name: str) -> Callable[..., Any]:
        original = getattr(np.ndarray, name)

        def method(self: Any, *args: Any, **kwargs: Any) -> Any:
            tally.add("method", f".{name}")
            if name == "fill":
                return original(self, *args, **kwargs)
            return device_arrays._to_device(original(np.asarray(self), *args, **kwargs))

        return method

    getitem = device_arrays.DeviceArray.__getitem__

    def counted_getitem(self: Any, key: Any) -> Any:
        tally.add("index", "[...]")
        return getitem(self, key)

    def counted_setitem(self: Any, key: Any, value: Any) -> None:
        tally.add("index", "[...] =")
        np.ndarray.__setitem__(self, key, value)

    launcher_type = type(backend.launcher)
    launch = launcher_type.launch

    def counted_launch(self: Any, expression: str, grid: int, block: int, args: tuple[Any, ...]) -> None:
        tally.add("launch", expression.split("<")[0])
        launch(self, expression, grid, block, args)

    backend_type = type(backend)
    matmul = backend_type.matmul

    def counted_matmul(self: Any, left: Any, right: Any) -> Any:
        tally.add("matmul", "matmul")
        with _silenced(tally):  # the emulation's GEMM is NumPy's: on the GPU it is one cuBLAS call
            return matmul(self, left, right)

    refuse = device_arrays._refuse

    def counted_refuse(what: str) -> None:
        tally.add("read", what)
        refuse(what)

    patch(device_arrays, "_refuse", counted_refuse)
    patch(device_arrays._DeviceNumpy, "__getattr__", counted_getattr)
    patch(device_arrays.DeviceArray, "__array_ufunc__", counted_ufunc)
    for name in _METHODS:
        patch(device_arrays.DeviceArray, name, counted_method(name))
    patch(device_arrays.DeviceArray, "__getitem__", counted_getitem)
    patch(device_arrays.DeviceArray, "__setitem__", counted_setitem)
    patch(launcher_type, "launch", counted_launch)
    patch(backend_type, "matmul", counted_matmul)
    try:
        yield
    finally:
        for owner, name, previous in reversed(patches):
            if previous is None:
                delattr(owner, name)
            else:
                setattr(owner, name, previous)


@contextlib.contextmanager
def _silenced(tally: _Tally) -> Iterator[None]:
    tally.paused += 1
    try:
        yield
    finally:
        tally.paused -= 1


@contextlib.contextmanager
def _device_dispatch(backend: Any) -> Iterator[None]:
    """Makes the core route `DeviceArray` inputs to ``backend`` (as it routes CuPy arrays to the GPU)."""
    array_module, backend_for = _dispatch.array_module, backends.backend_for

    def device_array_module(value: Any) -> Any:
        return device_arrays.DEVICE_NUMPY if isinstance(value, device_arrays.DeviceArray) else array_module(value)

    def device_backend_for(array: Any) -> Any:
        return backend if isinstance(array, device_arrays.DeviceArray) else backend_for(array)

    replaced = []
    for name, module in list(sys.modules.items()):
        if not name.startswith("sparsecore"):
            continue
        for attribute, original, replacement in (("array_module", array_module, device_array_module),
                                                 ("backend_for", backend_for, device_backend_for)):
            if getattr(module, attribute, None) is original:
                setattr(module, attribute, replacement)
                replaced.append((module, attribute, original))
    try:
        yield
    finally:
        for module, attribute, original in replaced:
            setattr(module, attribute, original)


def _report(title: str, tally: _Tally, sites: int) -> list[str]:
    lines = [f"{title}:"]
    stages = sorted({stage for stage, _ in tally.kinds})
    for stage in stages:
        kinds = {kind: count for (where, kind), count in sorted(tally.kinds.items()) if where == stage}
        described = ", ".join(f"{count} {kind}" for kind, count in kinds.items())
        lines.append(f"  {stage}: {sum(kinds.values())} ({described})")
    lines.append(f"  total: {sum(tally.kinds.values())}")
    if sites:
        lines.append("  top call sites:")
        lines += [f"    {count:5d}  {site}" for site, count in tally.sites.most_common(sites)]
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scene", default="synthetic", choices=("synthetic", "basic"),
                        help="synthetic: the small synthetic scene (seconds); basic: the real 125k-voxel scan")
    parser.add_argument("--sites", type=int, default=25, help="call sites to list per pass (0: none)")
    args = parser.parse_args(argv)

    backend = device_arrays.device_backend(emulated_backend())
    scene = network.network_scene(args.scene, "small")
    layers = network.REFERENCE_NETWORK
    generator = np.random.default_rng(0)
    weights = tuple(None if weight is None else device_arrays.to_device(weight)
                    for weight in network.network_weights(layers, 0))
    features = device_arrays.to_device(generator.standard_normal((len(scene.indices), 3)).astype(np.float32))
    indices = device_arrays.to_device(scene.indices.astype(np.int32))
    lines = [f"scene {args.scene}: {len(scene.indices)} sites; spconv's basic network "
             f"({sum(layer.kind == 'subm' for layer in layers)} convolutions, "
             f"{sum(layer.kind != 'subm' for layer in layers)} pools) on the emulated kernel backend"]
    with _device_dispatch(backend):
        network.core_forward(features, indices, scene.spatial_shape, weights, layers, backend=backend)  # compiles
        forward, backward = _Tally(), _Tally()
        with _counting(forward, backend):
            state = network.core_forward(features, indices, scene.spatial_shape, weights, layers, recorder=forward,
                                         backend=backend)
        grad = device_arrays.to_device(generator.standard_normal(np.asarray(state.output).shape).astype(np.float32))
        with _counting(backward, backend):
            network.core_backward(state, grad, weights, layers, recorder=backward, backend=backend)
    lines += _report("forward (rulebooks built)", forward, args.sites)
    lines += _report("backward", backward, args.sites)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
