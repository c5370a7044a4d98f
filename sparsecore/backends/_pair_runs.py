"""The NumPy backend's walk over a pair map, one kernel offset (run) at a time.

Pairs are stored offset by offset; within one offset every input row and every
output row appears once, so a run's rows can be gathered and scattered with
plain ``take`` / ``put``. Shared by the float and int8 pair primitives of the
NumPy backend (`numpy_backend`, `_numpy_int8`).
"""

from __future__ import annotations

from typing import Iterator

import numpy as np

__all__ = ["offset_runs"]


def offset_runs(pair_input: np.ndarray, pair_output: np.ndarray,
                run_starts: tuple[int, ...]) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """``(input_rows, output_rows)`` of each non-empty run, as ``intp`` (NumPy's fastest index type).

    Args:
        pair_input: integer ``[P]`` input rows.
        pair_output: integer ``[P]`` output rows.
        run_starts: ``K + 1`` host ints delimiting the runs.

    Yields:
        Two ``intp`` arrays of one run's length, in run order; empty runs are skipped.
    """
    for start, stop in zip(run_starts[:-1], run_starts[1:]):
        if stop > start:
            yield pair_input[start:stop].astype(np.intp), pair_output[start:stop].astype(np.intp)
