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

Readers, with no conversion per call: the jnp passes gather and scatter with
``FILL_OR_DROP`` (-1 reads zeros, writes nothing; `primitives`); the core's
GPU kernels skip -1 rows (`padded.pair_map` is a reshape); the core's NumPy
backend, which cannot skip them, gets each offset's true pairs as views
joined once per call (`padded.true_pair_map`).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any, Sequence

import jax
import numpy as np

import sparsecore as sc

__all__ = ["CHUNK", "NO_PAIR", "pair_layout", "RulebookInfo", "PaddedRulebook"]

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
