"""The counting engine of tools/host_operations.py: every operation the host issues, per layer and stage.

The same machinery counts on the CPU emulation (`DeviceArray` on NumPy, the
kernels compiled by g++) and on a real GPU (CuPy arrays), so the two counts
can be compared line by line:

- the array library the core sees (``xp``) is wrapped by `CountingLibrary`:
  every call of one of its functions is one operation (``xp``; ``ufunc`` for
  its ufuncs; ``read`` for the functions whose result size depends on the data,
  which read back to the host on a GPU);
- the array type's operators (``ufunc``), a few methods (``method``),
  indexing (``index``; a boolean mask is a ``read``) and host conversions
  (``int()``, ``.get()``, ``.tolist()``, ``.item()``...: ``read``) are wrapped;
- the backend's launcher counts ``launch`` (one kernel launch), and
  ``backend.matmul`` counts ``matmul`` (one cuBLAS call on the GPU).

Only the outermost operation counts: what a counted call does inside
(CuPy's and NumPy's own Python, the emulation's GEMM and launch harness) is
not counted again. Each operation is charged to the current layer (the
network's recorder labels ``forward <i>`` / ``backward <i>``) and stage
(``rulebooks``, ``convolution``, ``pool``), and to its call site (the first
frame outside this engine, the emulation and the array libraries).

``skip_feature_kernels``: launches of the feature kernels (every instantiation
for a floating-point storage type: convolution, pooling, gathers) are counted
but not run. The counts do not depend on feature values, and the geometry
kernels (hashing, maps, compaction) still run, so the real scan counts in
minutes instead of tens of minutes on the emulation. Results are then garbage.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
from collections import Counter
from typing import Any, Callable, Iterator

__all__ = ["FEATURE_TYPE_NAMES", "is_feature_kernel", "Tally", "CountingLibrary", "counting", "routed", "OUTSIDE",
           "STAGES"]

OUTSIDE = "outside the layers"
STAGES = ("rulebooks", "convolution", "pool")
FEATURE_TYPE_NAMES = frozenset({"float", "double", "__half", "__nv_bfloat16"})
_OPERATORS = (
    "__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__", "__truediv__", "__rtruediv__",
    "__floordiv__", "__rfloordiv__", "__mod__", "__rmod__", "__pow__", "__rpow__", "__matmul__", "__rmatmul__",
    "__and__", "__rand__", "__or__", "__ror__", "__xor__", "__rxor__", "__lshift__", "__rlshift__",
    "__rshift__", "__rrshift__", "__neg__", "__pos__", "__abs__", "__invert__",
    "__lt__", "__le__", "__gt__", "__ge__", "__eq__", "__ne__",
    "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__", "__imod__", "__ipow__",
    "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__",
)
_METHODS = ("astype", "take", "copy", "sum", "cumsum", "argsort", "sort", "max", "min", "argmax", "argmin",
            "fill", "ravel", "flatten", "any", "all", "clip", "dot", "mean", "prod", "put")
_READS = ("__int__", "__float__", "__index__", "__complex__", "__bool__", "__iter__", "item", "tolist", "get",
          "nonzero")
# library functions whose result size depends on the data: CuPy reads back to size it
DATA_SIZED = frozenset({"bincount", "nonzero", "flatnonzero", "argwhere", "unique", "unique_values",
                        "unique_counts", "unique_inverse", "unique_all", "compress", "extract", "histogram",
                        "asnumpy", "array_equal", "allclose", "array_equiv", "setdiff1d", "union1d",
                        "intersect1d", "in1d", "isin", "trim_zeros"})
_INTERNAL_PARTS = ("/numpy/", "/cupy/", "/cupy_backends/", "/cuda_emulation/", "/contextlib.py",
                   "backends/_launch.py")


def is_feature_kernel(expression: str) -> bool:
    """Whether a kernel name expression is instantiated for a floating-point storage type (a feature pass).

    ``"sc_gather_rows<__half>"`` is one; ``"sc_hash_insert<long long>"`` and
    ``"sc_compact_count"`` (geometry) are not.
    """
    if "<" not in expression:
        return False
    arguments = expression.split("<", 1)[1].rsplit(">", 1)[0]
    return any(part.strip() in FEATURE_TYPE_NAMES for part in arguments.split(","))


class Tally:
    """Operations per (layer, stage, kind) and per call site; `interval` is the network's recorder protocol.

    Attributes:
        counts: ``(pass, layer label, stage, kind) -> operations``; the layer label is
            ``"forward <i>"`` / ``"backward <i>"`` or `OUTSIDE`, the stage one of
            `STAGES` or ``"other"``.
        sites: ``(pass, layer label, stage, "<what> at <file>:<line>") -> operations``.
        pass_name: the pass being counted (``"forward"``, ``"backward"``), None while
            nothing is counted (set-up, warm-up: operations run uncounted).
        depth: operations in progress (only the outermost one counts).
    """

    def __init__(self, internal_files: tuple[str, ...] = ()) -> None:
        self.counts: Counter = Counter()
        self.sites: Counter = Counter()
        self.pass_name: str | None = None
        self.layers = [OUTSIDE]
        self.stages = ["other"]
        self.depth = 0
        self.internal_files = frozenset((__file__, *internal_files))

    def add(self, kind: str, what: str) -> None:
        """Counts one operation at its call site (the first frame outside the engine and the libraries)."""
        layer, stage = self.layers[-1], self.stages[-1]
        self.counts[(self.pass_name, layer, stage, kind)] += 1
        frame = sys._getframe(1)
        while frame.f_back is not None and (frame.f_code.co_filename in self.internal_files
                                            or any(part in frame.f_code.co_filename for part in _INTERNAL_PARTS)):
            frame = frame.f_back
        where = frame.f_code.co_filename.split("sparsecore/")[-1].split("site-packages/")[-1]
        self.sites[(self.pass_name, layer, stage, f"{what} at {where}:{frame.f_lineno}")] += 1

    def counted(self, kind: str, what: str, function: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        """Runs ``function``; counts it when a pass is being counted and no other counted operation is in
        progress."""
        if self.depth == 0 and self.pass_name is not None:
            self.add(kind, what)
        self.depth += 1
        try:
            return function(*args, **kwargs)
        finally:
            self.depth -= 1

    @contextlib.contextmanager
    def interval(self, label: str) -> Iterator[None]:
        """Enters a layer (``forward <i>``, ``backward <i>``) or a stage; other labels are ignored."""
        if label.startswith(("forward ", "backward ")):
            stack = self.layers
        elif label in STAGES:
            stack = self.stages
        else:
            yield
            return
        stack.append(label)
        try:
            yield
        finally:
            stack.pop()


def _is_ufunc(attribute: Any) -> bool:
    return hasattr(attribute, "nin") and hasattr(attribute, "nout")


class _CountedUfunc:
    """A library ufunc whose calls (and ``reduce``, ``at``...) count as ``ufunc`` operations."""

    def __init__(self, tally: Tally, name: str, ufunc: Any) -> None:
        self._tally, self._name, self._ufunc = tally, name, ufunc

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._tally.counted("ufunc", f"xp.{self._name}", self._ufunc, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self._ufunc, name)
        if not callable(attribute):
            return attribute
        return lambda *args, **kwargs: self._tally.counted("ufunc", f"xp.{self._name}.{name}", attribute,
                                                           *args, **kwargs)


@dataclasses.dataclass(frozen=True, eq=False)
class CountingLibrary:
    """An array library (``cupy``, or the emulation's device NumPy) whose function calls are counted.

    Attributes, types, dtypes and modules pass through unchanged.
    """

    library: Any
    tally: Tally

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self.library, name)
        if isinstance(attribute, type) or not callable(attribute):
            return attribute
        if _is_ufunc(attribute):
            return _CountedUfunc(self.tally, name, attribute)
        kind = "read" if name in DATA_SIZED else "xp"
        return lambda *args, **kwargs: self.tally.counted(kind, f"xp.{name}", attribute, *args, **kwargs)


def _is_boolean_key(key: Any) -> bool:
    keys = key if isinstance(key, tuple) else (key,)
    return any(getattr(item, "dtype", None) is not None and getattr(item, "ndim", 0) > 0
               and getattr(item.dtype, "kind", "") == "b" for item in keys)


@contextlib.contextmanager
def counting(tally: Tally, backend: Any, array_type: type, skip_feature_kernels: bool = False,
             ufunc_override: Callable[..., Any] | None = None) -> Iterator[None]:
    """Counts the operations on ``array_type`` and through ``backend`` inside the block.

    Args:
        tally: where the counts go.
        backend: a `KernelBackend` whose ``xp`` is a `CountingLibrary` on ``tally``
            (its launcher's class and its class's ``matmul`` are wrapped).
        array_type: the device array type (``cupy.ndarray``, or the emulation's
            ``DeviceArray``); its operators, some methods, indexing and host
            conversions are wrapped (it must be a Python-level class).
        skip_feature_kernels: count the `is_feature_kernel` launches without running them.
        ufunc_override: an ``__array_ufunc__`` for ``array_type`` that runs a ufunc
            without recursing into the wrapper (the emulation's `DeviceArray` needs
            one: NumPy's default refuses subclasses that override it); None to
            leave the type's own.
    """
    patches: list[tuple[Any, str, Any]] = []

    def patch(owner: Any, name: str, replacement: Any) -> None:
        patches.append((owner, name, owner.__dict__.get(name, _ABSENT)))
        setattr(owner, name, replacement)

    def wrap(kind: str, what: str, original: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            return tally.counted(kind, what, original, *args, **kwargs)

        return wrapper

    for name in _OPERATORS:
        if hasattr(array_type, name):
            patch(array_type, name, wrap("ufunc", name.strip("_"), getattr(array_type, name)))
    for name in _METHODS:
        if hasattr(array_type, name):
            patch(array_type, name, wrap("method", f".{name}", getattr(array_type, name)))
    for name in _READS:
        if hasattr(array_type, name):
            patch(array_type, name, wrap("read", name.strip("_") if name.startswith("_") else f".{name}",
                                         getattr(array_type, name)))
    original_repeat = getattr(array_type, "repeat", None)
    if original_repeat is not None:
        def repeat(self: Any, repeats: Any, *args: Any, **kwargs: Any) -> Any:
            by_array = getattr(repeats, "ndim", 0) > 0
            return tally.counted("read" if by_array else "method", ".repeat", original_repeat, self, repeats,
                                 *args, **kwargs)

        patch(array_type, "repeat", repeat)
    getitem, setitem = array_type.__getitem__, array_type.__setitem__

    def counted_getitem(self: Any, key: Any) -> Any:
        kind = "read" if _is_boolean_key(key) else "index"
        return tally.counted(kind, "[...]", getitem, self, key)

    def counted_setitem(self: Any, key: Any, value: Any) -> None:
        tally.counted("read" if _is_boolean_key(key) else "index", "[...] =", setitem, self, key, value)

    patch(array_type, "__getitem__", counted_getitem)
    patch(array_type, "__setitem__", counted_setitem)
    if ufunc_override is not None:
        def counted_ufunc(self: Any, ufunc: Any, method: str, *inputs: Any, **kwargs: Any) -> Any:
            return tally.counted("ufunc", f"ufunc {ufunc.__name__}", ufunc_override, self, ufunc, method, *inputs,
                                 **kwargs)

        patch(array_type, "__array_ufunc__", counted_ufunc)

    launcher_type = type(backend.launcher)
    launch = launcher_type.launch

    def counted_launch(self: Any, expression: str, grid: int, block: int, args: tuple[Any, ...]) -> None:
        run = not (skip_feature_kernels and is_feature_kernel(expression))
        tally.counted("launch", expression.split("<")[0], launch if run else _no_launch, self, expression, grid,
                      block, args)

    backend_type = type(backend)
    matmul = backend_type.matmul

    def counted_matmul(self: Any, *args: Any, **kwargs: Any) -> Any:
        return tally.counted("matmul", "matmul", matmul, self, *args, **kwargs)

    patch(launcher_type, "launch", counted_launch)
    patch(backend_type, "matmul", counted_matmul)
    try:
        yield
    finally:
        for owner, name, previous in reversed(patches):
            if previous is _ABSENT:
                delattr(owner, name)
            else:
                setattr(owner, name, previous)


_ABSENT = object()


@contextlib.contextmanager
def routed(is_device: Callable[[Any], bool], library: Any, backend: Any) -> Iterator[None]:
    """Makes the core answer ``library`` (``array_module``) and ``backend`` (``backend_for``) for device arrays.

    Rebinds those two names in every loaded ``sparsecore`` module that imported
    them, as `sparsecore._dispatch` answers ``cupy`` and the GPU backend for CuPy arrays.
    """
    from sparsecore import _dispatch, backends

    array_module, backend_for = _dispatch.array_module, backends.backend_for

    def routed_array_module(value: Any) -> Any:
        return library if is_device(value) else array_module(value)

    def routed_backend_for(array: Any) -> Any:
        return backend if is_device(array) else backend_for(array)

    replaced = []
    for name, module in list(sys.modules.items()):
        if not name.startswith("sparsecore") or module is None:
            continue
        for attribute, original, replacement in (("array_module", array_module, routed_array_module),
                                                 ("backend_for", backend_for, routed_backend_for)):
            if getattr(module, attribute, None) is original:
                setattr(module, attribute, replacement)
                replaced.append((module, attribute, original))
    try:
        yield
    finally:
        for module, attribute, original in replaced:
            setattr(module, attribute, original)


def _no_launch(*_: Any) -> None:
    return None
