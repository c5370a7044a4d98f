"""Tests of rulebooks (kernel maps) against a brute-force pair enumeration.

Every pair set is compared with ``dense_oracle.naive_rulebook``, a plain
Python loop over sites and kernel offsets that shares no code with the
library. Also checked: the layout of a `Rulebook` (pairs grouped by offset,
``offset_starts``, the subm identity offset), injectivity within an offset,
`inverse_rulebook`, reuse checks (`check_rulebook_fits`), key packing and the
hash table, and the errors for duplicate or out-of-range coordinates.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import sparsecore as sc

try:
    from . import dense_oracle as do
except ImportError:
    import dense_oracle as do

CASES = (do.sample_cases("subm", 24, ndims=(1, 2, 3, 4), base_seed=7000, grouped=False, max_kernel=3)
         + do.sample_cases("regular", 32, ndims=(1, 2, 3, 4), base_seed=7100, grouped=False, max_kernel=4)
         + do.sample_cases("transposed", 24, ndims=(1, 2, 3, 4), base_seed=7200, grouped=False, max_kernel=4))


def _geometry(case, kind=None):
    kind = kind or case.kind
    if kind == "subm":
        return sc.ConvGeometry.create(case.ndim, case.kernel_size, dilation=case.dilation, kind="subm")
    return sc.ConvGeometry.create(case.ndim, case.kernel_size, stride=case.stride, padding=case.padding,
                                  dilation=case.dilation, output_padding=case.output_padding, kind=kind)


def _naive(case, indices, kind=None):
    return do.naive_rulebook(indices, case.spatial_shape, case.batch_size, kind or case.kind, case.kernel_size,
                             case.stride, case.padding, case.dilation, case.output_padding)


def _pair_set(ins, outs):
    return set(zip(np.asarray(ins).tolist(), np.asarray(outs).tolist()))


@pytest.mark.parametrize("case", CASES, ids=str)
def test_pairs_match_brute_force(case):
    _, indices, _ = case.inputs()
    geom = _geometry(case)
    rb = sc.build_rulebook(indices, case.spatial_shape, case.batch_size, geom)
    naive = _naive(case, indices)
    kvol = int(np.prod(case.kernel_size))
    assert rb.geometry == geom
    assert rb.kernel_volume == kvol
    assert rb.batch_size == case.batch_size
    assert tuple(rb.input_spatial_shape) == case.spatial_shape
    assert tuple(rb.output_spatial_shape) == naive.output_spatial_shape
    do.assert_sites(rb.input_indices, indices, "input_indices")
    do.assert_sites(rb.output_indices, naive.output_indices)
    assert rb.num_input == indices.shape[0] and rb.num_output == naive.output_indices.shape[0]
    assert rb.input_indices.dtype == np.int32 and rb.output_indices.dtype == np.int32
    assert rb.pair_input.dtype == np.int32 and rb.pair_output.dtype == np.int32

    starts = tuple(rb.offset_starts)
    assert len(starts) == kvol + 1 and starts[0] == 0 and starts[-1] == rb.num_pairs
    assert all(a <= b for a, b in zip(starts, starts[1:]))
    assert rb.num_pairs == sum(i.size for i, _ in naive.pairs)
    for k in range(kvol):
        ins, outs = rb.pairs(k)
        np.testing.assert_array_equal(ins, rb.pair_input[starts[k]:starts[k + 1]])
        np.testing.assert_array_equal(outs, rb.pair_output[starts[k]:starts[k + 1]])
        assert len(set(np.asarray(ins).tolist())) == len(ins), f"offset {k}: an input row repeats"
        assert len(set(np.asarray(outs).tolist())) == len(outs), f"offset {k}: an output row repeats"
        assert _pair_set(ins, outs) == _pair_set(*naive.pairs[k]), f"offset {k}: pairs differ"

    if case.kind == "subm":
        centre = (kvol - 1) // 2
        assert rb.identity_offset == centre
    if rb.identity_offset != -1:
        ins, outs = rb.pairs(rb.identity_offset)
        np.testing.assert_array_equal(ins, np.arange(rb.num_input))
        np.testing.assert_array_equal(outs, np.arange(rb.num_input))


@pytest.mark.parametrize("case", [c for c in CASES if c.kind == "regular"], ids=str)
def test_inverse_rulebook(case):
    _, indices, _ = case.inputs()
    rb = sc.build_rulebook(indices, case.spatial_shape, case.batch_size, _geometry(case))
    inv = sc.inverse_rulebook(rb)
    assert inv.geometry.kind == "inverse"
    assert tuple(inv.geometry.kernel_size) == case.kernel_size
    do.assert_sites(inv.output_indices, indices, "inverse output_indices")
    do.assert_sites(inv.input_indices, rb.output_indices, "inverse input_indices")
    assert tuple(inv.input_spatial_shape) == tuple(rb.output_spatial_shape)
    assert tuple(inv.output_spatial_shape) == case.spatial_shape
    assert inv.batch_size == case.batch_size
    assert inv.kernel_volume == rb.kernel_volume and inv.num_pairs == rb.num_pairs
    assert inv.identity_offset == -1 or np.array_equal(inv.pairs(inv.identity_offset)[0], np.arange(inv.num_input))
    naive = _naive(case, indices)
    for k in range(rb.kernel_volume):
        ins, outs = inv.pairs(k)
        assert _pair_set(outs, ins) == _pair_set(*naive.pairs[k]), f"offset {k}: inverse pairs not swapped"


@pytest.mark.parametrize("ndim", [1, 2, 3, 4])
def test_kernel_offsets_row_major(ndim):
    kernel = (3, 1, 2, 2)[:ndim]
    offsets = sc.ConvGeometry.create(ndim, kernel).kernel_offsets()
    assert offsets.dtype == np.int32
    expected = np.array(list(np.ndindex(*kernel)), dtype=np.int32)
    np.testing.assert_array_equal(offsets, expected)


# -------------------------------------------------------------------- reuse


def test_check_rulebook_fits():
    rng = do.make_rng(11)
    shape = (6, 7, 5)
    indices = do.random_indices(rng, shape, 2, 0.3)
    g3 = sc.ConvGeometry.create(3, 3, kind="subm")
    g5 = sc.ConvGeometry.create(3, 5, kind="subm")
    rb = sc.build_rulebook(indices, shape, 2, g3)
    sc.check_rulebook_fits(rb, g3, indices, shape, "subm1")
    sc.check_rulebook_fits(rb, g3, indices.copy(), shape, "subm1")  # equal content, another array
    with pytest.raises(ValueError, match="subm1") as info:
        sc.check_rulebook_fits(rb, g5, indices, shape, "subm1")
    message = str(info.value)
    assert "(3, 3, 3)" in message and "(5, 5, 5)" in message, f"names both geometries: {message}"
    with pytest.raises(ValueError, match="subm1"):
        sc.check_rulebook_fits(rb, g3, indices, (6, 7, 6), "subm1")
    with pytest.raises(ValueError, match="subm1"):
        sc.check_rulebook_fits(rb, g3, indices[:-1], shape, "subm1")
    other = indices.copy()
    other[0, 1:] = [(c + 1) % s for c, s in zip(other[0, 1:], shape)]
    if len({tuple(r) for r in other.tolist()}) == len(other):
        with pytest.raises(ValueError, match="subm1"):
            sc.check_rulebook_fits(rb, g3, other, shape, "subm1")
    g_strided = sc.ConvGeometry.create(3, 3, stride=2, padding=1)
    with pytest.raises(ValueError, match="subm1"):
        sc.check_rulebook_fits(rb, g_strided, indices, shape, "subm1")


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize("kind", ["subm", "regular", "transposed"])
def test_duplicate_coordinates_rejected(kind):
    indices = np.array([[0, 1, 2], [1, 1, 2], [0, 3, 0], [0, 1, 2]], dtype=np.int32)
    geom = sc.ConvGeometry.create(2, 3, kind=kind)
    with pytest.raises(ValueError, match="(?i)duplicate"):
        sc.build_rulebook(indices, (4, 4), 2, geom)


def test_duplicate_coordinates_rejected_through_tensor_api():
    # the rule: a tensor with one site twice is refused where it is made, naming both rows
    indices = np.array([[0, 1, 2, 3], [0, 0, 0, 0], [0, 1, 2, 3]], dtype=np.int32)
    with pytest.raises(ValueError, match=r"(?i)indices contains duplicate sites: rows 0 and 2"):
        sc.SparseTensor(np.ones((3, 2)), indices, (4, 4, 4), 1)


_GEOM = sc.ConvGeometry.create(2, 3, stride=2, padding=1)


@pytest.mark.parametrize(
    "indices,batch_size,match",
    [
        (np.array([[0, -1, 2]]), 1, "indices"),
        (np.array([[0, 1, 4]]), 1, "indices|spatial_shape"),
        (np.array([[0, 5, 0]]), 1, "indices|spatial_shape"),
        (np.array([[2, 0, 0]]), 2, "(?i)batch"),
        (np.array([[-1, 0, 0]]), 2, "(?i)batch|indices"),
        (np.array([[0, 1]]), 1, "indices"),
        (np.array([0, 1, 2]), 1, "indices"),
    ],
    ids=["negative", "x-too-large", "y-too-large", "batch-too-large", "batch-negative", "columns", "1-d"],
)
def test_bad_indices(indices, batch_size, match):
    with pytest.raises(ValueError, match=match):
        sc.build_rulebook(indices.astype(np.int32), (5, 4), batch_size, _GEOM)


def test_non_integer_indices():
    with pytest.raises((TypeError, ValueError), match="indices"):
        sc.build_rulebook(np.array([[0.0, 1.0, 2.0]]), (5, 4), 1, _GEOM)


def test_int64_indices_accepted():
    indices = np.array([[0, 1, 2], [0, 3, 3]], dtype=np.int64)
    rb = sc.build_rulebook(indices, (5, 4), 1, _GEOM)
    assert rb.input_indices.dtype == np.int32
    do.assert_sites(rb.output_indices, do.regular_sites(indices, (5, 4), 1, 3, 2, 1, 1))


# ------------------------------------------------------------- key packing


def test_pack_keys_row_major():
    rng = do.make_rng(12)
    shape = (5, 7, 3)
    indices = do.random_indices(rng, shape, 3, 0.4)
    keys = sc.pack_keys(indices, shape, 3)
    assert keys.dtype == np.int64
    expected = np.ravel_multi_index(tuple(indices.T.astype(np.int64)), (3,) + shape)
    np.testing.assert_array_equal(keys, expected)
    back = sc.unpack_keys(keys, shape)
    assert back.dtype == np.int32
    np.testing.assert_array_equal(back, indices)


def test_pack_keys_overflow():
    shape = (2 ** 21, 2 ** 21, 2 ** 21)
    with pytest.raises(ValueError):
        sc.pack_keys(np.zeros((1, 4), np.int32), shape, 2)


def test_hash_table():
    rng = do.make_rng(13)
    keys = rng.choice(10 ** 9, size=500, replace=False).astype(np.int64)
    values = rng.integers(0, 10 ** 6, size=500).astype(np.int64)
    table = sc.HashTable(keys, values)
    assert len(table) == 500
    queries = np.concatenate([keys[::3], rng.integers(10 ** 9, 2 * 10 ** 9, size=50)])
    reference = dict(zip(keys.tolist(), values.tolist()))
    expected = np.array([reference.get(q, -1) for q in queries.tolist()])
    np.testing.assert_array_equal(table.lookup(queries), expected)
    default = sc.HashTable(keys)
    np.testing.assert_array_equal(default.lookup(keys[:10]), np.arange(10))
    got_keys, got_values = table.items()
    assert dict(zip(np.asarray(got_keys).tolist(), np.asarray(got_values).tolist())) == reference
    with pytest.raises(ValueError, match="(?i)duplicate|unique"):
        sc.HashTable(np.array([3, 5, 3], dtype=np.int64))
    empty = sc.HashTable(np.zeros(0, np.int64))
    assert len(empty) == 0
    np.testing.assert_array_equal(empty.lookup(np.array([1, 2], np.int64)), [-1, -1])


# ------------------------------------------------------------- large grids


def _border_sites(rng, shape, batch_size, count):
    """Sites crowded at the grid's borders (0, 1, n-2, n-1) and a few anywhere."""
    rows = []
    for _ in range(count):
        coords = [int(rng.choice([0, 1, n - 2, n - 1, int(rng.integers(n))])) for n in shape]
        rows.append((int(rng.integers(batch_size)), *coords))
    rows = np.unique(np.array(rows, dtype=np.int64), axis=0)
    rng.shuffle(rows)
    return rows.astype(np.int32)


_LARGE = [
    ((41, 1600, 1408), 2, "subm", 3, 1, 0, 1, 0),
    ((41, 1600, 1408), 2, "regular", 3, 2, 1, 1, 0),
    ((41, 1600, 1408), 3, "regular", (3, 1, 1), (2, 1, 1), 0, 1, 0),
    ((41, 1600, 1408), 2, "transposed", 3, 2, 1, 1, 1),
    ((41, 1600, 1408), 2, "subm", 3, 1, 0, 2, 0),
    ((2 ** 20, 2 ** 20, 2 ** 20), 2, "regular", 3, 2, 1, 1, 0),
    ((2 ** 20, 2 ** 20, 2 ** 20), 4, "subm", 3, 1, 0, 3, 0),
    ((2 ** 15,) * 4, 3, "regular", 2, 2, 0, 1, 0),
    ((3, 2 ** 31 - 1), 2, "regular", 3, 2, 2, 1, 0),
    ((5, 2 ** 31 - 1), 1, "subm", 5, 1, 0, 1, 0),
]


@pytest.mark.parametrize("spec", _LARGE, ids=lambda s: f"{s[2]}-{'x'.join(map(str, s[0]))}-b{s[1]}")
def test_large_grid_pairs_match_brute_force(spec):
    shape, batch_size, kind, k, s, p, d, op = spec
    rng = do.make_rng(len(shape), batch_size, sum(shape) % 1000)
    indices = _border_sites(rng, shape, batch_size, 80)
    geom = (sc.ConvGeometry.create(len(shape), k, dilation=d, kind="subm") if kind == "subm"
            else sc.ConvGeometry.create(len(shape), k, s, p, d, op, kind=kind))
    rb = sc.build_rulebook(indices, shape, batch_size, geom)
    naive = do.naive_rulebook(indices, shape, batch_size, kind, k, s, p, d, op)
    do.assert_sites(rb.output_indices, naive.output_indices)
    for kk in range(rb.kernel_volume):
        assert _pair_set(*rb.pairs(kk)) == _pair_set(*naive.pairs[kk]), f"offset {kk}"


def test_output_coordinates_beyond_int32_raise():
    """A transposed conv whose output grid exceeds int32 coordinates must not wrap around."""
    indices = np.array([[0, 2, 2 ** 31 - 2], [0, 0, 5]], np.int32)
    geom = sc.ConvGeometry.create(2, 3, stride=2, padding=1, output_padding=1, kind="transposed")
    with pytest.raises(ValueError):
        rb = sc.build_rulebook(indices, (3, 2 ** 31 - 1), 1, geom)
        assert rb.output_indices.min() >= 0, f"wrapped output coordinates: {rb.output_indices.min()}"


def test_torch_indices_accepted():
    indices = torch.as_tensor(np.array([[0, 1, 2], [0, 3, 3], [1, 0, 0]], dtype=np.int64))
    rb = sc.build_rulebook(indices, (5, 4), 2, _GEOM)
    do.assert_sites(rb.output_indices, do.regular_sites(indices.numpy(), (5, 4), 2, 3, 2, 1, 1))


# --------------------------------------------------------------------------- refusals (issue 16)

_CHECK_SHAPE = (5, 6, 7)


def _check_sites(seed: int, batch: int = 2) -> np.ndarray:
    return do.random_indices(do.make_rng(16000, seed), _CHECK_SHAPE, batch)


def test_pack_keys_refuses_sites_that_would_collide():
    indices = _check_sites(7)
    keys = sc.pack_keys(indices, _CHECK_SHAPE, 2)
    assert np.array_equal(keys, np.ravel_multi_index(indices.T.astype(np.int64), (2,) + _CHECK_SHAPE))
    for column, value in ((1, _CHECK_SHAPE[0]), (2, -1), (0, 2), (3, _CHECK_SHAPE[2] + 5)):
        bad = indices.copy()
        bad[3, column] = value
        with pytest.raises(ValueError, match=r"indices\[3\] = .* outside .* pack into the key of another site"):
            sc.pack_keys(bad, _CHECK_SHAPE, 2)
    with pytest.raises(TypeError, match="indices must be an integer array"):
        sc.pack_keys(indices.astype(np.float64), _CHECK_SHAPE, 2)


def test_pack_keys_margin_allows_the_padded_grid():
    indices = np.array([[0, -1, 0, 7]], np.int32)
    margin = (1, 0, 1)
    keys = sc.pack_keys(indices, _CHECK_SHAPE, 1, margin=margin)
    padded = tuple(s + 2 * m for s, m in zip(_CHECK_SHAPE, margin))
    assert int(keys[0]) == np.ravel_multi_index((0, 0, 0, 8), (1,) + padded)
    assert np.array_equal(sc.unpack_keys(keys, _CHECK_SHAPE, margin), indices)


def test_hash_table_lookup_refuses_float_queries():
    table = sc.HashTable(np.array([20, 5, 7], np.int64))
    with pytest.raises(TypeError, match="queries must be an integer array, got dtype float64"):
        table.lookup(np.array([20.7]))
    assert table.lookup(np.array([20, 21, -4, 2**62], np.int64)).tolist() == [0, -1, -1, -1]
    assert table.lookup(np.array([7], np.uint8)).tolist() == [2]


def test_pair_map_refuses_negative_and_out_of_range_rows_unless_padded():
    rows = np.array([0, 1, 2], np.int32)
    starts = (0, 3)
    sc.PairMap(rows, rows, starts, 3, 3, (1,))
    with pytest.raises(ValueError, match=r"pair_input holds row -1, outside \[0, 3\).*never wrapped"):
        sc.PairMap(np.array([0, -1, 2], np.int32), rows, starts, 3, 3, (1,))
    with pytest.raises(ValueError, match=r"pair_output holds row 3, outside \[0, 3\)"):
        sc.PairMap(rows, np.array([0, 1, 3], np.int32), starts, 3, 3, (1,))
    with pytest.raises(TypeError, match="pair_input must be a 1-D integer array"):
        sc.PairMap(rows.astype(np.float32), rows, starts, 3, 3, (1,))
    # the kernels' padded convention: -1 = no pair, and only -1
    padded = sc.PairMap(np.array([0, -1, 2], np.int32), rows, starts, 3, 3, (1,), padded=True)
    assert padded.num_pairs == 3
    with pytest.raises(ValueError, match=r"outside \[-1, 3\)"):
        sc.PairMap(np.array([0, -2, 2], np.int32), rows, starts, 3, 3, (1,), padded=True)
