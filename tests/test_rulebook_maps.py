"""Rulebooks built as neighbour maps on the kernel backend, against the NumPy backend's builders.

The kernel backend (emulated: the ``kernels_cu`` sources compiled by g++; on a
GPU, CuPy) builds a rulebook as a `NeighbourMap` (``neighbour_map.cu``) and
derives pair lists only when asked. The oracle is the NumPy backend's rulebook
(the CPU builders: compiled numba passes that share no code with the kernels):

- the same output sites (in order) and grids, and per kernel offset the same
  set of (input row, output row) pairs;
- the map bitwise equal to `neighbour_map_from_pairs` of the NumPy pairs:
  tables, masks and the stably sorted orders (unique, so comparable);
- the derived pair view exactly `pairs_from_neighbour_map`'s (the reference).

Over sampled geometries (1-4 spatial axes, dilation, padding, even and odd
kernels, masks of one to several words, batch > 1 with empty batch elements,
stride > kernel, transposed with output padding), pools (subm and regular),
inverse rulebooks, empty inputs, and the site checks' errors. Then what the
builds cost the host: their launches, their reads back (none for a
submanifold build of checked sites, one for a strided build, one for the
first layer's checks), and that nothing on the geometry path of a layer, reuse
included, derives pairs (`forbid_host_reads`).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import sparsecore as sc
from sparsecore.backends import NUMPY_BACKEND
from sparsecore.backends._kernel_maps import row_masks as kernel_row_masks
from sparsecore.neighbour_map import neighbour_map_from_pairs, pairs_from_neighbour_map, row_masks, stored_masks

try:
    from . import dense_oracle as do
    from .cuda_emulation import device_arrays
    from .cuda_emulation.emulated_launcher import RecordingLauncher
    from .kernel_targets import Target, emulated_backend, random_sites, rng_for, target  # noqa: F401
except ImportError:
    import dense_oracle as do
    from cuda_emulation import device_arrays
    from cuda_emulation.emulated_launcher import RecordingLauncher
    from kernel_targets import Target, emulated_backend, random_sites, rng_for, target  # noqa: F401

CASES = (do.sample_cases("subm", 10, ndims=(1, 2, 3, 4), base_seed=2800, grouped=False, max_kernel=5)
         + do.sample_cases("regular", 12, ndims=(1, 2, 3, 4), base_seed=2810, grouped=False, max_kernel=4)
         + do.sample_cases("transposed", 8, ndims=(1, 2, 3, 4), base_seed=2820, grouped=False, max_kernel=4))

# kind, spatial shape, kernel, stride, padding, dilation, output padding: what sampling may miss
EXPLICIT = [
    ("subm", (9, 8, 7), 5, 1, 0, 1, 0),  # 125 offsets: four mask words
    ("regular", (5, 4, 6, 5), 3, 2, 1, 1, 0),  # 81 offsets: three mask words
    ("regular", (17, 13), 2, 3, 0, 1, 0),  # stride > kernel: sites between windows feed nothing
    ("regular", (11, 10, 9), 1, 2, 0, 1, 0),
    ("transposed", (6, 7, 5), (2, 2, 3), (2, 2, 1), 0, 1, (1, 1, 0)),  # output padding
    ("subm", (90,), 3, 1, 0, 4, 0),  # dilation
]


def _geometry(kind, ndim, kernel, stride, padding, dilation, output_padding):
    if kind == "subm":
        return sc.ConvGeometry.create(ndim, kernel, dilation=dilation, kind="subm")
    return sc.ConvGeometry.create(ndim, kernel, stride=stride, padding=padding, dilation=dilation,
                                  output_padding=output_padding, kind=kind)


def _sorted_pairs(rulebook, offset, get) -> np.ndarray:
    pairs = np.stack([np.asarray(get(rows)) for rows in rulebook.pairs(offset)], axis=1)
    return pairs[np.lexsort(pairs.T[::-1])]


def assert_rulebook_matches(actual: sc.Rulebook, expected: sc.Rulebook, target: Target) -> None:
    """``actual`` (a kernel-built rulebook) against ``expected`` (the NumPy backend's), as the module says."""
    assert actual.stored_map is not None and actual.stored_pairs is None
    assert actual.geometry == expected.geometry
    assert actual.input_spatial_shape == expected.input_spatial_shape
    assert actual.output_spatial_shape == expected.output_spatial_shape
    assert (actual.num_input, actual.num_output) == (expected.num_input, expected.num_output)
    assert actual.identity_offset == expected.identity_offset and actual.kernel_volume == expected.kernel_volume
    for name in ("input_indices", "output_indices"):
        got, want = target.get(getattr(actual, name)), getattr(expected, name)
        assert got.dtype == want.dtype == np.int32, name
        do.assert_sites(got, want, name)
    # the map, bitwise, against the reference conversion of the oracle's pairs
    reference = neighbour_map_from_pairs(np, expected.pair_input, expected.pair_output, expected.offset_starts,
                                         expected.num_input, expected.num_output, expected.kernel_size,
                                         expected.identity_offset, expected.geometry.kind == "subm")
    built = actual.neighbour_map
    assert built.symmetric == reference.symmetric and built.kernel_size == reference.kernel_size
    for side in ("output", "input"):
        for part in ("neighbours", "masks", "order"):
            got, want = getattr(built, f"{side}_{part}"), getattr(reference, f"{side}_{part}")
            if want is None:
                assert got is None, (side, part)
                continue
            got = target.get(got)
            assert got.dtype == want.dtype and got.shape == want.shape, (side, part, got.shape, want.shape)
            np.testing.assert_array_equal(got, want, err_msg=f"{side} {part}")
    # the pair view: per offset the oracle's pairs, listed as the reference conversion lists them
    assert actual.offset_starts == expected.offset_starts
    for offset in range(expected.kernel_volume):
        np.testing.assert_array_equal(_sorted_pairs(actual, offset, target.get),
                                      _sorted_pairs(expected, offset, np.asarray), err_msg=f"offset {offset}")
    host_map = neighbour_map_from_pairs(np, target.get(actual.pair_input), target.get(actual.pair_output),
                                        actual.offset_starts, actual.num_input, actual.num_output,
                                        actual.kernel_size)
    listed = pairs_from_neighbour_map(np, host_map)
    np.testing.assert_array_equal(target.get(actual.pair_input), listed[0])
    np.testing.assert_array_equal(target.get(actual.pair_output), listed[1])


@pytest.mark.parametrize("case", CASES, ids=str)
def test_sampled_geometries(target, case):
    indices = do.random_indices(case.rng(), case.spatial_shape, case.batch_size, case.density,
                                empty_batches=(0,) if case.batch_size > 1 and case.seed % 3 == 0 else ())
    geometry = _geometry(case.kind, case.ndim, case.kernel_size, case.stride, case.padding, case.dilation,
                         case.output_padding)
    expected = sc.build_rulebook(indices, case.spatial_shape, case.batch_size, geometry, backend=NUMPY_BACKEND)
    actual = sc.build_rulebook(target.put(indices), case.spatial_shape, case.batch_size, geometry,
                               backend=target.backend, assume_unique=case.seed % 2 == 1)
    assert_rulebook_matches(actual, expected, target)
    if case.kind == "regular":  # the inverse: the same map with its sides exchanged
        inverse = sc.inverse_rulebook(actual)
        assert_rulebook_matches(inverse, sc.inverse_rulebook(expected), target)
        assert inverse.neighbour_map.output_neighbours is actual.neighbour_map.input_neighbours
        assert inverse.input_indices is actual.output_indices and inverse.output_indices is actual.input_indices


@pytest.mark.parametrize("case", EXPLICIT, ids=lambda case: f"{case[0]}-{len(case[1])}d-k{case[2]}-s{case[3]}")
@pytest.mark.parametrize("count", [0, 1, 160])
def test_explicit_geometries_and_sizes(target, case, count):
    kind, shape, *parameters = case
    geometry = _geometry(kind, len(shape), *parameters)
    indices = random_sites(rng_for(28, len(shape), count), count, shape, 3)
    expected = sc.build_rulebook(indices, shape, 3, geometry, backend=NUMPY_BACKEND)
    actual = sc.build_rulebook(target.put(indices), shape, 3, geometry, backend=target.backend)
    assert_rulebook_matches(actual, expected, target)
    assert actual.neighbour_map.output_neighbours.shape == (expected.num_output, geometry.kernel_volume)


@pytest.mark.parametrize("subm, kernel, stride, padding", [(False, 2, None, 0), (False, 3, 2, 1), (True, 3, None, 0),
                                                           (False, 1, 3, 0)])
def test_pool_rulebooks(target, subm, kernel, stride, padding):
    shape = (12, 9, 10)
    indices = random_sites(rng_for(29, int(subm), kernel), 300, shape, 2)
    expected = sc.build_pool_rulebook(indices, shape, 2, kernel, stride, padding, subm=subm, backend=NUMPY_BACKEND)
    actual = sc.build_pool_rulebook(target.put(indices), shape, 2, kernel, stride, padding, subm=subm,
                                    backend=target.backend)
    assert_rulebook_matches(actual, expected, target)


@pytest.mark.parametrize("kind", ["subm", "regular", "transposed"])
@pytest.mark.parametrize("problem", ["duplicate", "coordinate", "batch", "both"])
def test_site_checks_raise_the_cpu_builders_errors(target, kind, problem):
    shape = (6, 7, 5)
    indices = random_sites(rng_for(30), 60, shape, 2)
    if problem in ("duplicate", "both"):
        indices[41] = indices[17]
    if problem in ("coordinate", "both"):
        indices[52, 2] = 7
    if problem == "batch":
        indices[3, 0] = 2
    geometry = _geometry(kind, 3, 3, 2, 1, 1, 0)
    with pytest.raises(ValueError) as expected:
        sc.build_rulebook(indices, shape, 2, geometry, backend=NUMPY_BACKEND)
    with pytest.raises(ValueError) as actual:
        sc.build_rulebook(target.put(indices), shape, 2, geometry, backend=target.backend)
    assert str(actual.value) == str(expected.value)
    assert ("duplicate sites" if problem == "duplicate" else "outside") in str(actual.value)


def test_properties_read_the_stored_map_and_pairs_are_derived_once(target):
    indices = random_sites(rng_for(31), 200, (10, 9, 8), 2)
    rulebook = sc.build_rulebook(target.put(indices), (10, 9, 8), 2, sc.ConvGeometry.create(3, 3, kind="subm"),
                                 backend=target.backend)
    neighbour_map = rulebook.neighbour_map
    assert (rulebook.num_input, rulebook.num_output, rulebook.kernel_volume, rulebook.identity_offset,
            rulebook.kernel_size) == (200, 200, 27, 13, (3, 3, 3))
    assert "pair_map" not in neighbour_map.derived  # none of those derived the pairs
    pair_map = rulebook.pair_map
    assert rulebook.pair_map is pair_map and neighbour_map.derived["pair_map"] is pair_map
    assert pair_map.trusted and pair_map.num_pairs == rulebook.num_pairs == sum(rulebook.offset_counts)
    np.testing.assert_array_equal(target.get(rulebook.pairs(13)[0]), np.arange(200))  # the centre


# ---------------------------------------------------------------- what a build costs the host


@pytest.fixture
def device(monkeypatch):
    """The emulated kernel backend on `device_arrays.DeviceArray`, routed as the core routes CuPy arrays."""
    backend = device_arrays.device_backend(emulated_backend())
    reads = device_arrays.route_to_emulated_backend(monkeypatch, backend)
    return backend, reads


@pytest.mark.parametrize("kind", ["subm", "regular", "transposed"])
@pytest.mark.parametrize("checked", [False, True])
def test_launches_and_reads_per_build(device, kind, checked):
    backend, reads = device
    launcher = RecordingLauncher(backend.launcher)
    backend = dataclasses.replace(backend, launcher=launcher)
    indices = device_arrays.to_device(random_sites(rng_for(32), 400, (20, 18, 16), 2))
    geometry = _geometry(kind, 3, 3, 2, 1, 1, 0)
    reads.clear()
    rulebook = sc.build_rulebook(indices, (20, 18, 16), 2, geometry, backend=backend, assume_unique=not checked)
    strided = ["sc_map_candidates", "sc_map_mark_outputs"] + (["sc_map_check_sites"] if checked else []) \
        + ["sc_map_strided"]
    expected = (["sc_map_insert_sites"] + (["sc_map_check_sites"] if checked else [])
                + ["sc_map_submanifold", "sc_map_row_plan"] if kind == "subm"
                else (["sc_map_insert_sites"] if checked else []) + strided)
    assert [record.expression for record in launcher.records] == expected
    # a submanifold build reads nothing back unless it checks the sites; a strided build reads its count
    # (and the checks' verdict with it): at most one read per build
    assert len(reads) == (1 if checked or kind != "subm" else 0), reads
    assert isinstance(rulebook.neighbour_map.output_neighbours, device_arrays.DeviceArray)


def test_the_geometry_path_of_a_network_derives_no_pairs(device):
    """find_layer_rulebook, reuse under an indice_key and by identity, an inverse layer: no read back but
    the strided builds' counts, and no pair list derived (the feature passes are not part of this)."""
    backend, reads = device
    indices = device_arrays.to_device(random_sites(rng_for(33), 500, (24, 20, 16), 2))
    features = device_arrays.to_device(np.ones((500, 2), np.float32))
    x = sc.SparseTensor(features, indices, (24, 20, 16), 2)  # the tensor checks its sites once, here
    subm = sc.ConvGeometry.create(3, 3, kind="subm")
    down = sc.ConvGeometry.create(3, 2, stride=2, kind="regular")
    reads.clear()
    with device_arrays.forbid_host_reads():
        first = sc.layer_rulebook(x, subm, "subm0")
        assert sc.layer_rulebook(x, subm, "subm0") is first  # reuse by key, checked without a read
        assert sc.layer_rulebook(x, subm) is first  # and by identity
    strided = sc.layer_rulebook(x, down, "down0")
    assert len(reads) == 1  # the strided build's output count
    y = sc.SparseTensor(device_arrays.to_device(np.ones((strided.num_output, 2), np.float32)),
                        strided.output_indices, strided.output_spatial_shape, 2, x.rulebooks, _checked=True)
    inverse = sc.ConvGeometry("inverse", (2, 2, 2), (1, 1, 1), (0, 0, 0), (1, 1, 1), (0, 0, 0))
    with device_arrays.forbid_host_reads():
        coarse = sc.layer_rulebook(y, subm, "subm1")
        up = sc.layer_rulebook(y, inverse, "down0")
        assert up.output_indices is indices and up.num_output == 500
    for rulebook in (first, strided, coarse, up):
        assert rulebook.stored_pairs is None and "pair_map" not in rulebook.neighbour_map.derived
    assert len(reads) == 1


@pytest.mark.parametrize("problem", ["none", "duplicate", "coordinate", "batch"])
def test_a_tensor_checks_its_sites_with_one_read(device, problem):
    """A `SparseTensor` on the GPU checks its sites in one kernel pass and one read back; a bad site
    gets the NumPy path's message."""
    _, reads = device
    indices = random_sites(rng_for(34), 300, (20, 18, 16), 2)
    if problem == "duplicate":
        indices[250] = indices[3]
    elif problem == "coordinate":
        indices[77, 3] = -1
    elif problem == "batch":
        indices[5, 0] = 2
    features = np.ones((300, 2), np.float32)
    reads.clear()
    if problem == "none":
        sc.SparseTensor(device_arrays.to_device(features), device_arrays.to_device(indices), (20, 18, 16), 2)
        assert len(reads) == 1
        return
    with pytest.raises(ValueError) as expected:
        sc.SparseTensor(features, indices, (20, 18, 16), 2)
    with pytest.raises(ValueError) as actual:
        sc.SparseTensor(device_arrays.to_device(features), device_arrays.to_device(indices), (20, 18, 16), 2)
    assert str(actual.value) == str(expected.value)


def test_a_network_forward_derives_no_pairs(device):
    """sparse_conv and sparse_max_pool on the GPU path: the only reads back are the strided builds' counts,
    and no rulebook derives its pair lists."""
    _, reads = device
    rng = rng_for(35)
    host_indices = random_sites(rng, 400, (16, 14, 12), 2)
    host_features = rng.standard_normal((400, 4)).astype(np.float32)
    host_weights = [rng.standard_normal((4, 3, 3, 3, 4)).astype(np.float32) for _ in range(3)]
    expected = sc.SparseTensor(host_features, host_indices, (16, 14, 12), 2)  # the NumPy backend's run
    for position, weight in enumerate(host_weights):
        if position == 2:
            expected = sc.sparse_max_pool(expected, 2, indice_key="p0")
        expected = sc.sparse_conv(expected, weight, kind="subm", indice_key=f"s{position // 2}")
    weights = [device_arrays.to_device(weight) for weight in host_weights]
    x = sc.SparseTensor(device_arrays.to_device(host_features), device_arrays.to_device(host_indices), (16, 14, 12), 2)
    reads.clear()
    with device_arrays.forbid_host_reads():
        x = sc.sparse_conv(x, weights[0], kind="subm", indice_key="s0")
        x = sc.sparse_conv(x, weights[1], kind="subm", indice_key="s0")
    x = sc.sparse_max_pool(x, 2, indice_key="p0")  # the pool's build reads its output count
    assert len(reads) == 1
    with device_arrays.forbid_host_reads():
        y = sc.sparse_conv(x, weights[2], kind="subm", indice_key="s1")
    assert isinstance(y.core_features, device_arrays.DeviceArray)
    do.assert_sites(np.asarray(y.core_indices), expected.core_indices)
    np.testing.assert_allclose(np.asarray(y.core_features), expected.core_features, rtol=1e-4, atol=1e-4)
    for rulebook in y.rulebooks.value.aliases.values():
        assert rulebook.stored_pairs is None and "pair_map" not in rulebook.neighbour_map.derived


@pytest.mark.parametrize("rows, volume", [(0, 27), (1, 1), (37, 27), (50, 32), (45, 33), (20, 125)])
def test_row_masks_kernel_equals_its_numpy_twin(target, rows, volume):
    """``sc_map_row_masks`` (a strided map's input masks, made when a conv first tiles that side) bitwise
    `sparsecore.neighbour_map.row_masks` of random tables (word boundaries at 32 and 33 offsets, four words)."""
    rng = rng_for(64, rows, volume)
    table = np.where(rng.random((rows, volume)) < 0.4, rng.integers(0, 1000, (rows, volume)), -1).astype(np.int32)
    masks = target.get(kernel_row_masks(target.backend.device, target.put(table)))
    expected = row_masks(np, table)
    assert masks.dtype == expected.dtype == np.uint32 and masks.shape == expected.shape
    np.testing.assert_array_equal(masks, expected)


def test_a_strided_build_leaves_the_input_masks_to_the_first_conv_over_them():
    """The kernel backend's strided map holds no input masks; an input gradient makes them once (one
    ``sc_map_row_masks``), bitwise the CPU builders'; a pool's passes never do."""
    backend = emulated_backend()
    launcher = RecordingLauncher(backend.launcher)
    recording = dataclasses.replace(backend, launcher=launcher)
    rng = rng_for(65)
    indices = random_sites(rng, 40, (7, 6, 5), 2)
    geometry = sc.ConvGeometry.create(3, 3, stride=2, padding=1, kind="regular")
    rulebook = sc.build_rulebook(indices, (7, 6, 5), 2, geometry, backend=recording)
    assert stored_masks(rulebook.neighbour_map, "input") is None
    features = rng.uniform(-1, 1, (indices.shape[0], 2)).astype(np.float32)
    weight = rng.uniform(-1, 1, (2, 3, 3, 3, 2)).astype(np.float32)
    out = sc.conv_forward(features, weight, rulebook, backend=recording)
    assert stored_masks(rulebook.neighbour_map, "input") is None  # the forward reads the output side only
    for _ in range(2):
        sc.conv_backward(out, features, weight, rulebook, backend=recording)
    assert launcher.kernel_names() >= {"sc_map_row_masks"}
    assert sum(record.expression == "sc_map_row_masks" for record in launcher.records) == 1
    expected = sc.build_rulebook(indices, (7, 6, 5), 2, geometry, backend=NUMPY_BACKEND)
    reference = neighbour_map_from_pairs(np, expected.pair_input, expected.pair_output, expected.offset_starts,
                                         expected.num_input, expected.num_output, expected.kernel_size)
    np.testing.assert_array_equal(stored_masks(rulebook.neighbour_map, "input"), reference.input_masks)
