"""``sc_implicit_gemm``'s offset splits (``kernels_cu/implicit_gemm.cu``): forced on small maps, against twins.

A forward or input gradient with fewer output tiles than the GPU has block
slots splits each tile's offsets over several blocks; the last block of a
tile to finish adds the partial tiles in split order. On the emulation, small
maps already split by default (`tile_shapes.forward_splits` for 132 SMs), so
every fused-kernel test runs them; here the split count is forced (2 up to
more splits than the tile has offsets: empty splits) in every engine and on
the sm_75 code path, and checked against the float64 twins of
``cuda_emulation/fused_twins.py``: bitwise on small-integer data, within a
GEMM bound on random data, two runs bitwise equal, whichever block of a tile
finishes last (grids of 1 to 5 blocks), with the map's counters back at zero
after every launch and its scratch allocated once.
"""

from __future__ import annotations

import numpy as np
import pytest

from sparsecore.backends import _kernel_fused, tile_shapes
from sparsecore.backends._kernel_fused import FusedPasses

try:
    from cuda_emulation import fused_twins as twins, harness
    from cuda_emulation.numpy_twins import narrow
    from fused_maps import bits, on_target, random_map, storage, symmetric_map
    from kernel_targets import rng_for, target  # noqa: F401
except ImportError:  # tests/ imported as a package
    from tests.cuda_emulation import fused_twins as twins, harness
    from tests.cuda_emulation.numpy_twins import narrow
    from tests.fused_maps import bits, on_target, random_map, storage, symmetric_map
    from tests.kernel_targets import rng_for, target  # noqa: F401

ENGINES = [("float32", False), ("float64", False), ("float16", False), ("bfloat16", False), ("float32", True)]
ENGINE_IDS = ["float32", "float64", "float16", "bfloat16", "tf32"]
SCRATCH = "fused split scratch"  # _kernel_fused's key in NeighbourMap.derived


def _counters(target, neighbour_map) -> np.ndarray:
    scratch = neighbour_map.derived[SCRATCH]
    return np.asarray(target.get(scratch.buffer))[:scratch.counter_words]


@pytest.mark.parametrize("engine", ENGINES, ids=ENGINE_IDS)
def test_split_offsets_are_exact_and_leave_the_counters_at_zero(target, engine):
    """Forward (with bias) and input gradient over a 9-offset map of 3 row tiles, in 3 and in 13 splits
    (more than the tile's offsets: empty splits), equal the exact twins bitwise."""
    dtype_name, tf32 = engine
    rng = rng_for(60, ENGINES.index(engine))
    neighbour_map = random_map(rng, 150, 140, (3, 3), density=0.6)
    device_map = on_target(target, neighbour_map)
    features = twins.small_integers(rng, (150, 20), dtype_name)
    weight = twins.small_integers(rng, (24, 9, 20), dtype_name)
    bias = twins.small_integers(rng, (24,), dtype_name)
    grad_output = twins.small_integers(rng, (140, 24), dtype_name)
    put = lambda array: storage(target, array, dtype_name)  # noqa: E731
    passes = FusedPasses(target.backend.device, tf32)
    forward = narrow(twins.implicit_gemm(features, weight, bias, neighbour_map.output_neighbours, 1, dtype_name),
                     dtype_name)
    backward = narrow(twins.implicit_gemm(grad_output, weight, None, neighbour_map.input_neighbours, 1, dtype_name,
                                          transposed=True), dtype_name)
    for splits in (3, 13):
        out = passes.conv_forward(put(features), put(weight), device_map, put(bias), 1, splits=splits)
        np.testing.assert_array_equal(bits(target, out, dtype_name), forward, f"forward, {splits} splits")
        assert not _counters(target, device_map).any()
        grad_features, _ = passes.conv_backward(put(grad_output), put(features), put(weight), device_map, 1,
                                                input_splits=splits)
        np.testing.assert_array_equal(bits(target, grad_features, dtype_name), backward,
                                      f"input gradient, {splits} splits")
        assert not _counters(target, device_map).any()


@pytest.mark.parametrize("engine", ENGINES, ids=ENGINE_IDS)
def test_split_offsets_on_random_data_are_within_a_gemm_bound_and_bitwise_run_to_run(target, engine):
    dtype_name, tf32 = engine
    rng = rng_for(61, ENGINES.index(engine))
    neighbour_map = symmetric_map(rng, 100, (3, 3))  # the input gradient reads the offsets reversed
    device_map = on_target(target, neighbour_map)
    wide = lambda shape: narrow(rng.uniform(-2, 2, size=shape).astype(np.float32), dtype_name)  # noqa: E731
    features, weight, bias = wide((100, 24)), wide((20, 9, 24)), wide((20,))
    put = lambda array: storage(target, array, dtype_name)  # noqa: E731
    passes = FusedPasses(target.backend.device, tf32)
    runs = [bits(target, passes.conv_forward(put(features), put(weight), device_map, put(bias), 1, splits=4),
                 dtype_name) for _ in range(2)]
    assert runs[0].tobytes() == runs[1].tobytes()
    table = neighbour_map.output_neighbours
    exact = twins.implicit_gemm(features, weight, bias, table, 1, dtype_name)
    absolute = lambda array: np.abs(twins.widen(array, dtype_name))  # noqa: E731
    abs_sum = twins.implicit_gemm(absolute(features), absolute(weight), absolute(bias), table, 1, "float32")
    error = np.abs(twins.widen(runs[0], dtype_name).astype(np.float64) - exact)
    assert np.all(error <= twins.gemm_error_bound(abs_sum, dtype_name, tf32))


def test_whichever_block_finishes_a_tile_the_sum_is_the_same():
    """The blocks of an emulated launch run one after another: grids of 1 to 5 blocks make a different split
    of each tile the last to finish (and sum); the bits do not change, and the counters end at zero."""
    if harness.compiler_path() is None:
        pytest.skip("g++ is not installed")
    rng = rng_for(62)
    neighbour_map = random_map(rng, 200, 190, (3, 3), density=0.7)  # 3 row tiles
    features = rng.uniform(-1, 1, (200, 12)).astype(np.float32)
    weight = rng.uniform(-1, 1, (40, 9, 12)).astype(np.float32)  # 40 outputs: a partial column tile
    kernel = harness.load_module("implicit_gemm.cu").get_function("sc_implicit_gemm<float, sc::Simt>")
    splits, tiles = 4, 3
    scratch = np.zeros(_kernel_fused.split_scratch_words(32, tiles * splits * 64 * 64 * 4), np.uint32)
    results = []
    for grid in (1, 2, 3, 5):
        out = np.full((190, 40), np.nan, np.float32)
        kernel((grid,), (256,), (features, weight, weight, neighbour_map.output_neighbours, neighbour_map.output_masks,
                                 neighbour_map.output_order, np.int32(1), np.int64(190), np.int32(9), np.int32(1),
                                 np.int32(1), np.int32(12), np.int32(40), np.int32(0), np.int32(splits), scratch,
                                 np.int64(32), out))
        assert not scratch[:32].any()
        results.append(out)
    for out in results[1:]:
        assert out.tobytes() == results[0].tobytes()
    exact = twins.implicit_gemm(features, weight, None, neighbour_map.output_neighbours, 1, "float32")
    abs_sum = twins.implicit_gemm(np.abs(features), np.abs(weight), None, neighbour_map.output_neighbours, 1, "float32")
    assert np.all(np.abs(results[0] - exact) <= twins.gemm_error_bound(abs_sum, "float32"))


@pytest.mark.parametrize("dtype_name, tf32", [("float16", False), ("bfloat16", False), ("float32", True)],
                         ids=["float16", "bfloat16", "tf32"])
def test_split_offsets_on_the_sm75_path_are_exact(dtype_name, tf32):
    """sm_75: float16 wmma, and the SIMT fallback of bfloat16 and TF32 (128 threads), split 5 ways."""
    from sparsecore.backends.kernel_backend import KernelBackend

    try:
        from cuda_emulation.emulated_launcher import EmulatedLauncher
        from kernel_targets import BFLOAT16
    except ImportError:  # tests/ imported as a package
        from tests.cuda_emulation.emulated_launcher import EmulatedLauncher
        from tests.kernel_targets import BFLOAT16
    if harness.compiler_path() is None:
        pytest.skip("g++ is not installed")
    if dtype_name == "bfloat16" and BFLOAT16 is None:
        pytest.skip("bfloat16 arrays need ml_dtypes")
    backend = KernelBackend(np, EmulatedLauncher(75), name="emulated-sm75", block_threads=32, max_blocks=2)
    passes = FusedPasses(backend.device, tf32)
    rng = rng_for(63, ["float16", "bfloat16", "float32"].index(dtype_name))
    neighbour_map = random_map(rng, 90, 100, (3, 3), density=0.6)
    put = (lambda array: array.view(BFLOAT16)) if dtype_name == "bfloat16" else (lambda array: array)
    host = (lambda array: array.view(np.uint16)) if dtype_name == "bfloat16" else (lambda array: array)
    features = twins.small_integers(rng, (90, 16), dtype_name)
    weight = twins.small_integers(rng, (24, 9, 16), dtype_name)
    out = passes.conv_forward(put(features), put(weight), neighbour_map, None, 1, splits=5)
    expected = twins.implicit_gemm(features, weight, None, neighbour_map.output_neighbours, 1, dtype_name)
    np.testing.assert_array_equal(host(out), narrow(expected, dtype_name))
    assert not np.asarray(neighbour_map.derived[SCRATCH].buffer)[:neighbour_map.derived[SCRATCH].counter_words].any()


def test_one_scratch_per_map_allocated_once_grown_only_when_needed(target):
    """The forward sizes the map's scratch for its input gradient too: the backward reuses it; a wider layer
    on the same map grows it; a pass of one block per tile touches none; empty inputs launch nothing."""
    backend, launcher = target.recording()
    passes = FusedPasses(backend.device)
    rng = rng_for(64)
    neighbour_map = random_map(rng, 120, 130, (3,), density=0.8)
    device_map = on_target(target, neighbour_map)
    floats = lambda shape: target.put(twins.small_integers(rng, shape, "float32"))  # noqa: E731
    passes.conv_forward(floats((120, 8)), floats((70, 3, 8)), device_map, None, 1, splits=1)
    assert SCRATCH not in device_map.derived
    passes.conv_forward(floats((120, 8)), floats((70, 3, 8)), device_map, None, 1, splits=3)
    first = device_map.derived[SCRATCH]
    # forward: 3 row tiles x 2 column tiles; input gradient: 2 row tiles x 1 column tile
    assert first.counter_words == 32 and first.partial_bytes == 6 * 3 * 64 * 64 * 4
    passes.conv_backward(floats((130, 70)), floats((120, 8)), floats((70, 3, 8)), device_map, 1, input_splits=3)
    assert device_map.derived[SCRATCH] is first
    passes.conv_forward(floats((120, 8)), floats((200, 3, 8)), device_map, None, 1, splits=3)  # 4 column tiles
    grown = device_map.derived[SCRATCH]
    assert grown is not first and grown.partial_bytes == 12 * 3 * 64 * 64 * 4
    assert not _counters(target, device_map).any()
    launches = len(launcher.records)
    empty = on_target(target, random_map(rng, 0, 0, (3,)))
    out = passes.conv_forward(target.put(np.zeros((0, 8), np.float32)), floats((70, 3, 8)), empty, None, 1, splits=3)
    assert tuple(out.shape) == (0, 70) and len(launcher.records) == launches and SCRATCH not in empty.derived


def test_forward_splits_fill_the_gpu_only_where_a_layer_leaves_it_idle():
    """The basic network's small layers on 132 SMs: SIMT fills about two waves of block slots (L09/L10: 486
    tiles, L12/L13: 168), tensor cores up to one block per multiprocessor (L15/L16: 68 tiles; none for 168);
    at most ceil(27 / 3) = 9 splits (L18/L19: 16 tiles); a layer that fills the GPU is not split; the
    partials stay within the floor of the scratch cap."""
    sms = tile_shapes.DEFAULT_SM_COUNT
    assert tile_shapes.forward_splits(486, 27, 4, 4, sms, "simt") == 2 * 4 * sms // 486 == 2
    assert tile_shapes.forward_splits(168, 27, 4, 4, sms, "simt") == 2 * 4 * sms // 168 == 6
    assert tile_shapes.forward_splits(16, 27, 4, 4, sms, "simt") == 9  # ceil(27 / OFFSETS_PER_SPLIT)
    assert tile_shapes.forward_splits(68, 27, 6, 4, sms, "tensor") == -(-sms // 68) == 2
    assert tile_shapes.forward_splits(51, 27, 6, 4, sms, "tensor") == 3
    assert tile_shapes.forward_splits(168, 27, 6, 4, sms, "tensor") == 1  # more tiles than SMs
    assert tile_shapes.forward_splits(16, 27, 6, 4, sms, "tensor") == 9
    for tiles, blocks_per_sm in ((60, 4), (100, 2), (168, 4), (300, 4), (527, 4)):
        splits = tile_shapes.forward_splits(tiles, 27, blocks_per_sm, 4, sms, "simt")
        slots = sms * blocks_per_sm
        assert splits == 9 or 1.4 * slots < tiles * splits <= 2 * slots, (tiles, splits)
    assert tile_shapes.forward_splits(528, 27, 4, 4, sms, "simt") == 1  # a full wave: one block per tile
    assert tile_shapes.forward_splits(1962, 27, 4, 4, sms, "simt") == 1
    assert tile_shapes.forward_splits(16, 1, 4, 4, sms, "simt") == 1  # one offset: nothing to split
    assert tile_shapes.forward_splits(0, 27, 4, 4, sms, "simt") == 1
    # a GPU of 1,000 SMs: float64 partials of 100 tiles capped at 64 MiB
    assert tile_shapes.forward_splits(100, 125, 8, 8, 1000, "simt") == (64 << 20) // (100 * 64 * 64 * 8) == 20
    assert _kernel_fused.split_scratch_words(1, 8) == 34 and _kernel_fused.split_scratch_words(33, 0) == 64
