"""Where voxelization's temporaries and rows live: the NumPy speed paths, each with a CuPy branch.

`Scratch` carves every temporary of one call from one block (huge pages on
NumPy, CuPy's memory pool on the GPU); `take` gathers in place; `copy_rows`
moves whole rows as opaque ``void`` items. Used by `sparsecore._voxel_math`
(and `Scratch` by `sparsecore._voxel_hashing`).
"""

from __future__ import annotations

from typing import Any

__all__ = ["Scratch", "take", "copy_rows"]


class Scratch:
    """Temporaries carved from one block per call.

    A large NumPy allocation usually comes fresh from the kernel and is faulted
    in 4 KiB at a time; for a 120k-point cloud those faults cost more than the
    arithmetic. NumPy backs blocks of 4 MiB and more with huge pages, so
    carving every temporary from one block costs a handful of faults, and only
    the pages touched are ever materialised. CuPy has a memory pool: there
    ``empty`` is used directly. Nothing returned to the caller is a view of it.
    """

    def __init__(self, xp: Any, nbytes: int) -> None:
        self.xp = xp
        self.block = xp.empty((nbytes,), dtype=xp.uint8) if xp.__name__ == "numpy" else None
        self.used = 0

    def empty(self, count: int, dtype: Any) -> Any:
        """A 1-D array of ``count`` items of ``dtype`` (uninitialised)."""
        dtype = self.xp.dtype(dtype)
        size = count * dtype.itemsize
        if self.block is None or self.used + size > self.block.shape[0]:
            return self.xp.empty((count,), dtype=dtype)
        view = self.block[self.used : self.used + size].view(dtype)
        self.used += -(-size // 64) * 64
        return view


def take(xp: Any, values: Any, positions: Any, out: Any) -> Any:
    """``out[...] = values[positions]`` for valid positions; returns ``out``.

    NumPy's default ``mode="raise"`` routes ``out`` through a temporary buffer;
    ``"clip"`` writes in place (the positions here are always in range). CuPy's
    ``take`` has no ``mode`` and never buffers.
    """
    if xp.__name__ == "numpy":
        return xp.take(values, positions, out=out, mode="clip")
    return xp.take(values, positions, out=out)


def copy_rows(xp: Any, scratch: Scratch, destination: Any, rows: Any, source: Any,
              source_rows: Any) -> None:
    """``destination[rows] = source[source_rows]`` for 2-D arrays; ``None`` means all rows.

    NumPy's fancy indexing is slow on short rows, so each row is moved as one
    opaque ``void`` item when its bytes are contiguous, else column by column;
    CuPy takes one kernel either way. ``destination`` is C-contiguous.
    """
    if xp.__name__ != "numpy":
        values = source if source_rows is None else source[source_rows]
        if rows is None:
            destination[...] = values
        else:
            destination[rows] = values
        return
    count = int(source.shape[0] if source_rows is None else source_rows.shape[0])
    if source.strides[1] == source.itemsize:
        row_type = xp.dtype((xp.void, int(source.shape[1]) * source.itemsize))
        source, destination = source.view(row_type)[:, 0], destination.view(row_type)[:, 0]
        if source_rows is not None:
            values = scratch.empty(count, row_type) if rows is not None else destination
            source = xp.take(source, source_rows, out=values, mode="clip")
        if rows is not None:
            xp.put(destination, rows, source, mode="clip")
        return
    values = scratch.empty(count, source.dtype)
    for column in range(int(source.shape[1])):
        if source_rows is None:
            values[...] = source[:, column]
        else:
            take(xp, source[:, column], source_rows, out=values)
        if rows is None:
            destination[:, column] = values
        else:
            destination[:, column][rows] = values
