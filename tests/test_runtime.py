"""sparsecore.runtime on hand-written libspconv graphs, against the dense float64 oracle.

The graphs are built here with ``onnx.helper`` (not by the exporter), so the
runtime is checked on its own: each layer kind against the dense convolution
of the densified input read at the active sites, rulebook sharing by counting
rulebook builds, and the errors for corrupt, foreign and malformed files.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
torch = pytest.importorskip("torch")

from onnx import helper  # noqa: E402

import sparsecore  # noqa: E402
import sparsecore.functional  # noqa: E402
import sparsecore.layer_geometry  # noqa: E402
import sparsecore.runtime as runtime  # noqa: E402
from tests.dense_oracle import (  # noqa: E402
    densify,
    dense_conv,
    dense_conv_transpose,
    make_rng,
    occupancy,
    read_sites,
    sites_of,
)
from tests.runtime_graphs import GraphBuilder, case_input as _case, dense_subm as _dense_subm  # noqa: E402


def _check_sites(runtime_indices, expected_mask) -> None:
    got = runtime_indices[np.lexsort(runtime_indices.T[::-1])]
    np.testing.assert_array_equal(got, sites_of(expected_mask))


def test_subm_strided_dense_reshape_transpose_match_the_dense_oracle() -> None:
    rng, indices, features = _case(1)
    shape, batch = (9, 11, 7), 2
    builder = GraphBuilder(rng)
    builder.conv("conv0", "0", "1", 4, 8, kind="subm", rulebook="subm1", activation="ReLU")
    builder.conv("conv1", "1", "2", 8, 6, kind="regular", stride=2, padding=1, rulebook="down")
    builder.op("ScatterDense", ["2"], "3", "scatter0", input_spatial_shape=[5, 6, 4], format="zyx",
               output_shape=[batch, 6, 5, 6, 4], output_layout="NCHW")
    builder.op("Reshape", ["3"], "4", "reshape0", dims=[batch, 30, 6, 4])
    builder.op("Transpose", ["4"], "5", "transpose0", dims=[0, 2, 3, 1])
    session = runtime.load_model(builder.model(4, "5"))
    out = session.run(features.astype(np.float32), indices, batch, shape)
    # oracle: dense float64 convolutions of the densified input, read at the active sites
    mask = occupancy(indices, shape, batch)
    hidden = _dense_subm(densify(features, indices, shape, batch), *builder.weights["conv0"], mask, relu=True)
    weight, bias = builder.weights["conv1"]
    down_mask = (dense_conv(mask, torch.ones(1, 3, 3, 3, 1, dtype=torch.float64), 2, 1, 1) > 0).double()
    down = (dense_conv(hidden, torch.from_numpy(weight), 2, 1, 1) + torch.from_numpy(bias).view(1, -1, 1, 1, 1))
    expected = (down * down_mask).reshape(batch, 30, 6, 4).permute(0, 2, 3, 1).numpy()
    assert out.sparse is None and out.dense.dtype == np.float32 and out.dense.shape == expected.shape
    np.testing.assert_allclose(out.dense, expected, rtol=1e-4, atol=1e-4)


def test_shared_rulebooks_are_built_once_per_run(monkeypatch: pytest.MonkeyPatch) -> None:
    rng, indices, features = _case(2)
    builder = GraphBuilder(rng)
    builder.conv("conv0", "0", "1", 4, 4, rulebook="a", activation="ReLU")
    builder.conv("conv1", "1", "2", 4, 4, rulebook="a", activation="ReLU")
    builder.conv("conv2", "2", "3", 4, 4, rulebook="a")
    builder.op("Add", ["3", "1"], "4", "add0")
    builder.op("Relu", ["4"], "5", "relu0")
    # another key and another geometry (a key naming the same geometry on the same sites shares the rulebook)
    builder.conv("conv3", "5", "6", 4, 4, kernel=5, rulebook="b")
    session = runtime.load_model(builder.model(4, "6"))
    builds = []
    original = sparsecore.layer_geometry.build_rulebook  # the one place the core builds a layer's rulebook
    monkeypatch.setattr(sparsecore.layer_geometry, "build_rulebook",
                        lambda *args, **kwargs: builds.append(1) or original(*args, **kwargs))
    out = session.run(features, indices, 2, (9, 11, 7))
    assert len(builds) == 2  # key "a" once, key "b" once
    session.run(features, indices, 2, (9, 11, 7))
    assert len(builds) == 4  # a fresh cache per run
    mask = occupancy(indices, (9, 11, 7), 2)
    dense = densify(features, indices, (9, 11, 7), 2)
    first = _dense_subm(dense, *builder.weights["conv0"], mask, relu=True)
    second = _dense_subm(first, *builder.weights["conv1"], mask, relu=True)
    third = (_dense_subm(second, *builder.weights["conv2"], mask) + first).clamp(min=0)
    expected = read_sites(_dense_subm(third, *builder.weights["conv3"], mask), out.sparse.indices).numpy()
    np.testing.assert_array_equal(out.sparse.indices, indices)
    np.testing.assert_allclose(out.sparse.features, expected, rtol=1e-4, atol=1e-4)


def test_inverse_conv_reverses_the_strided_rulebook() -> None:
    rng, indices, features = _case(3)
    shape, batch = (9, 11, 7), 2
    builder = GraphBuilder(rng)
    builder.conv("conv0", "0", "1", 4, 6, kind="regular", stride=2, padding=1, rulebook="down")
    builder.conv("conv1", "1", "2", 6, 5, kind="inverse", rulebook="down")
    out = runtime.load_model(builder.model(4, "2")).run(features, indices, batch, shape)
    mask = occupancy(indices, shape, batch)
    down_mask = (dense_conv(mask, torch.ones(1, 3, 3, 3, 1, dtype=torch.float64), 2, 1, 1) > 0).double()
    weight, bias = builder.weights["conv0"]
    down = (dense_conv(densify(features, indices, shape, batch), torch.from_numpy(weight), 2, 1, 1)
            + torch.from_numpy(bias).view(1, -1, 1, 1, 1)) * down_mask
    weight, bias = builder.weights["conv1"]
    up = dense_conv_transpose(down, torch.from_numpy(weight), 2, 1, 1) + torch.from_numpy(bias).view(1, -1, 1, 1, 1)
    np.testing.assert_array_equal(out.sparse.indices, indices)
    assert tuple(out.sparse.spatial_shape) == shape
    np.testing.assert_allclose(out.sparse.features, read_sites(up, indices).numpy(), rtol=1e-4, atol=1e-4)


def test_transposed_conv_matches_the_dense_transposed_convolution() -> None:
    rng, indices, features = _case(4, shape=(4, 5, 3), num=30)
    builder = GraphBuilder(rng)
    builder.conv("conv0", "0", "1", 4, 3, kind="transposed", kernel=2, stride=2, activation="ReLU")
    out = runtime.load_model(builder.model(4, "1")).run(features, indices, 2, (4, 5, 3))
    weight, bias = builder.weights["conv0"]
    mask = occupancy(indices, (4, 5, 3), 2)
    up_mask = dense_conv_transpose(mask, torch.ones(1, 2, 2, 2, 1, dtype=torch.float64), 2, 0, 1) > 0
    up = dense_conv_transpose(densify(features, indices, (4, 5, 3), 2), torch.from_numpy(weight), 2, 0, 1)
    up = (up + torch.from_numpy(bias).view(1, -1, 1, 1, 1)).clamp(min=0)
    _check_sites(out.sparse.indices, up_mask.double())
    assert tuple(out.sparse.spatial_shape) == (8, 10, 6)
    np.testing.assert_allclose(out.sparse.features, read_sites(up, out.sparse.indices).numpy(), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("activation", ["Sigmoid", "LeakyReLU"])
def test_sigmoid_and_leaky_relu_activations(activation: str) -> None:
    rng, indices, features = _case(14)
    builder = GraphBuilder(rng)
    builder.conv("conv0", "0", "1", 4, 6, rulebook="a", activation=activation, act_alpha=0.2)
    out = runtime.load_model(builder.model(4, "1")).run(features, indices, 2, (9, 11, 7)).sparse
    mask = occupancy(indices, (9, 11, 7), 2)
    linear = read_sites(_dense_subm(densify(features, indices, (9, 11, 7), 2), *builder.weights["conv0"], mask),
                        indices)
    expected = torch.sigmoid(linear) if activation == "Sigmoid" else torch.nn.functional.leaky_relu(linear, 0.2)
    assert (linear < 0).any() and (linear > 0).any()
    np.testing.assert_allclose(out.features, expected.numpy(), rtol=1e-4, atol=1e-4)


def test_float16_session_is_within_fp16_tolerance_of_float32() -> None:
    rng, indices, features = _case(5)
    builder = GraphBuilder(rng)
    builder.conv("conv0", "0", "1", 4, 16, rulebook="a", activation="ReLU")
    builder.conv("conv1", "1", "2", 16, 8, kind="regular", stride=2, padding=1)
    model = builder.model(4, "2")
    full = runtime.load_model(model).run(features, indices, 2, (9, 11, 7)).sparse
    half = runtime.load_model(model, dtype="float16").run(features, indices, 2, (9, 11, 7)).sparse
    assert half.features.dtype == np.float16 and full.features.dtype == np.float32
    np.testing.assert_array_equal(half.indices, full.indices)
    np.testing.assert_allclose(half.features.astype(np.float32), full.features, rtol=2e-2, atol=2e-2)


def test_empty_input_gives_empty_sparse_and_zero_dense_outputs() -> None:
    rng = make_rng(6)
    builder = GraphBuilder(rng)
    builder.conv("conv0", "0", "1", 4, 8, rulebook="a", activation="ReLU")
    builder.conv("conv1", "1", "2", 8, 8, kind="regular", stride=2, padding=1)
    builder.op("ScatterDense", ["2"], "3", "scatter0", input_spatial_shape=[5, 6, 4], format="zyx",
               output_shape=[1, 8, 5, 6, 4], output_layout="NCHW")
    empty_features, empty_indices = np.zeros((0, 4), np.float32), np.zeros((0, 4), np.int32)
    dense = runtime.load_model(builder.model(4, "3")).run(empty_features, empty_indices, 1, (9, 11, 7)).dense
    assert dense.shape == (1, 8, 5, 6, 4) and not dense.any()
    sparse = runtime.load_model(builder.model(4, "1")).run(empty_features, empty_indices, 1, (9, 11, 7)).sparse
    assert sparse.features.shape == (0, 8) and sparse.indices.shape == (0, 4)


def test_add_of_different_sites_names_the_node() -> None:
    rng, indices, features = _case(7)
    builder = GraphBuilder(rng)
    builder.conv("conv0", "0", "1", 4, 4, rulebook="a")
    builder.conv("conv1", "0", "2", 4, 4, kind="regular", stride=2, padding=1)
    builder.op("Add", ["1", "2"], "3", "add_mismatch")
    session = runtime.load_model(builder.model(4, "3"))
    with pytest.raises(runtime.GraphError, match="add_mismatch.*same sites"):
        session.run(features, indices, 2, (9, 11, 7))


def test_bad_run_inputs_are_named() -> None:
    rng, indices, features = _case(8)
    builder = GraphBuilder(rng)
    builder.conv("conv0", "0", "1", 4, 4, rulebook="a")
    session = runtime.load_model(builder.model(4, "1"))
    with pytest.raises(ValueError, match=r"features must be \[N, 4\]"):
        session.run(features[:, :3], indices, 2, (9, 11, 7))
    with pytest.raises(ValueError, match="indices"):
        session.run(features, indices[:, :3], 2, (9, 11, 7))
    with pytest.raises(ValueError, match="out of range|outside|range"):
        session.run(features, indices, 1, (9, 11, 7))
    with pytest.raises(ValueError, match="dtype"):
        runtime.load_model(builder.model(4, "1"), dtype="int4")


def test_corrupt_and_foreign_files_are_clear_errors(tmp_path: Path) -> None:
    corrupt = tmp_path / "corrupt.onnx"
    corrupt.write_bytes(make_rng(9).bytes(300))
    with pytest.raises(runtime.GraphError, match="corrupt.onnx.*not a readable ONNX model"):
        runtime.load(corrupt)
    with pytest.raises(FileNotFoundError, match="missing.onnx"):
        runtime.load(tmp_path / "missing.onnx")
    weight = helper.make_tensor("w", helper.TensorProto.FLOAT, [2, 3, 3, 3], np.ones(54, np.float32))
    foreign = helper.make_model(helper.make_graph(
        [helper.make_node("Conv", ["x", "w"], ["y"], "plain_conv")], "cnn",
        [helper.make_tensor_value_info("x", helper.TensorProto.FLOAT, [1, 3, 8, 8])],
        [helper.make_tensor_value_info("y", helper.TensorProto.FLOAT, None)], [weight]))
    onnx.save(foreign, tmp_path / "foreign.onnx")
    with pytest.raises(runtime.GraphError, match="node 0 'plain_conv' \\(Conv\\).*not part of libspconv"):
        runtime.load(tmp_path / "foreign.onnx")


def test_malformed_nodes_are_named() -> None:
    rng = make_rng(10)
    builder = GraphBuilder(rng)
    builder.conv("conv0", "0", "1", 4, 4, rulebook="a")
    del builder.nodes[0].attribute[[a.name for a in builder.nodes[0].attribute].index("kernel_size")]
    with pytest.raises(runtime.GraphError, match="node 0 'conv0'.*'kernel_size' is missing"):
        runtime.load_model(builder.model(4, "1"))
    builder = GraphBuilder(rng)
    builder.conv("conv0", "0", "1", 4, 4, rulebook="a")
    builder.nodes[0].attribute[[a.name for a in builder.nodes[0].attribute].index("out_channels")].i = 5
    with pytest.raises(runtime.GraphError, match="conv0.*weight.*shape"):
        runtime.load_model(builder.model(4, "1"))
    builder = GraphBuilder(rng)
    builder.conv("conv0", "0", "1", 4, 4, rulebook="a")
    builder.op("Relu", ["missing"], "2", "relu_orphan")
    with pytest.raises(runtime.GraphError, match="relu_orphan.*'missing'"):
        runtime.load_model(builder.model(4, "2"))
    builder = GraphBuilder(rng)
    builder.conv("conv0", "0", "1", 4, 4, kind="inverse", rulebook="never_built")
    session = runtime.load_model(builder.model(4, "1"))
    _, indices, features = _case(11)
    with pytest.raises(runtime.GraphError, match="conv0.*inverse"):
        session.run(features, indices, 2, (9, 11, 7))


def test_conv_geometry_is_validated_when_the_file_is_read() -> None:
    rng = make_rng(13)
    builder = GraphBuilder(rng)
    builder.conv("conv0", "0", "1", 4, 4, kind="subm", kernel=2, rulebook="a")
    with pytest.raises(runtime.GraphError, match="node 0 'conv0'.*odd kernel size"):
        runtime.load_model(builder.model(4, "1"))
    builder = GraphBuilder(rng)
    builder.conv("conv0", "0", "1", 4, 4, kind="regular", kernel=3, stride=2, padding=1, rulebook="down")
    node = runtime.load_model(builder.model(4, "1")).graph.nodes[0]
    assert (node.kind, node.kernel_size, node.stride, node.padding, node.output_padding) == (
        "regular", (3, 3, 3), (2, 2, 2), (1, 1, 1), (0, 0, 0))
    assert node.geometry == sparsecore.ConvGeometry("regular", (3,) * 3, (2,) * 3, (1,) * 3, (1,) * 3, (0,) * 3)
    with pytest.raises(AttributeError, match="no attribute 'kernel'"):
        node.kernel


def test_runtime_imports_neither_torch_nor_jax(tmp_path: Path) -> None:
    builder = GraphBuilder(make_rng(12))
    builder.conv("conv0", "0", "1", 4, 4, rulebook="a", activation="ReLU")
    builder.op("ScatterDense", ["1"], "2", "scatter0", input_spatial_shape=[9, 11, 7], format="zyx",
               output_shape=[2, 4, 9, 11, 7], output_layout="NCHW")
    onnx.save(builder.model(4, "2"), tmp_path / "graph.onnx")
    _, indices, features = _case(12)
    np.savez(tmp_path / "input.npz", features=features, indices=indices)
    script = textwrap.dedent(f"""
        import sys
        import numpy as np
        import sparsecore.runtime as runtime
        data = np.load({str(tmp_path / 'input.npz')!r})
        out = runtime.load({str(tmp_path / 'graph.onnx')!r}).run(data["features"], data["indices"], 2, (9, 11, 7))
        assert out.dense.shape == (2, 4, 9, 11, 7) and out.dense.any()
        print("LOADED:" + ",".join(sorted(m for m in ("torch", "jax", "jaxlib", "cupy") if m in sys.modules)))
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "LOADED:\n" in done.stdout, done.stdout


@pytest.mark.gpu
def test_cupy_arrays_give_the_numpy_result() -> None:
    import cupy

    rng, indices, features = _case(13)
    builder = GraphBuilder(rng)
    builder.conv("conv0", "0", "1", 4, 8, rulebook="a", activation="ReLU")
    builder.conv("conv1", "1", "2", 8, 8, kind="regular", stride=2, padding=1)
    session = runtime.load_model(builder.model(4, "2"))
    cpu = session.run(features, indices, 2, (9, 11, 7)).sparse
    gpu = session.run(cupy.asarray(features), cupy.asarray(indices), 2, (9, 11, 7)).sparse
    np.testing.assert_array_equal(cupy.asnumpy(gpu.indices), cpu.indices)
    np.testing.assert_allclose(cupy.asnumpy(gpu.features), cpu.features, rtol=1e-4, atol=1e-4)


def test_reshape_for_another_batch_size_names_the_node() -> None:
    rng, indices, features = _case(15)
    builder = GraphBuilder(rng)
    builder.conv("conv0", "0", "1", 4, 2, rulebook="a")
    builder.op("ScatterDense", ["1"], "2", "scatter0", input_spatial_shape=[9, 11, 7], format="zyx",
               output_shape=[2, 2, 9, 11, 7], output_layout="NCHW")
    builder.op("Reshape", ["2"], "3", "reshape_bev", dims=[2, 18, 11, 7])
    session = runtime.load_model(builder.model(4, "3"))
    assert session.run(features, indices, 2, (9, 11, 7)).dense.shape == (2, 18, 11, 7)
    first = indices[:, 0] == 0
    with pytest.raises(runtime.GraphError, match="reshape_bev.*Reshape.*batch size"):
        session.run(features[first], indices[first], 1, (9, 11, 7))


def test_a_session_budget_refuses_a_step_and_names_the_node() -> None:
    rng, indices, features = _case(16, shape=(20, 20, 20), num=2000)
    builder = GraphBuilder(rng)
    builder.conv("conv0", "0", "1", 4, 8, kernel=9, rulebook="a", activation="ReLU")
    builder.conv("conv1", "1", "2", 8, 6, kind="regular", stride=2, padding=1, rulebook="down")
    model = builder.model(4, "2")
    with pytest.raises(runtime.MemoryBudgetError, match=r"node 'conv0' \(SparseConvolution\): building the rulebook "
                                                        r"of a subm geometry.*more than the memory budget of 2 MiB"):
        runtime.load_model(model, memory_budget="2M").run(features, indices, 2, (20, 20, 20))
    ample = runtime.load_model(model, memory_budget="1G").run(features, indices, 2, (20, 20, 20)).sparse
    plain = runtime.load_model(model).run(features, indices, 2, (20, 20, 20)).sparse
    np.testing.assert_array_equal(ample.features, plain.features)
    with pytest.raises(ValueError, match="memory_budget='lots' must be a positive number of bytes"):
        runtime.load_model(model, memory_budget="lots")


def test_check_finite_names_the_first_node_whose_output_is_not_finite() -> None:
    rng, indices, features = _case(17)
    builder = GraphBuilder(rng)
    builder.conv("conv0", "0", "1", 4, 8, rulebook="a")
    builder.op("Relu", ["1"], "2", "relu0")
    model = builder.model(4, "2")
    features[5, 2] = np.inf  # reaches conv0's output at site 5 and its neighbours
    with pytest.raises(runtime.NonFiniteError, match=r"node 'conv0' \(SparseConvolution\) wrote [0-9]+ non-finite "
                                                     r"value\(s\).*float32 output.*input features"):
        runtime.load_model(model, check_finite=True).run(features, indices, 2, (9, 11, 7))
    unchecked = runtime.load_model(model).run(features, indices, 2, (9, 11, 7)).sparse  # float32: off by default
    assert not np.isfinite(unchecked.features).all()
    assert runtime.load_model(model, dtype="float16").check_finite
