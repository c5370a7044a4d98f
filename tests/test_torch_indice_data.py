"""`sparsecore.torch.IndiceData` (a view over the core rulebook) and `IndiceDict`, against spconv 2.3.8.

The attributes spconv users read are compared with spconv's own `IndiceData`
for the same layer on the same input (the pairs of each kernel offset as sets,
since the order within an offset is free); the torch views are checked to be
zero-copy views of the core arrays, made once.
"""

from __future__ import annotations

import pickle

import numpy as np
import pytest

torch = pytest.importorskip("torch")
spconv_ref = pytest.importorskip("spconv.pytorch")
sctorch = pytest.importorskip("sparsecore.torch")

from sparsecore.torch.indice_data import IndiceDict  # noqa: E402

try:
    from . import dense_oracle as do
except ImportError:
    import dense_oracle as do

SHAPE, BATCH = [7, 6, 5], 2


def _inputs(seed: int):
    rng = do.make_rng(95000, seed)
    indices = torch.from_numpy(do.random_indices(rng, SHAPE, BATCH, 0.3))
    features = torch.tensor(do.random_features(rng, indices.shape[0], 2), dtype=torch.float32)
    return features, indices


def _both(layer_name: str, *args, **kwargs):
    """The IndiceData that spconv and sparsecore.torch save for one layer on one input."""
    features, indices = _inputs(len(layer_name) + len(args))
    saved = []
    for library in (spconv_ref, sctorch):
        x = library.SparseConvTensor(features, indices, SHAPE, BATCH)
        with torch.no_grad():
            y = getattr(library, layer_name)(*args, indice_key="k", **kwargs)(x)
        saved.append((y.indice_dict["k"], y))
    return saved


def _offset_pair_sets(indice_pairs: torch.Tensor) -> list[set[tuple[int, int]]]:
    result = []
    for k in range(indice_pairs.shape[1]):
        inputs, outputs = indice_pairs[0, k].tolist(), indice_pairs[1, k].tolist()
        result.append({(i, o) for i, o in zip(inputs, outputs) if i >= 0})
    return result


def _sites_by_row(indices: torch.Tensor) -> dict[tuple[int, ...], int]:
    return {tuple(row): position for position, row in enumerate(indices.tolist())}


@pytest.mark.parametrize("layer", [("SubMConv3d", (2, 2, 3), {}),
                                   ("SparseConv3d", (2, 2, 3, 2, 1), {}),
                                   ("SparseConv3d", (2, 2, (3, 2, 3), (2, 1, 2), (1, 0, 0)), {"dilation": 1}),
                                   ("SparseMaxPool3d", (2,), {})])
def test_attributes_match_spconvs(layer):
    name, args, kwargs = layer
    (theirs, their_out), (ours, our_out) = _both(name, *args, **kwargs)
    for attribute in ("spatial_shape", "out_spatial_shape", "is_subm", "ksize", "stride", "padding", "dilation",
                      "voxel_num"):
        if attribute == "padding" and ours.is_subm:
            # spconv records the subm layer's (unused) padding argument; sparsecore the padding it applies
            assert ours.padding == [k // 2 for k in ours.ksize]
            continue
        assert getattr(ours, attribute) == getattr(theirs, attribute), attribute
    # spconv's subm rulebook holds the offsets before the centre only (the rest are their mirror images)
    compared = len(ours.indice_pair_num) // 2 if ours.is_subm else len(ours.indice_pair_num)
    assert torch.equal(ours.indice_pair_num[:compared], theirs.indice_pair_num[:compared])
    assert torch.equal(ours.indices, theirs.indices)
    assert ours.indice_pairs.shape == theirs.indice_pairs.shape
    # output rows are numbered differently (spconv does not sort): compare pairs by output site
    their_rows, our_rows = _sites_by_row(theirs.out_indices), _sites_by_row(ours.out_indices)
    assert set(their_rows) == set(our_rows)
    rename = {our_rows[site]: their_rows[site] for site in our_rows}
    ours_renamed = [{(i, rename[o]) for i, o in pairs} for pairs in _offset_pair_sets(ours.indice_pairs)]
    assert ours_renamed[:compared] == _offset_pair_sets(theirs.indice_pairs)[:compared]
    assert our_out.indices is ours.out_indices


def test_torch_views_are_zero_copy_and_made_once():
    (_, _), (data, y) = _both("SparseConv3d", 2, 2, 3, 2, 1)
    rulebook = data.rulebook
    assert data.pair_input is data.pair_input and data.pair_output is data.pair_output
    assert data.pair_input.data_ptr() == rulebook.pair_input.ctypes.data
    assert data.pair_output.data_ptr() == rulebook.pair_output.ctypes.data
    assert data.out_indices.data_ptr() == rulebook.output_indices.ctypes.data
    assert data.out_core_indices is rulebook.output_indices
    assert data.offset_starts == list(rulebook.offset_starts) and data.kernel_size == [3, 3, 3]
    assert (data.num_input, data.num_output) == (rulebook.num_input, rulebook.num_output)
    assert data.identity_offset == -1
    inverse = data.inverse()
    assert inverse.indices is data.out_indices and inverse.out_indices is data.indices
    assert inverse.pair_input.data_ptr() == data.pair_output.data_ptr()
    assert "IndiceData(regular geometry" in repr(data)


def test_indice_dict_is_a_dict_of_its_keys():
    (_, _), (data, y) = _both("SubMConv3d", 2, 2, 3)
    assert isinstance(y.indice_dict, IndiceDict) and isinstance(y.indice_dict, dict)
    assert y.indice_dict == {"k": data} and len(y.indice_dict.geometry_cache.canonical) == 1
    plain = y.indice_dict.copy()
    assert type(plain) is dict and plain == y.indice_dict
    back = pickle.loads(pickle.dumps(y.indice_dict))
    assert type(back) is dict and list(back) == ["k"]
    assert torch.equal(back["k"].pair_input, data.pair_input)
    # a plain dict (a user's, or a copy) works: the key is found and checked, nothing canonical is needed
    z = y.replace_feature(y.features)
    z.indice_dict = plain
    with torch.no_grad():
        again = sctorch.SubMConv3d(2, 3, 3, indice_key="k")(z)
    assert again.find_indice_pair("k") is data and again.indices is y.indices


def test_neighbour_tensors_are_the_rulebooks_map():
    """The tensors the ops carry hold the rulebook's pairs per row (checked against the pair view itself); an
    inverse conv's are its paired layer's read backwards."""
    features, indices = _inputs(7)
    x = sctorch.SparseConvTensor(features, indices, SHAPE, BATCH)
    with torch.no_grad():
        y = sctorch.SparseConv3d(2, 3, 3, 2, 1, indice_key="d")(x)
        z = sctorch.SparseInverseConv3d(3, 2, 3, indice_key="d")(y)
    down = y.indice_dict["d"]
    up = sctorch.layer.layer_indice_data("up", y, sctorch.SparseInverseConv3d(3, 2, 3, indice_key="d")._geometry,
                                         "d")[0]
    assert z.indices is x.indices
    for data in (down, up):
        table = np.full((data.num_output, 27), -1)
        inverse = np.full((data.num_input, 27), -1)
        for k in range(27):
            rows_in, rows_out = (np.asarray(rows) for rows in data.rulebook.pairs(k))
            table[rows_out, k], inverse[rows_in, k] = rows_in, rows_out
        np.testing.assert_array_equal(data.output_neighbours.numpy(), table)
        np.testing.assert_array_equal(data.input_neighbours.numpy(), inverse)
    assert up.output_neighbours.data_ptr() == down.input_neighbours.data_ptr()  # the same table, swapped
    (_, _), (subm, _) = _both("SubMConv3d", 2, 2, 3)
    assert subm.input_neighbours is None and subm.output_neighbours.shape == (subm.num_output, 27)
