"""The fused convolution kernels (``kernels_cu/implicit_gemm.cu``) through their launch wrappers, against twins.

``sc_implicit_gemm`` (forward and input gradient) and ``sc_weight_gradient``
run on the CPU emulation (and on CuPy where a GPU is present) through
`sparsecore.backends._kernel_fused.FusedPasses`, in every engine: SIMT float32
and float64, tensor-core float16, bfloat16 and TF32 (mma.sync m16n8k16 / m16n8k8
with ldmatrix or rounded scalar fragments; float16 on sm_75 on wmma). Oracles are
the float64 twins of ``cuda_emulation/fused_twins.py``:

- small-integer data: every partial sum is exact, so each result rounded to
  its storage type equals the twin's bitwise, whatever order a kernel sums in
  (tensor cores included);
- random data: within a GEMM error bound of the float64 twin, and two runs
  bitwise equal.

The emulated target caps grids at 2 blocks, so every kernel's work-item loop
goes round several times. The emulation's hang checks are tested here too: a
barrier in a branch some threads skip, and a barrier never reached, fail as
errors instead of hanging.
"""

from __future__ import annotations

import numpy as np
import pytest

from sparsecore.backends import _kernel_fused, _kernel_maps, kernel_registry, tile_shapes
from sparsecore.backends._kernel_fused import FusedPasses
from sparsecore.neighbour_map import ROW_PLAN, NeighbourMap, row_order

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

# (dtype name, tf32): the five engines
ENGINES = [("float32", False), ("float64", False), ("float16", False), ("bfloat16", False), ("float32", True)]
ENGINE_IDS = ["float32", "float64", "float16", "bfloat16", "tf32"]


def _passes(target, tf32: bool) -> FusedPasses:
    return FusedPasses(target.backend.device, tf32)


# name, num_input, num_output, kernel_size, groups, in_channels, out_channels, bias, symmetric
CASES = [
    ("k5-bias", 90, 70, (5,), 1, 12, 7, True, False),
    ("groups2", 60, 80, (3, 2), 2, 6, 10, False, False),
    ("symmetric-3x3", 75, 75, (3, 3), 1, 5, 9, True, True),
    ("k40-two-mask-words", 50, 45, (40,), 1, 3, 4, True, False),
    ("wide-channels", 40, 36, (2,), 1, 70, 130, False, False),
    ("16-byte-rows", 70, 66, (3, 3), 1, 16, 32, True, False),  # every row staged in 16-byte copies
]


# The K = 40 case runs on two engines: the mask-word loop is outside the engine, and every engine meets two
# mask words somewhere (float64 and TF32 here; float32, float64, float16 and bfloat16 against the dense oracle
# in test_fused_conv_oracle.py, on 36- and 50-offset kernels); every other case runs on all five engines.
TWO_MASK_WORD_ENGINES = ("float64", "tf32")
EXACT_RUNS = [pytest.param(case, engine, id=f"{case[0]}-{engine_id}")
              for case in CASES for engine, engine_id in zip(ENGINES, ENGINE_IDS)
              if case[0] != "k40-two-mask-words" or engine_id in TWO_MASK_WORD_ENGINES]


def _case(case, rng):
    name, num_input, num_output, kernel_size, groups, in_channels, out_channels, with_bias, symmetric = case
    neighbour_map = (symmetric_map(rng, num_input, kernel_size) if symmetric
                     else random_map(rng, num_input, num_output, kernel_size))
    return neighbour_map, groups, in_channels, out_channels, with_bias


@pytest.mark.parametrize("case, engine", EXACT_RUNS)
def test_conv_passes_are_exact_on_small_integers(target, case, engine):
    """Forward, input gradient and weight gradient equal the exact twins bitwise (every partial sum exact)."""
    dtype_name, tf32 = engine
    rng = rng_for(40, CASES.index(case), ENGINES.index(engine))
    neighbour_map, groups, in_channels, out_channels, with_bias = _case(case, rng)
    volume = neighbour_map.kernel_volume
    features = twins.small_integers(rng, (neighbour_map.num_input, in_channels), dtype_name)
    weight = twins.small_integers(rng, (out_channels, volume, in_channels // groups), dtype_name)
    bias = twins.small_integers(rng, (out_channels,), dtype_name) if with_bias else None
    grad_output = twins.small_integers(rng, (neighbour_map.num_output, out_channels), dtype_name)
    passes = _passes(target, tf32)
    device_map = on_target(target, neighbour_map)
    put = lambda array: None if array is None else storage(target, array, dtype_name)  # noqa: E731
    out = passes.conv_forward(put(features), put(weight), device_map, put(bias), groups)
    expected = twins.implicit_gemm(features, weight, bias, neighbour_map.output_neighbours, groups, dtype_name)
    np.testing.assert_array_equal(bits(target, out, dtype_name), narrow(expected, dtype_name), "forward")
    grad_features, grad_weight = passes.conv_backward(put(grad_output), put(features), put(weight), device_map, groups)
    table, _, _, reversed_offsets = neighbour_map.input_side()
    expected = twins.implicit_gemm(grad_output, weight, None, table, groups, dtype_name, reversed_offsets, True)
    np.testing.assert_array_equal(bits(target, grad_features, dtype_name), narrow(expected, dtype_name),
                                  "input gradient")
    expected = twins.weight_gradient(features, grad_output, neighbour_map.output_neighbours, groups, weight.shape,
                                     dtype_name)
    np.testing.assert_array_equal(bits(target, grad_weight, dtype_name), narrow(expected, dtype_name),
                                  "weight gradient")


# Every engine sums splits; 7 splits (more than the 5 row tiles: empty splits) with both accumulators
# (double for float64, float for the others).
SPLIT_RUNS = [(ENGINES[1], 7), (ENGINES[1], 3), (ENGINES[0], 2), (ENGINES[2], 7), (ENGINES[3], 3), (ENGINES[4], 2)]


@pytest.mark.parametrize("engine, splits", SPLIT_RUNS,
                         ids=[f"{ENGINE_IDS[ENGINES.index(engine)]}-{splits}" for engine, splits in SPLIT_RUNS])
def test_weight_gradient_splits_sum_exactly(target, engine, splits):
    """Split partials summed by the last block of each tile (7 splits > the 5 row tiles: empty splits too)."""
    dtype_name, tf32 = engine
    rng = rng_for(41, splits, ENGINES.index(engine))
    neighbour_map = random_map(rng, 300, 290, (3,), density=0.8)
    features = twins.small_integers(rng, (300, 5), dtype_name)
    weight = twins.small_integers(rng, (6, 3, 5), dtype_name)
    grad_output = twins.small_integers(rng, (290, 6), dtype_name)
    put = lambda array: storage(target, array, dtype_name)  # noqa: E731
    _, grad_weight = _passes(target, tf32).conv_backward(put(grad_output), put(features), put(weight),
                                                         on_target(target, neighbour_map), 1, splits=splits)
    expected = twins.weight_gradient(features, grad_output, neighbour_map.output_neighbours, 1, weight.shape,
                                     dtype_name)
    np.testing.assert_array_equal(bits(target, grad_weight, dtype_name), narrow(expected, dtype_name))


def test_weight_gradient_walks_the_row_plans_tile_sets_or_every_tile(target):
    """Offsets held by few row tiles: the weight gradient over the map's row plan (its per-offset row-tile
    bit sets, built once with the plan) and over the same order given as int32 (every row tile walked) both
    equal the exact twin bitwise."""
    rng = rng_for(49)
    neighbour_map = random_map(rng, 260, 250, (3, 3), density=0.04)  # 4 row tiles
    assert _kernel_maps.plan_bit_sets(250, 9, 1)
    features = twins.small_integers(rng, (260, 3), "float32")
    weight = twins.small_integers(rng, (2, 9, 3), "float32")
    grad_output = twins.small_integers(rng, (250, 2), "float32")
    given = NeighbourMap(neighbour_map.output_neighbours, neighbour_map.output_masks,
                         row_order(np, neighbour_map.output_masks), neighbour_map.input_neighbours,
                         neighbour_map.input_masks, row_order(np, neighbour_map.input_masks), 260, 250, (3, 3))
    expected = narrow(twins.weight_gradient(features, grad_output, neighbour_map.output_neighbours, 1, weight.shape,
                                            "float32"), "float32")
    passes = _passes(target, False)
    for walked in (neighbour_map, given):
        device_map = on_target(target, walked)
        _, grad_weight = passes.conv_backward(target.put(grad_output), target.put(features), target.put(weight),
                                              device_map, 1, splits=3)
        np.testing.assert_array_equal(target.get(grad_weight), expected)
    assert target.xp is not np or (ROW_PLAN, "output") in neighbour_map.derived
    assert (ROW_PLAN, "output") not in given.derived


def _within_gemm_bound(actual, exact, abs_sum, dtype_name, tf32, what):
    error = np.abs(actual.astype(np.float64) - exact)
    bound = twins.gemm_error_bound(abs_sum, dtype_name, tf32)
    worst = np.unravel_index(np.argmax(error - bound), error.shape) if error.size else None
    assert np.all(error <= bound), f"{what}: error {error[worst]} > bound {bound[worst]} at {worst}"


@pytest.mark.parametrize("engine", ENGINES, ids=ENGINE_IDS)
def test_random_data_within_a_gemm_bound_and_bitwise_run_to_run(target, engine):
    dtype_name, tf32 = engine
    rng = rng_for(42, ENGINES.index(engine))
    neighbour_map = random_map(rng, 90, 80, (3, 3), density=0.7)  # two row tiles on either side
    groups, in_channels, out_channels = 1, 20, 24
    wide = lambda shape: narrow(rng.uniform(-2, 2, size=shape).astype(np.float32), dtype_name)  # noqa: E731
    features, weight = wide((90, in_channels)), wide((out_channels, 9, in_channels))
    bias, grad_output = wide((out_channels,)), wide((80, out_channels))
    put = lambda array: storage(target, array, dtype_name)  # noqa: E731
    passes, device_map = _passes(target, tf32), on_target(target, neighbour_map)
    runs = [(passes.conv_forward(put(features), put(weight), device_map, put(bias), groups),
             *passes.conv_backward(put(grad_output), put(features), put(weight), device_map, groups))
            for _ in range(2)]
    for first, second, what in zip(*runs, ("forward", "input gradient", "weight gradient")):
        assert bits(target, first, dtype_name).tobytes() == bits(target, second, dtype_name).tobytes(), what
    absolute = lambda array: np.abs(twins.widen(array, dtype_name))  # noqa: E731
    as_float = lambda array: twins.widen(bits(target, array, dtype_name), dtype_name)  # noqa: E731
    out, grad_features, grad_weight = runs[0]
    table = neighbour_map.output_neighbours
    exact = twins.implicit_gemm(features, weight, bias, table, groups, dtype_name)
    abs_sum = twins.implicit_gemm(absolute(features), absolute(weight), absolute(bias), table, groups, "float32")
    _within_gemm_bound(as_float(out), exact, abs_sum, dtype_name, tf32, "forward")
    in_table = neighbour_map.input_neighbours
    exact = twins.implicit_gemm(grad_output, weight, None, in_table, groups, dtype_name, transposed=True)
    abs_sum = twins.implicit_gemm(absolute(grad_output), absolute(weight), None, in_table, groups, "float32",
                                  transposed=True)
    _within_gemm_bound(as_float(grad_features), exact, abs_sum, dtype_name, tf32, "input gradient")
    exact = twins.weight_gradient(features, grad_output, table, groups, weight.shape, dtype_name)
    abs_sum = twins.weight_gradient(absolute(features), absolute(grad_output), table, groups, weight.shape,
                                    "float32")
    _within_gemm_bound(as_float(grad_weight), exact, abs_sum, dtype_name, tf32, "weight gradient")


@pytest.mark.parametrize("engine", ENGINES, ids=ENGINE_IDS)
def test_one_launch_forward_two_backward_in_the_engine_configuration(target, engine):
    dtype_name, tf32 = engine
    rng = rng_for(43)
    neighbour_map = random_map(rng, 150, 200, (3,))  # 4 row tiles: more work items than the 2-block grid
    backend, launcher = target.recording()
    passes = FusedPasses(backend.device, tf32)
    put = lambda array: storage(target, array, dtype_name)  # noqa: E731
    features = twins.small_integers(rng, (150, 4), dtype_name)
    weight = twins.small_integers(rng, (5, 3, 4), dtype_name)
    device_map = on_target(target, neighbour_map)
    passes.conv_forward(put(features), put(weight), device_map, None, 1)
    passes.conv_backward(put(twins.small_integers(rng, (200, 5), dtype_name)), put(features), put(weight),
                         device_map, 1)
    # 4 input and 5 output channels: the forward and input gradient reduce over few channels, so they run on
    # SIMT in every dtype; the weight gradient runs on the dtype's engine
    math, threads = _kernel_fused.engine_of(dtype_name, tf32)
    type_name = kernel_registry.cuda_type_name(dtype_name)
    records = [record for record in launcher.records if record.expression != "sc_map_row_plan"]
    plans = [(record.expression, record.block) for record in launcher.records if record not in records]
    assert plans in ([], [("sc_map_row_plan", 32)] * 2)  # each side's row plan, unless its order was given
    assert [(record.expression, record.block) for record in records] == [
        (f"sc_implicit_gemm<{type_name}, sc::Simt>", 256), (f"sc_implicit_gemm<{type_name}, sc::Simt>", 256),
        (f"sc_weight_gradient<{type_name}, {math}>", threads)]
    assert all(record.grid == 2 for record in records)
    assert threads == (128 if math == "sc::Wmma" else 256)
    assert _kernel_fused.engine_of(dtype_name, tf32, 9) == (math, threads)  # 9 channels: the dtype's engine


def test_empty_maps_and_channels_launch_nothing(target):
    backend, launcher = target.recording()
    passes = FusedPasses(backend.device)
    rng = rng_for(44)
    empty = random_map(rng, 0, 0, (3,))
    out = passes.conv_forward(target.put(np.zeros((0, 3), np.float32)), target.put(np.ones((4, 3, 3), np.float32)),
                              on_target(target, empty), None, 1)
    assert tuple(out.shape) == (0, 4)
    grads = passes.conv_backward(target.put(np.zeros((0, 4), np.float32)), target.put(np.zeros((0, 3), np.float32)),
                                 target.put(np.ones((4, 3, 3), np.float32)), on_target(target, empty), 1)
    assert tuple(grads[0].shape) == (0, 3) and not np.any(target.get(grads[1]))
    outputs_only = on_target(target, random_map(rng, 0, 6, (3,)))  # outputs with no input at all: the bias
    bias = np.arange(4, dtype=np.float32)
    out = passes.conv_forward(target.put(np.zeros((0, 3), np.float32)), target.put(np.ones((4, 3, 3), np.float32)),
                              outputs_only, target.put(bias), 1)
    np.testing.assert_array_equal(target.get(out), np.tile(bias, (6, 1)))
    assert {record.expression.split("<")[0] for record in launcher.records} <= {"sc_implicit_gemm",
                                                                                "sc_map_row_plan"}


def test_weight_gradient_splits_fill_two_waves_within_the_scratch_cap():
    """SubMConv3d 64->64 on the 125,562-voxel scan, and narrow and wide layers: >= 2 waves of resident blocks
    on 132 multiprocessors, or every row tile of an offset in its own block; scratch under the cap."""
    sms = tile_shapes.DEFAULT_SM_COUNT
    for rows, channels, itemsize, blocks_per_sm in ((125_562, 64, 4, 2), (125_562, 64, 4, 4), (3_561, 256, 4, 4),
                                                   (212, 256, 8, 2), (60_000, 128, 4, 4)):
        tiles = _kernel_fused.weight_gradient_tiles(27, 1, channels, channels)
        row_tiles = -(-rows // 64)
        output_bytes = rows * channels * itemsize
        splits = tile_shapes.weight_gradient_splits(row_tiles, tiles, itemsize, output_bytes, blocks_per_sm, sms)
        assert tiles * splits >= 2 * sms * blocks_per_sm or splits == row_tiles, (rows, channels, splits)
        words = _kernel_fused.weight_gradient_scratch_words(tiles, splits, itemsize)
        partials = tiles * splits * _kernel_fused.TILE_ELEMENTS * itemsize
        assert partials <= tile_shapes.scratch_cap(output_bytes), (rows, channels, partials)
        assert words * itemsize - partials == -(-4 * tiles // itemsize) * itemsize  # a counter per tile
    # the cap binds (here on a GPU of 1,000 multiprocessors): the partials stay within max(64 MiB, the output
    # gradient), and where even two splits would not fit there is one (no partials at all)
    tiles = _kernel_fused.weight_gradient_tiles(27, 1, 256, 256)
    splits = tile_shapes.weight_gradient_splits(10_000, tiles, 8, 1 << 20, 8, 1000)
    assert splits == (64 << 20) // (tiles * 4096 * 8) == 4
    assert tile_shapes.weight_gradient_splits(10_000, 27 * 16 * 16, 8, 1 << 20, 8, 1000) == 1
    assert tile_shapes.weight_gradient_splits(1, tiles, 4, 1 << 20, 4, sms) == 1  # one row tile: no split
    assert tile_shapes.scratch_cap(1 << 20) == 64 << 20 and tile_shapes.scratch_cap(100 << 20) == 100 << 20


def test_device_checks_name_the_dtype_and_the_gpu():
    old_gpu = _kernel_fused.DeviceTraits(sm_count=80, compute_capability=70)
    with pytest.raises(RuntimeError, match=r"compute capability 7.5 .* this GPU is 7.0, so a bfloat16 convolution"):
        _kernel_fused.check_device("bfloat16", old_gpu, 27, "conv_forward")
    with pytest.raises(ValueError, match=r"conv_backward: a kernel of 2197 offsets exceeds .* 2048"):
        _kernel_fused.check_device("float32", _kernel_fused.DeviceTraits(132, 90), 13 ** 3, "conv_backward")
    _kernel_fused.check_device("float16", _kernel_fused.DeviceTraits(40, 75), 27, "conv_forward")  # a T4 runs it
    assert _kernel_fused.device_traits(np) == _kernel_fused.DeviceTraits(tile_shapes.DEFAULT_SM_COUNT, 90)


# ------------------------------------------------------------- the sm_75 code path


SM75_ENGINES = [("float16", False), ("bfloat16", False), ("float32", True)]


@pytest.mark.parametrize("engine", SM75_ENGINES, ids=["float16", "bfloat16", "tf32"])
def test_the_sm75_path_is_exact_and_within_a_gemm_bound(engine):
    """The kernels compiled for sm_75 (SC_EMULATED_ARCH): float16 on tensor cores, bfloat16 and TF32's
    instantiation on the 128-thread SIMT engine, 16-byte loads through registers instead of cp.async."""
    from sparsecore.backends.kernel_backend import KernelBackend

    try:
        from cuda_emulation.emulated_launcher import EmulatedLauncher
    except ImportError:  # tests/ imported as a package
        from tests.cuda_emulation.emulated_launcher import EmulatedLauncher
    if harness.compiler_path() is None:
        pytest.skip("g++ is not installed")
    dtype_name, tf32 = engine
    backend = KernelBackend(np, EmulatedLauncher(75), name="emulated-sm75", block_threads=32, max_blocks=2)
    passes = FusedPasses(backend.device, tf32)
    rng = rng_for(49, SM75_ENGINES.index(engine))
    neighbour_map = random_map(rng, 100, 90, (3, 3), density=0.6)
    put = (lambda array: array.view(twins_bfloat16())) if dtype_name == "bfloat16" else (lambda array: array)
    host = (lambda array: array.view(np.uint16)) if dtype_name == "bfloat16" else (lambda array: array)
    features = twins.small_integers(rng, (100, 16), dtype_name)
    weight = twins.small_integers(rng, (12, 9, 16), dtype_name)
    grad_output = twins.small_integers(rng, (90, 12), dtype_name)
    out = passes.conv_forward(put(features), put(weight), neighbour_map, None, 1)
    grad_features, grad_weight = passes.conv_backward(put(grad_output), put(features), put(weight), neighbour_map, 1,
                                                      splits=3)
    table = neighbour_map.output_neighbours
    np.testing.assert_array_equal(host(out), narrow(twins.implicit_gemm(features, weight, None, table, 1, dtype_name),
                                                    dtype_name))
    expected = twins.implicit_gemm(grad_output, weight, None, neighbour_map.input_neighbours, 1, dtype_name,
                                   transposed=True)
    np.testing.assert_array_equal(host(grad_features), narrow(expected, dtype_name))
    expected = twins.weight_gradient(features, grad_output, table, 1, weight.shape, dtype_name)
    np.testing.assert_array_equal(host(grad_weight), narrow(expected, dtype_name))
    wide = narrow(rng.uniform(-2, 2, size=features.shape).astype(np.float32), dtype_name)
    out = passes.conv_forward(put(wide), put(weight), neighbour_map, None, 1)
    exact = twins.implicit_gemm(wide, weight, None, table, 1, dtype_name)
    abs_sum = twins.implicit_gemm(np.abs(twins.widen(wide, dtype_name)), np.abs(twins.widen(weight, dtype_name)),
                                  None, table, 1, "float32")
    # the SIMT fallback of the TF32 instantiation multiplies in full float32: the float32 bound holds
    _within_gemm_bound(twins.widen(host(out), dtype_name), exact, abs_sum, dtype_name, False, "sm_75 forward")


def twins_bfloat16():
    try:
        from kernel_targets import BFLOAT16
    except ImportError:  # tests/ imported as a package
        from tests.kernel_targets import BFLOAT16
    if BFLOAT16 is None:
        pytest.skip("bfloat16 arrays need ml_dtypes")
    return BFLOAT16


def test_a_missing_copy_wait_reads_stale_shared_memory():
    """The emulation's cp.async lands a copy only at the wait that retires it: without the pipeline's wait,
    the forward multiplies what the previous round left (zeros at first) and the result is wrong."""
    module = _emulated_module(_broken_source())
    rng = rng_for(50)
    neighbour_map = random_map(rng, 80, 70, (3,), density=0.8)
    features = twins.small_integers(rng, (80, 8), "float32")
    weight = twins.small_integers(rng, (8, 3, 8), "float32")
    expected = narrow(twins.implicit_gemm(features, weight, None, neighbour_map.output_neighbours, 1, "float32"),
                      "float32")
    arguments = (features, weight, weight, neighbour_map.output_neighbours, neighbour_map.output_masks,
                 neighbour_map.output_order, np.int32(1), np.int64(70), np.int32(3), np.int32(1), np.int32(1),
                 np.int32(8), np.int32(8), np.int32(_UNUSED_FLAG), *_NO_SPLITS)
    out = np.zeros((70, 8), np.float32)
    module.get_function("sc_implicit_gemm<float, sc::Simt>")((2,), (256,), (*arguments, out))
    assert not np.array_equal(out, expected)
    correct = np.zeros((70, 8), np.float32)
    harness.load_module("implicit_gemm.cu").get_function("sc_implicit_gemm<float, sc::Simt>")(
        (2,), (256,), (*arguments, correct))
    np.testing.assert_array_equal(correct, expected)


# ------------------------------------------------------------- the emulation's hang checks


def _emulated_module(source: str):
    if harness.compiler_path() is None:
        pytest.skip("g++ is not installed")
    return harness.load_module_from_source("implicit_gemm.cu", source)


_EARLY_BARRIER = "    engine.clear();\n    __syncthreads();\n"
_WEIGHT_BARRIER = "    __threadfence();  // this split's partials before its count\n    __syncthreads();\n"


_COPY_WAIT = "      wait_copies<1>();  // this round's copies have landed\n"
_UNUSED_FLAG = 8  # a flag bit sc_implicit_gemm does not read: launches with it skip the first bug below
# sc_implicit_gemm's splits, scratch and counter words for one block per tile (the scratch is never touched)
_NO_SPLITS = (np.int32(1), np.zeros(1, np.uint32), np.int64(0))


_TF32_ROUNDING = "  return sc_emu::float_bits(nvcuda::wmma::__float_to_tf32(value));\n"
_ROW_SLICE_LOAD = "load_matrices2<false>(r[i], a + (row0 + 8 * i + block_row) * lda + k + 8 * (block % 2));"


def _broken_source() -> str:
    """implicit_gemm.cu with five bugs (one build for the five tests): the forward skips a barrier in
    threads 32..255 (a barrier in a divergent branch) unless its flags hold `_UNUSED_FLAG`; in the weight
    gradient half of each warp waits at __syncwarp while the other half waits at __syncthreads (each barrier
    waits for threads that never come); the pipeline never waits for a round's copies but the last; the
    TF32 forward hands its mma.sync operands over without rounding them to TF32; and the 16-bit forward's
    row slices are loaded by ldmatrix from one element past their rows (not 16-byte aligned)."""
    source = kernel_registry.kernel_source("implicit_gemm.cu")
    assert source.count(_EARLY_BARRIER) == 1 and source.count(_WEIGHT_BARRIER) == 1 and source.count(_COPY_WAIT) == 1
    assert source.count(_TF32_ROUNDING) == 1 and source.count(_ROW_SLICE_LOAD) == 1
    source = source.replace(_TF32_ROUNDING, "  return sc_emu::float_bits(value);\n")
    source = source.replace(_ROW_SLICE_LOAD, _ROW_SLICE_LOAD.replace("(block % 2));", "(block % 2) + 1);"))
    source = source.replace(_EARLY_BARRIER, "    engine.clear();\n"
                            f"    if (tid < 32 || (flags & {_UNUSED_FLAG}) != 0) __syncthreads();\n")
    source = source.replace(_COPY_WAIT, "")
    return source.replace(_WEIGHT_BARRIER, _WEIGHT_BARRIER.replace(
        "__syncthreads();", "if (tid % 32 < 16) { __syncthreads(); } else { __syncwarp(); }"))


def _simt_arguments(neighbour_map, channels: int = 4):
    rng = rng_for(45)
    features = rng.uniform(-1, 1, (neighbour_map.num_input, channels)).astype(np.float32)
    weight = rng.uniform(-1, 1, (channels, neighbour_map.kernel_volume, channels)).astype(np.float32)
    return features, weight


def test_a_barrier_some_threads_skip_fails_as_a_deadlock():
    module = _emulated_module(_broken_source())
    neighbour_map = random_map(rng_for(46), 80, 70, (3,))
    features, weight = _simt_arguments(neighbour_map)
    kernel = module.get_function("sc_implicit_gemm<float, sc::Simt>")
    out = np.zeros((70, 4), np.float32)
    with pytest.raises(harness.BarrierDeadlock, match=r"__syncthreads\(\) in block 0: .* a barrier in a branch"):
        kernel((2,), (256,), (features, weight, weight, neighbour_map.output_neighbours, neighbour_map.output_masks,
                              neighbour_map.output_order, np.int32(1), np.int64(70), np.int32(3), np.int32(1),
                              np.int32(1), np.int32(4), np.int32(4), np.int32(0), *_NO_SPLITS, out))


def test_a_barrier_never_reached_times_out():
    module = _emulated_module(_broken_source())
    module.set_timeout(0.3)  # the launch can never finish: any deadline shows the failure
    try:
        neighbour_map = random_map(rng_for(47), 80, 70, (3,))
        features, weight = _simt_arguments(neighbour_map)
        kernel = module.get_function("sc_weight_gradient<float, sc::Simt>")
        scratch = np.zeros(_kernel_fused.weight_gradient_scratch_words(3, 2, 4), np.float32)
        with pytest.raises(harness.LaunchTimeout, match=r"still waited when the launch's time ran out"):
            kernel((1,), (256,), (features, np.zeros((70, 4), np.float32), neighbour_map.output_neighbours,
                                  neighbour_map.output_order, np.int32(1), np.int64(70),
                                  np.int32(3), np.int32(1), np.int32(1), np.int32(4), np.int32(4), np.int32(2), scratch,
                                  np.zeros(weight.shape, np.float32)))
    finally:
        module.set_timeout(harness.LAUNCH_TIMEOUT_SECONDS)


# The broken build's two tensor-core forwards and what stops them: TF32 mma operands not rounded to TF32
# (a forward that forgot cvt.rna would multiply float32 values), and 16-bit row slices loaded by ldmatrix
# from an address off by one element (a fault on the GPU: ldmatrix reads 16-byte rows).
BROKEN_FORWARDS = [(np.float32, "sc_implicit_gemm<float, sc::Wmma>", r"not rounded to TF32"),
                   (np.float16, "sc_implicit_gemm<__half, sc::Wmma>", r"not 16-byte aligned")]


@pytest.mark.parametrize("dtype, kernel_name, cause", BROKEN_FORWARDS, ids=["tf32-unrounded", "float16-misaligned"])
def test_the_emulated_tensor_core_instructions_stop_a_broken_forward(dtype, kernel_name, cause):
    """The emulation's mma.sync TF32 refuses operands with any of their 13 low bits set, and its ldmatrix
    a row address that is not 16-byte aligned: the broken build's forwards stop with the cause named."""
    module = _emulated_module(_broken_source())
    rng = rng_for(51, BROKEN_FORWARDS.index((dtype, kernel_name, cause)))
    neighbour_map = random_map(rng, 70, 60, (3,), density=0.8)
    features = rng.uniform(-1, 1, (70, 16)).astype(dtype)  # float32: 23 fraction bits, not TF32 values
    weight = rng.uniform(-1, 1, (16, 3, 16)).astype(dtype)
    with pytest.raises(harness.KernelTrap, match=cause):
        module.get_function(kernel_name)(
            (1,), (128,), (features, weight, weight, neighbour_map.output_neighbours, neighbour_map.output_masks,
                           neighbour_map.output_order, np.int32(1), np.int64(60), np.int32(3), np.int32(1),
                           np.int32(1), np.int32(16), np.int32(16), np.int32(_UNUSED_FLAG), *_NO_SPLITS,
                           np.zeros((60, 16), dtype)))


def test_a_launch_with_the_wrong_block_size_traps():
    if harness.compiler_path() is None:
        pytest.skip("g++ is not installed")
    neighbour_map = random_map(rng_for(48), 40, 40, (3,))
    features, weight = _simt_arguments(neighbour_map)
    kernel = harness.load_module("implicit_gemm.cu").get_function("sc_implicit_gemm<float, sc::Simt>")
    with pytest.raises(harness.KernelTrap, match=r"__trap\(\)"):
        kernel((1,), (128,), (features, weight, weight, neighbour_map.output_neighbours, neighbour_map.output_masks,
                              neighbour_map.output_order, np.int32(1), np.int64(40), np.int32(3), np.int32(1),
                              np.int32(1), np.int32(4), np.int32(4), np.int32(0), *_NO_SPLITS,
                              np.zeros((40, 4), np.float32)))


# ------------------------------------------------------------------------- the TF32 rule


@pytest.mark.parametrize("value, expected", [(None, False), ("0", False), ("1", True), ("2", True), ("-1", False)])
def test_tf32_follows_cupy_tf32(value, expected):
    from sparsecore.backends.kernel_backend import tf32_from_environment

    assert tf32_from_environment({} if value is None else {"CUPY_TF32": value}) is expected


def test_tf32_rejects_a_non_integer():
    from sparsecore.backends.kernel_backend import tf32_from_environment

    with pytest.raises(ValueError, match=r"CUPY_TF32 must be an integer .* got 'yes'"):
        tf32_from_environment({"CUPY_TF32": "yes"})


def test_the_cupy_backend_reads_cupy_tf32_at_import_and_its_passes_follow():
    """One fresh process imports the backend module twice (CuPy itself once): CUPY_TF32=0, then 1."""
    import os
    import subprocess
    import sys

    pytest.importorskip("cupy")
    code = ("import importlib, os, sys\n"
            "for value in ('0', '1'):\n"
            "    os.environ['CUPY_TF32'] = value\n"
            "    sys.modules.pop('sparsecore.backends.cupy_backend', None)\n"
            "    b = importlib.import_module('sparsecore.backends.cupy_backend').CUPY_BACKEND\n"
            "    print(value, b.tf32, b.fused_passes.tf32)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            env={**os.environ, "CUPY_TF32": "0"}, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["0", "False", "False", "1", "True", "True"]
