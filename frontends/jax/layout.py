"""The one padded form of a rulebook in a plan, read as stored by every feature pass.

A rulebook with ``K`` kernel offsets is stored as ``pair_input, pair_output:
int32 [K, Q]`` and ``counts: int32 [K]``: offset ``k``'s first ``counts[k]``
entries are its pairs, the rest are -1, the kernels' convention for "no
pair". Every offset is stored, the centre of a submanifold rulebook (``i -> i``
for the true rows) included.

``Q`` follows from the row capacities (`pair_layout`): an offset pairs each
input and each output at most once, so it has at most ``min(rows in, rows
out)`` pairs; ``Q`` is that bound rounded up to a multiple of the ``chunk`` the
jnp feature passes loop over (they visit only the chunks holding true pairs,
so a large ``Q`` costs memory, not arithmetic).

Readers: the jnp passes gather and scatter with ``FILL_OR_DROP`` (-1 reads
zeros, writes nothing; `primitives`); the core's NumPy backend, which cannot
skip -1 entries, gets each offset's true pairs as views joined once per call
(`padded.true_pair_map`); the core's GPU kernels read a padded neighbour map
(`map_arrays`: the same pairs as per-row tables, made by XLA inside the
compiled program, so no host operation and no read back; rows past the true
count are all -1 and their masks 0).

The jnp passes keep the ``[K, Q]`` form: on the CPU it measured 4.8x faster
forward and 3x faster forward + backward than jnp passes over a padded map
(per offset, a gather of every output row and one GEMM) for a SubMConv3d
64 -> 64 on the 125,562-voxel scan, 5.4x and 6.3x for a strided one
(2026-12-05, 2-core AMD EPYC VM, Python 3.11.7, jax 0.10.2, under jit; a map
computes every output row for every offset, the pairs only the true pairs).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

import sparsecore as sc

__all__ = ["CHUNK", "NO_PAIR", "pair_layout", "RulebookInfo", "PaddedRulebook", "map_arrays"]

CHUNK = 2048  # pairs per step of the jnp feature passes' loops
NO_PAIR = -1  # a pair row that is no pair (the kernels' convention)


def pair_layout(capacity_in: int, capacity_out: int) -> tuple[int, int]:
    """``(Q, chunk)`` of a rulebook between site sets of these capacities: ``Q`` a multiple of ``chunk``."""
    bound = min(int(capacity_in), int(capacity_out))
    chunk = min(CHUNK, -(-bound // 8) * 8)
    return -(-bound // chunk) * chunk, chunk


@dataclass(frozen=True)
class RulebookInfo:
    """Static description of a padded rulebook.

    Attributes:
        key: the plan key (``rulebook_key(input_sites, geometry)``).
        geometry: the core `ConvGeometry`.
        input_sites, output_sites: site-set names.
        pair_capacity: ``Q``, padded pairs per offset (`pair_layout` of the row capacities).
        chunk: pairs per loop step of the jnp feature passes (divides ``Q``).
        identity_offset: the subm centre offset (``i -> i``), or -1.
    """

    key: str
    geometry: sc.ConvGeometry
    input_sites: str
    output_sites: str
    pair_capacity: int
    chunk: int
    identity_offset: int = -1

    @property
    def kernel_volume(self) -> int:
        return self.geometry.kernel_volume

    def with_capacities(self, capacity_in: int, capacity_out: int) -> "RulebookInfo":
        """The same rulebook laid out for other row capacities."""
        capacity, chunk = pair_layout(capacity_in, capacity_out)
        return RulebookInfo(self.key, self.geometry, self.input_sites, self.output_sites, capacity, chunk,
                            self.identity_offset)


def _lay_out(pieces: Sequence[tuple[Any, Any]], info: RulebookInfo) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``[K, Q]`` pair rows (-1 after each offset's pairs) and ``[K]`` counts from per-offset pairs."""
    shape = (len(pieces), info.pair_capacity)
    pair_input, pair_output = np.full(shape, NO_PAIR, np.int32), np.full(shape, NO_PAIR, np.int32)
    counts = np.zeros(len(pieces), np.int32)
    for offset, (rows_in, rows_out) in enumerate(pieces):
        count = counts[offset] = rows_in.shape[0]
        pair_input[offset, :count] = rows_in
        pair_output[offset, :count] = rows_out
    return pair_input, pair_output, counts


@partial(jax.tree_util.register_dataclass, data_fields=["pair_input", "pair_output", "counts"],
         meta_fields=["info"])
@dataclass(frozen=True, eq=False, repr=False)
class PaddedRulebook:
    """A core rulebook in the padded ``[K, Q]`` layout (see the module docstring; a pytree).

    Attributes:
        pair_input, pair_output: int32 ``[K, Q]``, -1 = no pair.
        counts: int32 ``[K]`` true pairs per offset.
        info: the static `RulebookInfo`.
    """

    pair_input: Any
    pair_output: Any
    counts: Any
    info: RulebookInfo

    def __repr__(self) -> str:
        return f"PaddedRulebook({self.info.key!r}, pair_capacity={self.info.pair_capacity})"

    @classmethod
    def from_core(cls, rulebook: sc.Rulebook, key: str, input_sites: Any, output_sites: Any) -> "PaddedRulebook":
        """Pads a core `Rulebook` (NumPy) between two site sets (`SitesInfo`) (NumPy leaves)."""
        capacity, chunk = pair_layout(input_sites.capacity, output_sites.capacity)
        info = RulebookInfo(key, rulebook.geometry, input_sites.name, output_sites.name, capacity, chunk,
                            int(rulebook.identity_offset))
        pieces = [tuple(np.asarray(rows) for rows in rulebook.pairs(k)) for k in range(rulebook.kernel_volume)]
        return cls(*_lay_out(pieces, info), info)

    def repad(self, input_capacity: int, output_capacity: int) -> "PaddedRulebook":
        """The same pairs laid out for new row capacities (concrete rulebooks; NumPy leaves)."""
        info = self.info.with_capacities(input_capacity, output_capacity)
        counts = np.asarray(self.counts).tolist()
        old_in, old_out = np.asarray(self.pair_input), np.asarray(self.pair_output)
        return PaddedRulebook(*_lay_out([(old_in[k, :c], old_out[k, :c]) for k, c in enumerate(counts)], info),
                              info)


def _side(keys: Any, values: Any, rows: int) -> tuple[Any, Any, Any]:
    """``(neighbours [rows, K] int32, masks [rows, W] uint32, order [rows] int32)`` of ``[K, Q]`` pair rows
    read from ``keys`` to ``values`` (-1 entries dropped)."""
    volume = keys.shape[0]
    offsets = jnp.broadcast_to(jnp.arange(volume, dtype=jnp.int32)[:, None], keys.shape)
    table = jnp.full((rows, volume), NO_PAIR, jnp.int32)
    # -1 keys point past the table and are dropped (jnp would wrap a negative index)
    table = table.at[jnp.where(keys >= 0, keys, rows), offsets].set(values, mode="drop")
    words = -(-volume // 32)
    present = jnp.zeros((rows, words * 32), jnp.uint32).at[:, :volume].set((table >= 0).astype(jnp.uint32))
    shifts = jnp.arange(32, dtype=jnp.uint32)
    masks = jnp.sum(present.reshape(rows, words, 32) << shifts, axis=2, dtype=jnp.uint32)
    # rows stably sorted by mask, word 0 first (jnp.lexsort's last key is the primary one)
    order = jnp.lexsort(tuple(masks[:, word] for word in range(words - 1, -1, -1))).astype(jnp.int32)
    return table, masks, order


def map_arrays(pair_input: Any, pair_output: Any, capacity_in: int, capacity_out: int,
               symmetric: bool) -> tuple[Any, ...]:
    """The padded neighbour map of a ``[K, Q]`` rulebook, as jnp arrays (computed inside a jitted program).

    Returns ``(output_neighbours [capacity_out, K] int32, output_masks [capacity_out, W] uint32,
    output_order [capacity_out] int32)`` and, unless ``symmetric`` (a submanifold rulebook: the input
    side is the output side with the offsets reversed), the same three for the input side
    (``[capacity_in, ...]``): `sparsecore.neighbour_map.NeighbourMap`'s tables. Rows past the true
    counts are all -1 with masks 0 (sorted first by the order).
    """
    output_side = _side(pair_output, pair_input, int(capacity_out))
    if symmetric:
        return output_side
    return output_side + _side(pair_input, pair_output, int(capacity_in))
