"""`sparsecore.layer_geometry.find_layer_rulebook`: the one geometry path.

Rulebooks found or built are checked against the brute-force pair enumeration
(`dense_oracle.naive_rulebook`); the reuse rules (hits are the very same
object, misses build anew, misfits and spconv's forbidden key reuse raise
naming both geometries, inverse convs reverse the saved rulebook) and the
sharing rule (copy-on-write: the input's cache is never changed, branches do
not see each other's keys) are compared with spconv 2.3.8's own
``indice_dict`` behaviour where spconv shows it.
"""

from __future__ import annotations

import pickle

import numpy as np
import pytest

import sparsecore as sc
from sparsecore.layer_geometry import (FoundRulebook, GeometryCache, InputSites, find_layer_rulebook,
                                       sites_identity)

try:
    from . import dense_oracle as do
except ImportError:
    import dense_oracle as do

SHAPE, BATCH = (7, 6, 5), 2
SUBM3 = sc.ConvGeometry.create(3, 3, kind="subm")
SUBM5 = sc.ConvGeometry.create(3, 5, kind="subm")
DOWN = sc.ConvGeometry.create(3, 3, 2, 1, kind="regular")


def _sites(seed: int, shape=SHAPE, density: float = 0.3) -> InputSites:
    indices = do.random_indices(do.make_rng(94000, seed), shape, BATCH, density)
    return InputSites(sites_identity(indices), indices, shape, BATCH)


def _pair_sets(rulebook) -> list[set[tuple[int, int]]]:
    return [set(zip(*(rows.tolist() for rows in rulebook.pairs(k)))) for k in range(rulebook.kernel_volume)]


def _assert_matches_naive(rulebook, sites: InputSites, kind: str, kernel: int, stride=1, padding=0) -> None:
    naive = do.naive_rulebook(sites.indices, sites.spatial_shape, sites.batch_size, kind, kernel, stride, padding)
    do.assert_sites(rulebook.output_indices, naive.output_indices)
    expected = [set(zip(i.tolist(), o.tolist())) for i, o in naive.pairs]
    assert _pair_sets(rulebook) == expected


def test_build_then_hit_returns_the_same_object_and_leaves_the_input_cache_alone():
    sites = _sites(1)
    empty = GeometryCache()
    first = find_layer_rulebook(empty, sites, SUBM3)
    assert isinstance(first, FoundRulebook) and not first.reused
    _assert_matches_naive(first.rulebook, sites, "subm", 3)
    assert len(empty.canonical) == 0 and len(empty.aliases) == 0, "copy-on-write: the input cache is unchanged"
    # canonical reuse: the same geometry on the same sites, no indice_key needed
    again = find_layer_rulebook(first.cache, sites, SUBM3)
    assert again.reused and again.rulebook is first.rulebook and again.cache is first.cache
    # a sites value with the same identity (a tensor derived with the same indices) hits too
    derived = InputSites(sites.identity, sites.indices, SHAPE, BATCH, checked=True)
    assert find_layer_rulebook(first.cache, derived, SUBM3).rulebook is first.rulebook


@pytest.mark.parametrize("change", ["identity", "geometry", "spatial_shape", "batch_size"])
def test_misses_build_anew(change):
    sites = _sites(2)
    cache = find_layer_rulebook(GeometryCache(), sites, SUBM3).cache
    kept = cache.canonical[sites.canonical_key(SUBM3)]
    geometry = SUBM3
    if change == "identity":  # equal values, another array: not the same sites object
        sites = InputSites(sites_identity(sites.indices.copy()), sites.indices.copy(), SHAPE, BATCH)
    elif change == "geometry":
        geometry = SUBM5
    elif change == "spatial_shape":
        sites = InputSites(sites.identity, sites.indices, (8, 6, 5), BATCH)
    else:
        sites = InputSites(sites.identity, sites.indices, SHAPE, BATCH + 1)
    found = find_layer_rulebook(cache, sites, geometry)
    assert not found.reused and found.rulebook is not kept
    _assert_matches_naive(found.rulebook, sites, "subm", geometry.kernel_size[0])
    assert found.rulebook.input_spatial_shape == tuple(sites.spatial_shape)


def test_indice_key_is_an_alias_and_a_misfit_names_both_geometries():
    sites = _sites(3)
    keyed = find_layer_rulebook(GeometryCache(), sites, SUBM3, "s1")
    assert keyed.cache.aliases["s1"] is keyed.rulebook
    assert find_layer_rulebook(keyed.cache, sites, SUBM3, "s1").rulebook is keyed.rulebook
    # an unkeyed build, then a keyed layer on the same sites: the key aliases the canonical entry
    plain = find_layer_rulebook(GeometryCache(), sites, SUBM3)
    aliased = find_layer_rulebook(plain.cache, sites, SUBM3, "late")
    assert aliased.rulebook is plain.rulebook and aliased.cache.aliases["late"] is plain.rulebook
    with pytest.raises(ValueError, match=r"indice_key 's1'.*does not fit.*kernel_size=\(3, 3, 3\).*"
                                         r"kernel_size=\(5, 5, 5\)"):
        find_layer_rulebook(keyed.cache, sites, SUBM5, "s1", layer="SubMConv3d")
    other = _sites(4)
    with pytest.raises(ValueError, match=r"indice_key 's1'.*input"):
        find_layer_rulebook(keyed.cache, other, SUBM3, "s1")


def test_a_subm_key_reused_on_equal_sites_of_another_array_is_checked_and_reused():
    sites = _sites(5)
    keyed = find_layer_rulebook(GeometryCache(), sites, SUBM3, "s")
    copy = InputSites(sites_identity(sites.indices.copy()), sites.indices.copy(), SHAPE, BATCH)
    found = find_layer_rulebook(keyed.cache, copy, SUBM3, "s")
    assert found.reused and found.rulebook is keyed.rulebook
    assert found.cache.canonical[copy.canonical_key(SUBM3)] is keyed.rulebook


def test_non_subm_key_that_exists_is_an_error_unless_it_is_this_very_layer():
    sites = _sites(6)
    down = find_layer_rulebook(GeometryCache(), sites, DOWN, "d1")
    _assert_matches_naive(down.rulebook, sites, "regular", 3, 2, 1)
    out = InputSites(sites_identity(down.rulebook.output_indices), down.rulebook.output_indices,
                     down.rulebook.output_spatial_shape, BATCH, checked=True)
    with pytest.raises(ValueError, match="indice_key 'd1' already exists"):
        find_layer_rulebook(down.cache, out, DOWN, "d1", layer="SparseConv3d")
    with pytest.raises(ValueError, match="indice_key 'd1'.*does not fit"):
        find_layer_rulebook(down.cache, out, SUBM3, "d1")
    # the same layer on the same input again (a model run twice on one core tensor): reused
    assert find_layer_rulebook(down.cache, sites, DOWN, "d1").rulebook is down.rulebook


def test_inverse_reverses_the_saved_rulebook_after_checking_its_input():
    sites = _sites(7)
    down = find_layer_rulebook(GeometryCache(), sites, DOWN, "d1")
    out = InputSites(sites_identity(down.rulebook.output_indices), down.rulebook.output_indices,
                     down.rulebook.output_spatial_shape, BATCH, checked=True)
    inverse_geometry = sc.ConvGeometry("inverse", (3, 3, 3), (1, 1, 1), (0, 0, 0), (1, 1, 1), (0, 0, 0))
    up = find_layer_rulebook(down.cache, out, inverse_geometry, "d1")
    assert up.reused and up.cache is down.cache
    assert up.rulebook.output_indices is sites.indices, "the inverse restores the paired input's sites object"
    assert up.rulebook.output_spatial_shape == SHAPE
    swapped = [{(o, i) for i, o in pairs} for pairs in _pair_sets(down.rulebook)]
    assert _pair_sets(up.rulebook) == swapped
    with pytest.raises(ValueError, match=r"indice_key='missing'.*no rulebooks"):
        find_layer_rulebook(GeometryCache(), out, inverse_geometry, "missing")
    with pytest.raises(ValueError, match=r"\['d1'\]"):
        find_layer_rulebook(down.cache, out, inverse_geometry, None)
    with pytest.raises(ValueError, match="kernel_size"):
        find_layer_rulebook(down.cache, out, sc.ConvGeometry("inverse", (2, 2, 2), (1, 1, 1), (0, 0, 0),
                                                             (1, 1, 1), (0, 0, 0)), "d1")
    fewer = out.indices[:-1]
    with pytest.raises(ValueError, match="not the paired layer's"):
        find_layer_rulebook(down.cache, InputSites(sites_identity(fewer), fewer, out.spatial_shape, BATCH),
                            inverse_geometry, "d1")
    subm = find_layer_rulebook(GeometryCache(), sites, SUBM3, "s")
    with pytest.raises(ValueError, match="submanifold"):
        find_layer_rulebook(subm.cache, sites, inverse_geometry, "s")


def test_branches_do_not_see_each_others_keys():
    sites = _sites(8)
    trunk = find_layer_rulebook(GeometryCache(), sites, SUBM3, "s1").cache
    left = find_layer_rulebook(trunk, sites, SUBM5, "s2").cache
    right = find_layer_rulebook(trunk, sites, DOWN, "d").cache
    assert set(trunk.aliases) == {"s1"}
    assert set(left.aliases) == {"s1", "s2"} and set(right.aliases) == {"s1", "d"}


def test_names_as_identities_empty_sites_and_bad_arguments():
    indices = do.random_indices(do.make_rng(94000, 9), SHAPE, BATCH, 0.3)
    named = InputSites("sites0", indices, SHAPE, BATCH)  # what the JAX planner passes
    first = find_layer_rulebook(GeometryCache(), named, SUBM3)
    assert find_layer_rulebook(first.cache, InputSites("sites0", indices, SHAPE, BATCH), SUBM3).rulebook \
        is first.rulebook
    empty = np.zeros((0, 4), np.int32)
    found = find_layer_rulebook(GeometryCache(), InputSites(sites_identity(empty), empty, SHAPE, BATCH), DOWN, "e")
    assert found.rulebook.num_pairs == 0 and found.rulebook.num_output == 0
    assert found.rulebook.output_spatial_shape == (4, 3, 3)
    with pytest.raises(ValueError, match="indice_key must be a non-empty string"):
        find_layer_rulebook(GeometryCache(), named, SUBM3, "")
    with pytest.raises(TypeError, match="geometry must be a sparsecore.ConvGeometry"):
        find_layer_rulebook(GeometryCache(), named, "subm")  # type: ignore[arg-type]
    duplicated = np.concatenate([indices[:3], indices[:1]])
    with pytest.raises(ValueError, match="duplicate"):
        find_layer_rulebook(GeometryCache(), InputSites("dup", duplicated, SHAPE, BATCH), SUBM3)


def test_a_pickled_cache_keeps_its_keys_and_drops_identity_entries():
    sites = _sites(10)
    cache = find_layer_rulebook(GeometryCache(), sites, SUBM3, "s").cache
    back = pickle.loads(pickle.dumps(cache))
    assert list(back.aliases) == ["s"] and len(back.canonical) == 0
    np.testing.assert_array_equal(back.aliases["s"].pair_input, cache.aliases["s"].pair_input)


def test_sharing_rule_matches_spconv():
    """spconv 2.3.8: a layer hands its output a copy of the input's dict plus its key; replace_feature shares."""
    torch = pytest.importorskip("torch")
    spconv = pytest.importorskip("spconv.pytorch")
    indices = do.random_indices(do.make_rng(94000, 11), SHAPE, BATCH, 0.3)
    features = torch.tensor(do.random_features(do.make_rng(94000, 12), indices.shape[0], 2), dtype=torch.float32)
    x = spconv.SparseConvTensor(features, torch.from_numpy(indices), list(SHAPE), BATCH)
    with torch.no_grad():
        y = spconv.SubMConv3d(2, 2, 3, indice_key="s1")(x)
        left = spconv.SubMConv3d(2, 2, 5, indice_key="s2")(y)
        right = spconv.SparseConv3d(2, 2, 3, 2, 1, indice_key="d")(y)
    spconv_keys = [set(t.indice_dict) for t in (x, y, left, right)]
    assert y.replace_feature(y.features).indice_dict is y.indice_dict
    # the same network through the core function, each output holding the returned cache
    sites = InputSites(sites_identity(indices), indices, SHAPE, BATCH)
    cache_y = find_layer_rulebook(GeometryCache(), sites, SUBM3, "s1").cache
    cache_left = find_layer_rulebook(cache_y, sites, SUBM5, "s2").cache
    cache_right = find_layer_rulebook(cache_y, sites, DOWN, "d").cache
    core_keys = [set(cache.aliases) for cache in (GeometryCache(), cache_y, cache_left, cache_right)]
    assert core_keys == spconv_keys == [set(), {"s1"}, {"s1", "s2"}, {"s1", "d"}]
    # and spconv's strided layer has the same output sites as ours (spconv does not sort them)
    ours, theirs = cache_right.aliases["d"].output_indices, right.indices.numpy()
    do.assert_sites(ours[np.lexsort(ours.T[::-1])], theirs[np.lexsort(theirs.T[::-1])])
