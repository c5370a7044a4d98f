"""Site keys packed and unpacked by one kernel launch each (``kernels_cu/hash_table.cu``).

`sparsecore.hashing.pack_keys` and `unpack_keys` compute a key per site with a
few array operations per axis (about a dozen for 3-D sites); on the GPU each
costs host time (about 20 us of CuPy on an H200's host, 2026-12-04), and a
rulebook build packs its sites once and a strided one unpacks its output sites
once. The kernel backend runs them as ``sc_pack_keys`` / ``sc_unpack_keys``,
each thread one site, with the same arithmetic: ``key = sum_c (indices[:, c] +
addends[c]) * strides[c]`` (batch first; ``addends`` are 0 for the batch and
the grid margin for each axis).
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from ._launch import KernelDevice, check_row_count

__all__ = ["pack_site_keys", "unpack_site_keys"]


def _parameters(device: KernelDevice, strides: Sequence[int], addends: Sequence[int], what: str) -> tuple[Any, Any]:
    if len(strides) != len(addends) or not strides:
        raise ValueError(f"{what}: strides and addends must be equally long and not empty, got "
                         f"{tuple(strides)} and {tuple(addends)}")
    table = device.xp.asarray(np.array([strides, addends], dtype=np.int64))  # one host-to-device copy
    return table[0], table[1]


def pack_site_keys(device: KernelDevice, indices: Any, strides: Sequence[int], addends: Sequence[int]) -> Any:
    """int64 ``[N]`` keys of int32 ``[N, C]`` sites in one ``sc_pack_keys`` launch.

    Args:
        device: the kernel device.
        indices: int32 ``[N, C]`` sites, batch first, inside the padded grid (the caller checks).
        strides: ``C`` host ints, the packed grid's row-major strides (`sparsecore.hashing.key_strides`).
        addends: ``C`` host ints added to each column first (0, then the margins).

    Returns:
        int64 ``[N]``.
    """
    xp = device.xp
    count, columns = int(indices.shape[0]), int(indices.shape[1])
    if columns != len(strides):
        raise ValueError(f"pack_site_keys: indices have {columns} columns but {len(strides)} strides were given")
    check_row_count(count, "indices", "pack_site_keys")
    keys = xp.empty(count, dtype=xp.int64)
    if count:
        stride_array, addend_array = _parameters(device, strides, addends, "pack_site_keys")
        device.run("sc_pack_keys", (), count, (xp.ascontiguousarray(indices, dtype=xp.int32), np.int64(count),
                                               np.int32(columns), stride_array, addend_array, keys))
    return keys


def unpack_site_keys(device: KernelDevice, keys: Any, strides: Sequence[int], addends: Sequence[int]) -> Any:
    """int32 ``[N, C]`` sites of non-negative int64 ``keys [N]`` in one ``sc_unpack_keys`` launch (the inverse
    of `pack_site_keys`)."""
    xp = device.xp
    count, columns = int(keys.shape[0]), len(strides)
    check_row_count(count, "keys", "unpack_site_keys")
    indices = xp.empty((count, columns), dtype=xp.int32)
    if count:
        stride_array, addend_array = _parameters(device, strides, addends, "unpack_site_keys")
        device.run("sc_unpack_keys", (), count, (xp.ascontiguousarray(keys, dtype=xp.int64), np.int64(count),
                                                 np.int32(columns), stride_array, addend_array, indices))
    return indices
