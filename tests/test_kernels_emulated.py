"""The CUDA kernels, run on the CPU (g++ + cuda_shim.h) or a GPU, against NumPy twins.

Every registered kernel runs through the launch wrappers of
``cuda_emulation/launchers.py`` on small seeded random inputs: empty inputs
(no launch at all), partial last blocks, and grids capped below the work so
grid-stride loops go round more than once. Integer results must be equal and
float results bitwise equal (the twins use the kernels' summation order).
The ``cupy`` variant runs the same checks where a GPU is present. The fused
feature kernels (``implicit_gemm.cu``, ``pool_maps.cu``) are tested through
their launch wrappers in test_implicit_gemm.py and test_pool_maps.py; here,
pool_maps.cu shows what the emulation's bounds checks catch.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

try:
    from cuda_emulation import harness, launchers, numpy_twins as twins
except ImportError:  # tests/ is a package: import through it
    from tests.cuda_emulation import harness, launchers, numpy_twins as twins

import sparsecore as sc
from sparsecore.backends import kernel_registry

DTYPES = tuple(twins.STORAGE_DTYPES)


def _gpu_available() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


class Backend:
    """Moves arrays to and from one backend and launches kernels on it."""

    def __init__(self, name: str) -> None:
        self.name = name
        if name == "emulated":
            self.xp = np
            get_function = lambda file, expression: harness.load_module(file).get_function(expression)  # noqa: E731
        else:
            import cupy

            self.xp = cupy
            get_function = lambda file, expression: kernel_registry.get_kernel(  # noqa: E731
                expression, cupy.cuda.Device().id
            )
        # Small blocks and a capped grid: partial blocks and grid-stride loops in every test.
        self.launch = launchers.Launcher(self.xp, get_function, block=32, max_blocks=3, tile_size=40)

    def put(self, array):
        return self.xp.asarray(array)

    def get(self, array):
        return array if self.xp is np else self.xp.asnumpy(array)


@pytest.fixture(scope="module", params=["emulated", pytest.param("cupy", marks=pytest.mark.gpu)])
def backend(request) -> Backend:
    if request.param == "emulated":
        if harness.compiler_path() is None:
            pytest.skip("g++ is not installed")
        harness.build_libraries([entry.file for entry in kernel_registry.KERNEL_FILES])
    elif not _gpu_available():
        pytest.skip("no CUDA GPU with CuPy")
    return Backend(request.param)


def _rng(*seed: int) -> np.random.Generator:
    return np.random.default_rng([20261202, *seed])


def _random_groups(rng, num_groups: int, num_members: int, max_size: int = 5):
    """CSR starts ``[G + 1]`` (int64, some groups empty) and members ``[P]`` in ``[0, num_members)``."""
    sizes = rng.integers(0, max_size + 1, size=num_groups) if num_members else np.zeros(num_groups, np.int64)
    starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    members = rng.integers(0, max(num_members, 1), size=int(starts[-1])).astype(np.int32)
    return starts, members


# ---------------------------------------------------------------- hash_table.cu


@pytest.mark.parametrize("value_dtype", [np.int32, np.int64])
@pytest.mark.parametrize("n", [0, 1, 77, 400])
def test_hash_insert_and_lookup(backend, n, value_dtype):
    rng = _rng(1, n)
    keys = rng.integers(0, max(2 * n, 1), size=n).astype(np.int64)  # many duplicates
    keys[: n // 10] = rng.integers(2**40, 2**62, size=n // 10)  # large keys too
    values = rng.permutation(n).astype(value_dtype)
    table = backend.launch.hash_build(backend.put(keys), backend.put(values))
    queries = np.concatenate([keys, rng.integers(-3, 3 * n + 3, size=50), [-1, 2**62 + 5]]).astype(np.int64)
    found = backend.get(backend.launch.hash_lookup(table, backend.put(queries)))
    assert found.dtype == value_dtype
    np.testing.assert_array_equal(found, twins.hash_lookup(keys, values, queries))
    stored = backend.get(table.keys)
    np.testing.assert_array_equal(np.sort(stored[stored >= 0]), np.unique(keys))


@pytest.mark.parametrize("n", [0, 60])
def test_hash_lookup_offsets_padded_grid(backend, n):
    rng = _rng(2, n)
    shape, batch_size = np.array([5, 6, 7]), 2
    kernel_size, dilation = np.array([3, 1, 3]), np.array([2, 1, 1])
    cells = rng.choice(batch_size * int(np.prod(shape)), size=n, replace=False)
    indices = np.column_stack(np.unravel_index(cells, (batch_size, *shape))).astype(np.int64)
    reach = (kernel_size // 2) * dilation
    padded = shape + 2 * reach
    strides = np.array([int(np.prod(padded[axis + 1:])) for axis in range(3)])
    def pack(sites):
        return sites[:, 0] * int(np.prod(padded)) + ((sites[:, 1:] + reach) * strides).sum(axis=1)
    offsets = np.array(list(itertools.product(*[range(size) for size in kernel_size]))) - kernel_size // 2
    offsets = offsets * dilation
    deltas = (offsets * strides).sum(axis=1).astype(np.int64)
    keys = pack(indices)
    table = backend.launch.hash_build(backend.put(keys), backend.put(np.arange(n, dtype=np.int32)))
    out = backend.get(backend.launch.hash_lookup_offsets(table, backend.put(keys), backend.put(deltas)))
    assert out.shape == (offsets.shape[0], n) and out.dtype == np.int32
    row_of = {tuple(site): row for row, site in enumerate(indices.tolist())}
    expected = np.full(out.shape, -1, dtype=np.int32)
    for k, offset in enumerate(offsets):
        for i, site in enumerate(indices):
            neighbour = site[1:] + offset
            if np.all((neighbour >= 0) & (neighbour < shape)):
                expected[k, i] = row_of.get((site[0], *neighbour.tolist()), -1)
    np.testing.assert_array_equal(out, expected)


@pytest.mark.parametrize("n, shape, margin", [(0, (4, 5), (0, 0)), (1, (7,), (2,)), (150, (9, 10, 11), (1, 1, 1)),
                                             (90, (300, 2, 70000), (3, 0, 1))])
def test_pack_and_unpack_keys(backend, n, shape, margin):
    rng = _rng(14, n, len(shape))
    batch = 3
    indices = np.column_stack([rng.integers(0, batch, size=n)]
                              + [rng.integers(-extra, size + extra, size=n) for size, extra in zip(shape, margin)])
    indices = indices.astype(np.int32).reshape(n, 1 + len(shape))
    strides = sc.hashing.key_strides(shape, margin)
    addends = (0, *margin)
    keys = backend.launch.pack_keys(backend.put(indices), strides, addends)
    np.testing.assert_array_equal(backend.get(keys), twins.pack_keys(indices, strides, addends))
    if n:  # the library's NumPy packing agrees (sites in the padded grid)
        np.testing.assert_array_equal(backend.get(keys), sc.pack_keys(indices, shape, batch, margin=margin))
    back = backend.launch.unpack_keys(keys, strides, addends)
    np.testing.assert_array_equal(backend.get(back), twins.unpack_keys(backend.get(keys), strides, addends))
    np.testing.assert_array_equal(backend.get(back), indices)


# ------------------------------------------------------------- segment_sums.cu


@pytest.mark.parametrize("dtype_name", ["float64"])  # the one instantiation: index_add's
@pytest.mark.parametrize("num_segments,channels", [(0, 3), (1, 1), (40, 3), (9, 17)])
def test_segment_sum_rows(backend, dtype_name, num_segments, channels):
    rng = _rng(5, num_segments, channels)
    element_type = twins.STORAGE_DTYPES[dtype_name][2]
    source = twins.random_features(rng, (90, channels), dtype_name)
    starts, order = _random_groups(rng, num_segments, 90, max_size=9)
    segment_rows = rng.permutation(50)[:num_segments].astype(np.int32)
    target = twins.random_features(rng, (50, channels), dtype_name)
    device_target = backend.put(target.copy())
    backend.launch.segment_sum_rows(device_target, backend.put(source), backend.put(order), backend.put(starts),
                                    backend.put(segment_rows), element_type)
    expected = twins.segment_sum_rows(target, source, order, starts, segment_rows, dtype_name)
    np.testing.assert_array_equal(backend.get(device_target), expected)


# ---------------------------------------------------------------- pool_maps.cu


# The row -1 guard of the forward pools' window walk.
_ROW_GUARD = "      if (row < 0) continue;\n"


def _unguarded_pool_module():
    """pool_maps.cu with the forward's row -1 guards taken out, emulated."""
    if harness.compiler_path() is None:
        pytest.skip("g++ is not installed")
    source = kernel_registry.kernel_source("pool_maps.cu")
    assert source.count(_ROW_GUARD) == 2
    return harness.load_module_from_source("pool_maps.cu", source.replace(_ROW_GUARD, ""))


def _max_pool(module, features, neighbours, num_out=None, out=None):
    num_out = neighbours.shape[0] if num_out is None else num_out
    channels = features.shape[1]
    out = np.zeros((num_out, channels), features.dtype) if out is None else out
    argmax = np.zeros((num_out, channels), np.int32)
    module.get_function("sc_max_pool_map<float>")((1,), (32,), (features, neighbours, np.int64(num_out),
                                                                np.int32(neighbours.shape[1]), np.int64(channels),
                                                                out, argmax))
    return out, argmax


def test_the_emulation_fails_loudly_on_a_row_minus_one_read():
    """Without the guard a window with a missing input reads row -1: the emulation raises, naming the access."""
    module = _unguarded_pool_module()
    features = _rng(9).standard_normal((5, 4)).astype(np.float32)
    neighbours = np.array([[0, 3], [-1, 2], [4, 1]], np.int32)  # output 1's first offset has no input
    with pytest.raises(harness.OutOfBoundsAccess,
                       match=r"sc_max_pool_map<float>: argument 0 \(p:f4, float32 \(5, 4\), 20 elements\) "
                             r"accessed element -[1-4] "):
        _max_pool(module, features, neighbours)


def test_the_emulation_catches_reads_far_past_the_end_and_any_write_past_it():
    module = _unguarded_pool_module()
    features = np.ones((6, 2), np.float32)
    with pytest.raises(harness.OutOfBoundsAccess, match=r"argument 0 .* accessed element 2000[0-9]"):
        _max_pool(module, features, np.array([[1, 10000]], np.int32))
    # a read just past the end of the table finds the canary (0x7f7f7f7f as a row): a wild access
    with pytest.raises(harness.OutOfBoundsAccess, match=r"sc_max_pool_map<float>: accessed address .* outside "
                                                        r"every array argument"):
        _max_pool(module, features, np.array([[1, 2]], np.int32), num_out=2, out=np.zeros((2, 2), np.float32))
    guarded = harness.load_module("pool_maps.cu")
    too_small = np.zeros((1, 2), np.float32)  # two outputs written into room for one
    with pytest.raises(harness.OutOfBoundsAccess, match=r"argument 5 .* wrote past its end at element 2 "):
        _max_pool(guarded, np.arange(12, dtype=np.float32).reshape(6, 2), np.array([[5, 0], [3, -1]], np.int32),
                  out=too_small)
    np.testing.assert_array_equal(too_small, [[10, 11]])  # what fits was written


# ----------------------------------------------------------------- rulebook.cu


@pytest.mark.parametrize("tile_size,block", [(40, 32), (7, 32), (100, 16), (1, 1)])
@pytest.mark.parametrize("num_rows,row_length", [(0, 5), (3, 0), (1, 1), (4, 97), (27, 30)])
def test_compact(backend, num_rows, row_length, tile_size, block):
    rng = _rng(8, num_rows, row_length, tile_size)
    values = rng.integers(0, 1000, size=(num_rows, row_length)).astype(np.int32)
    values[rng.random(values.shape) < 0.6] = -1
    launch = launchers.Launcher(backend.xp, backend.launch.get_function, block=block, max_blocks=3,
                                tile_size=tile_size)
    pair_column, pair_value, row_counts = launch.compact(backend.put(values))
    expected_column, expected_value, expected_counts = twins.compact(values)
    np.testing.assert_array_equal(backend.get(pair_column), expected_column)
    np.testing.assert_array_equal(backend.get(pair_value), expected_value)
    np.testing.assert_array_equal(backend.get(row_counts), expected_counts)


CANDIDATE_GEOMETRIES = [
    # kernel_size, stride, padding, dilation
    ((3, 3, 3), (2, 2, 2), (1, 1, 1), (1, 1, 1)),
    ((2, 3, 1), (2, 1, 3), (0, 2, 0), (1, 2, 1)),
    ((3, 3), (3, 2), (1, 0), (2, 1)),
]


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("geometry", CANDIDATE_GEOMETRIES)
@pytest.mark.parametrize("n", [0, 50])
def test_conv_candidates(backend, n, geometry, transposed):
    kernel_size, stride, padding, dilation = (np.array(value) for value in geometry)
    rng = _rng(9, n, len(kernel_size), int(transposed))
    shape = np.array([7, 6, 9][: len(kernel_size)])
    if transposed:
        out_shape = (shape - 1) * stride - 2 * padding + dilation * (kernel_size - 1) + 1
    else:
        out_shape = (shape + 2 * padding - dilation * (kernel_size - 1) - 1) // stride + 1
    columns = [rng.integers(0, 3, size=n)] + [rng.integers(0, size, size=n) for size in shape]
    indices = np.column_stack(columns).astype(np.int32)
    positions = np.array(list(itertools.product(*[range(size) for size in kernel_size])), dtype=np.int32)
    keys = backend.launch.conv_candidates(backend.put(indices), backend.put(positions), stride, padding, dilation,
                                          out_shape, transposed)
    expected = twins.conv_candidates(indices, positions, stride, padding, dilation, out_shape, transposed)
    assert keys.shape == (positions.shape[0], n)
    np.testing.assert_array_equal(backend.get(keys), expected)


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("geometry", CANDIDATE_GEOMETRIES)
@pytest.mark.parametrize("n", [0, 50])
def test_map_candidates(backend, n, geometry, transposed):
    """neighbour_map.cu's candidates: the same keys as the pair builder's twin, laid out [n, K], the offset
    positions computed in the kernel, sites of a batch element >= batch_size refused."""
    kernel_size, stride, padding, dilation = (np.array(value) for value in geometry)
    rng = _rng(14, n, len(kernel_size), int(transposed))
    shape = np.array([7, 6, 9][: len(kernel_size)])
    if transposed:
        out_shape = (shape - 1) * stride - 2 * padding + dilation * (kernel_size - 1) + 1
    else:
        out_shape = (shape + 2 * padding - dilation * (kernel_size - 1) - 1) // stride + 1
    columns = [rng.integers(0, 3, size=n)] + [rng.integers(0, size, size=n) for size in shape]
    indices = np.column_stack(columns).astype(np.int32).reshape(n, 1 + len(shape))
    positions = np.array(list(itertools.product(*[range(size) for size in kernel_size])), dtype=np.int32)
    volume = positions.shape[0]

    def axes(values):
        return [np.int64(value) for value in list(values) + [0] * (4 - len(values))]

    keys = backend.xp.empty(n * volume, dtype=np.int64)
    backend.launch._launch("sc_map_candidates", [], n * volume,
                           [backend.put(indices), np.int64(n), np.int32(len(shape)), np.int64(2),
                            *axes(kernel_size), *axes(stride), *axes(padding), *axes(dilation), *axes(out_shape),
                            np.int32(transposed), np.int32(volume), keys])
    expected = twins.conv_candidates(indices, positions, stride, padding, dilation, out_shape, transposed)
    expected[:, indices[:, 0] >= 2] = -1  # batch_size 2: the third batch element is outside
    np.testing.assert_array_equal(backend.get(keys).reshape(n, volume), expected.T)


def test_submanifold_rulebook_composes(backend):
    """pack (padded) -> hash -> lookup_offsets -> compact gives exactly the brute-force pairs."""
    rng = _rng(10)
    shape, reach, n = np.array([6, 5, 8]), np.array([1, 1, 1]), 120
    cells = rng.choice(2 * int(np.prod(shape)), size=n, replace=False)
    indices = np.column_stack(np.unravel_index(cells, (2, *shape))).astype(np.int64)
    padded = shape + 2 * reach
    strides = np.array([padded[1] * padded[2], padded[2], 1])
    keys = indices[:, 0] * int(np.prod(padded)) + ((indices[:, 1:] + reach) * strides).sum(axis=1)
    offsets = np.array(list(itertools.product(range(3), range(3), range(3)))) - 1
    table = backend.launch.hash_build(backend.put(keys), backend.put(np.arange(n, dtype=np.int32)))
    lookup = backend.launch.hash_lookup_offsets(table, backend.put(keys), backend.put((offsets * strides).sum(1)))
    output_rows, input_rows, counts = backend.launch.compact(lookup)
    starts = np.concatenate([[0], np.cumsum(backend.get(counts))])
    for k, offset in enumerate(offsets):
        difference = indices[None, :, :] - indices[:, None, :]  # [out, in, 1 + D]
        match = (difference[..., 0] == 0) & np.all(difference[..., 1:] == offset, axis=2)
        expected_out, expected_in = np.nonzero(match)
        np.testing.assert_array_equal(backend.get(output_rows)[starts[k]:starts[k + 1]], expected_out)
        np.testing.assert_array_equal(backend.get(input_rows)[starts[k]:starts[k + 1]], expected_in)


# ------------------------------------------------------------------ harness


def test_emulation_builds_without_warnings(backend):
    if backend.name != "emulated":
        pytest.skip("checks the emulation build itself")
    for entry in kernel_registry.KERNEL_FILES:
        assert harness.build_warnings(entry.file) == "", entry.file


def test_launches_are_checked_against_kernel_signatures(backend):
    if backend.name != "emulated":
        pytest.skip("checks the emulation harness itself")
    kernel = harness.load_module("pool_maps.cu").get_function("sc_avg_pool_map<float>")
    features, neighbours, out = np.zeros((2, 2), np.float32), np.zeros((1, 1), np.int32), np.zeros((1, 2), np.float32)
    with pytest.raises(TypeError, match="NumPy scalar"):
        kernel((1,), (32,), (features, neighbours, 1, np.int32(1), np.int64(2), out))  # a Python int
    with pytest.raises(TypeError, match="dtype float64"):
        kernel((1,), (32,), (features.astype(np.float64), neighbours, np.int64(1), np.int32(1), np.int64(2), out))
    with pytest.raises(ValueError, match="at least one block"):
        kernel((0,), (32,), (features, neighbours, np.int64(1), np.int32(1), np.int64(2), out))
