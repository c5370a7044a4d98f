"""A shared work counter for numba kernels: threads claim work items one at a time (imported by kernel sources).

Numba's parallel loops split their range statically: each thread gets a fixed,
contiguous share before it starts. When another process takes a core, the
thread on that core holds the whole pass (beside one spinning process on two
cores, the short passes took up to 2.8x their quiet time). The kernels that
use this module instead run one loop iteration per thread ("lane") and each
lane claims the next work item from a counter with an atomic add until none is
left: a slowed thread just claims fewer items.

Results do not depend on which thread runs an item: every item writes only
its own rows or its own partial buffer, and partial sums are added in item
order afterwards. Only the assignment of items to threads changes.

Scratch buffers are allocated per work item inside the claim loop, not once
per lane before it: with the generic row kernel's accumulator hoisted to the
lane, numba's on-disk cache returned code that rounded differently from the
code it had just compiled (grouped 6 x 6 layers, last bits; tests/test_threads.py
runs its first process on an empty cache to catch that).

Each kernel is one parallel region: one wake-up of the thread pool and one
barrier at its end, which a loaded machine can make wait for a thread the
scheduler has parked (about a millisecond each on the 2-core test machine
beside 4 busy processes). `new_counter` is therefore an empty array and one
store: written as ``np.zeros``, numba made it a parallel loop, and so a region,
of its own (every kernel woke the pool twice until 2026-12-07).

Beside one spinning process on the 2-core test machine (medians of three
interleaved runs, two threads, real scan, 2026-12-03), static -> claimed items:
SubMConv3d 16->16 rulebook 28.0 -> 16.8 ms, forward 26.3 -> 21.4, backward
35.9 -> 24.0; 64->64 forward 108 -> 85 (backward 209 either way); the strided
64->64 rulebook 50.6 -> 33.8, forward 65.2 -> 60.6, backward 112 -> 105. The
quiet runs were unchanged within the machine's noise.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

__all__ = ["claim", "new_counter", "release", "acquired"]


@intrinsic
def claim(typing_context: Any, counter: Any) -> Any:
    """``counter[0]++`` as one atomic add; returns the value before it (``counter``: int64 ``[1]``)."""
    signature = types.int64(counter)

    def codegen(context: Any, builder: Any, signature: Any, arguments: Any) -> Any:
        view = context.make_array(signature.args[0])(context, builder, arguments[0])
        int64 = ir.IntType(64)
        address = builder.bitcast(view.data, int64.as_pointer())
        return builder.atomic_rmw("add", address, ir.Constant(int64, 1), "monotonic")

    return signature, codegen


@njit(inline="always")
def new_counter() -> Any:
    """A fresh counter at 0 (int64 ``[1]``), shared by the lanes of the loop that follows.

    An empty array and one store, not ``np.zeros``, which numba would make a parallel region of its own
    inside a ``parallel=True`` kernel (see the module's notes).
    """
    counter = np.empty(1, dtype=np.int64)
    counter[0] = 0
    return counter


@intrinsic
def release(typing_context: Any, counter: Any) -> Any:
    """``counter[0]++`` as one atomic add with release order: whatever this thread wrote before it is seen by
    a thread whose `acquired` reads the new count (``counter``: int64 ``[1]``)."""
    signature = types.void(counter)

    def codegen(context: Any, builder: Any, signature: Any, arguments: Any) -> Any:
        view = context.make_array(signature.args[0])(context, builder, arguments[0])
        int64 = ir.IntType(64)
        builder.atomic_rmw("add", builder.bitcast(view.data, int64.as_pointer()), ir.Constant(int64, 1), "release")
        return context.get_dummy_value()

    return signature, codegen


@intrinsic
def acquired(typing_context: Any, counter: Any) -> Any:
    """``counter[0]`` read atomically with acquire order (pairs with `release`; ``counter``: int64 ``[1]``)."""
    signature = types.int64(counter)

    def codegen(context: Any, builder: Any, signature: Any, arguments: Any) -> Any:
        view = context.make_array(signature.args[0])(context, builder, arguments[0])
        int64 = ir.IntType(64)
        return builder.load_atomic(builder.bitcast(view.data, int64.as_pointer()), "acquire", 8)

    return signature, codegen
