"""sparsecore.torch's geometry step (`layer.layer_indice_data`) over the core's one geometry path.

The sharing rule is compared with spconv 2.3.8 on the same network (which
tensors see which ``indice_key``); rulebooks reused without a key (same sites,
same geometry) are counted and the values checked against the dense float64
convolution of the densified input.
"""

from __future__ import annotations

import pytest

import sparsecore.layer_geometry as layer_geometry

torch = pytest.importorskip("torch")
sctorch = pytest.importorskip("sparsecore.torch")

try:
    from . import dense_oracle as do
except ImportError:
    import dense_oracle as do

SHAPE, BATCH = [8, 7, 6], 2


def _input(library, seed: int, channels: int = 2):
    rng = do.make_rng(96000, seed)
    indices = do.random_indices(rng, SHAPE, BATCH, 0.3)
    features = torch.tensor(do.random_features(rng, indices.shape[0], channels), dtype=torch.float64)
    return library.SparseConvTensor(features, torch.from_numpy(indices), SHAPE, BATCH)


def _keys(library, seed: int) -> list[set[str]]:
    x = _input(library, seed)
    x = x.replace_feature(x.features.float())
    with torch.no_grad():
        y = library.SubMConv3d(2, 2, 3, indice_key="s1")(x)
        shared = y.replace_feature(torch.relu(y.features))
        left = library.SubMConv3d(2, 2, 5, indice_key="s2")(shared)
        right = library.SparseConv3d(2, 2, 3, 2, 1, indice_key="d")(shared)
        up = library.SparseInverseConv3d(2, 2, 3, indice_key="d")(right)
    assert shared.indice_dict is y.indice_dict, "replace_feature shares the dict"
    assert up.indices is x.indices or torch.equal(up.indices, x.indices)
    return [set(t.indice_dict) for t in (x, y, shared, left, right, up)]


def test_branches_and_keys_as_in_spconv():
    spconv_ref = pytest.importorskip("spconv.pytorch")
    ours, theirs = _keys(sctorch, 1), _keys(spconv_ref, 1)
    assert ours == theirs == [set(), {"s1"}, {"s1"}, {"s1", "s2"}, {"s1", "d"}, {"s1", "d"}]


def _counting_builds(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    built: list[str] = []
    original = layer_geometry.build_rulebook

    def counting(indices, spatial_shape, batch_size, geometry, **kwargs):
        built.append(geometry.kind)
        return original(indices, spatial_shape, batch_size, geometry, **kwargs)

    monkeypatch.setattr(layer_geometry, "build_rulebook", counting)
    return built


def test_layers_without_keys_reuse_rulebooks_of_their_sites(monkeypatch):
    built = _counting_builds(monkeypatch)
    x = _input(sctorch, 2, channels=3)
    first, second = sctorch.SubMConv3d(3, 4, 3).double(), sctorch.SubMConv3d(4, 2, 3).double()
    down = sctorch.SparseConv3d(2, 2, 3, 2, 1, indice_key="d").double()
    up = sctorch.SparseInverseConv3d(2, 2, 3, indice_key="d").double()
    third = sctorch.SubMConv3d(2, 2, 3).double()
    with torch.no_grad():
        y = second(first(x))
        restored = up(down(y))
        out = third(restored)
    assert built == ["subm", "regular"], "the subm rulebook is built once, and found again after the inverse"
    assert out.indices is x.indices
    # values: the same layers as dense convolutions of the densified input
    indices = x.indices.numpy()
    pad = do.subm_padding((3, 3, 3), 1, 3)

    def dense_subm(features, layer):
        dense = do.densify(features, indices, SHAPE, BATCH)
        return do.read_sites(do.dense_conv(dense, layer.weight.detach(), 1, pad, 1, bias=layer.bias.detach()),
                             indices)

    expected = dense_subm(dense_subm(x.features, first), second)
    do.assert_close(y.features.detach(), expected, "two unkeyed subm layers")
    expected_out = dense_subm(restored.features.detach(), third)
    do.assert_close(out.features.detach(), expected_out, "subm after the inverse conv")


def test_reassigned_sites_are_not_served_a_stale_rulebook(monkeypatch):
    built = _counting_builds(monkeypatch)
    x = _input(sctorch, 3)
    layer = sctorch.SubMConv3d(2, 2, 3).double()
    with torch.no_grad():
        y = layer(x)
        moved = y.replace_feature(y.features)
        moved.indices = torch.flip(y.indices, dims=[0]).contiguous()  # same sites, other rows
        z = layer(moved)
        shrunk = y.replace_feature(y.features)
        shrunk.spatial_shape = [n + 1 for n in SHAPE]
        layer(shrunk)
    assert built == ["subm", "subm", "subm"]
    indices = moved.indices.numpy()
    dense = do.densify(moved.features, indices, SHAPE, BATCH)
    expected = do.read_sites(do.dense_conv(dense, layer.weight.detach(), 1, 1, 1, bias=layer.bias.detach()), indices)
    do.assert_close(z.features, expected, "subm on reassigned indices")
