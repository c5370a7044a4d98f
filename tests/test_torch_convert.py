"""torch <-> core conversion: zero-copy views on the CPU, and no CuPy import on the CPU path."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest

torch = pytest.importorskip("torch")
spconv = pytest.importorskip("sparsecore.torch")
from sparsecore.torch import _convert  # noqa: E402


def test_core_view_shares_memory():
    t = torch.randn(5, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(99001))
    view = _convert.core_view(t, "t")
    assert isinstance(view, np.ndarray)
    assert view.__array_interface__["data"][0] == t.data_ptr()
    t[0, 0] = 42.0
    assert view[0, 0] == 42.0


def test_core_view_detaches_and_makes_contiguous():
    t = torch.randn(4, 6, generator=torch.Generator().manual_seed(99002), requires_grad=True)
    assert _convert.core_view(t, "t").__array_interface__["data"][0] == t.data_ptr()
    strided = t.detach()[:, ::2]
    view = _convert.core_view(strided, "strided")
    np.testing.assert_array_equal(view, strided.numpy())
    with pytest.raises(TypeError, match="must be a torch.Tensor"):
        _convert.core_view(np.zeros(3), "x")


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.float64, torch.int8, torch.uint8,
                                   torch.int16, torch.int32, torch.int64, torch.bool])
def test_core_view_of_every_dtype_holds_the_tensor_values(dtype):
    values = torch.randint(-100, 100, (7, 3), generator=torch.Generator().manual_seed(99003))
    t = values.to(dtype)
    view = _convert.core_view(t, "t")
    assert view.dtype == np.dtype(str(dtype).replace("torch.", ""))
    assert view.__array_interface__["data"][0] == t.data_ptr()
    assert view.tolist() == t.tolist()


def test_core_view_of_a_tensor_subclass_and_bfloat16():
    class Tagged(torch.Tensor):
        pass

    values = torch.randn(4, 5, generator=torch.Generator().manual_seed(99004))
    tagged = values.as_subclass(Tagged)
    np.testing.assert_array_equal(_convert.core_view(tagged, "tagged"), values.numpy())
    bfloat16 = values.bfloat16()
    view = _convert.core_float_view(bfloat16, "b")  # the core's bfloat16 passes read it (ml_dtypes), no copy
    assert view.dtype.name == "bfloat16" and view.__array_interface__["data"][0] == bfloat16.data_ptr()
    np.testing.assert_array_equal(view.astype(np.float32), bfloat16.float().numpy())
    np.testing.assert_array_equal(_convert.to_torch(view).view(torch.int16), bfloat16.view(torch.int16))


def test_to_torch_shares_memory():
    array = np.arange(12, dtype=np.int32).reshape(3, 4)
    tensor = _convert.to_torch(array)
    assert tensor.data_ptr() == array.__array_interface__["data"][0]
    assert _convert.to_torch(array, torch.float64).dtype == torch.float64


def test_layer_outputs_view_the_core_rulebook():
    rng = np.random.default_rng(0)
    flat = rng.choice(6 * 6 * 6, 40, replace=False)
    indices = np.column_stack([np.zeros(40, np.int32), *np.unravel_index(flat, (6, 6, 6))]).astype(np.int32)
    features = torch.randn(40, 2, generator=torch.Generator().manual_seed(99003))
    x = spconv.SparseConvTensor(features, torch.from_numpy(indices), [6, 6, 6], 1)
    y = spconv.SparseConv3d(2, 2, 3, 2, 1, indice_key="d")(x)
    data = y.find_indice_pair("d")
    assert data.pair_input.data_ptr() == data.rulebook.pair_input.__array_interface__["data"][0]
    assert y.indices.data_ptr() == data.rulebook.output_indices.__array_interface__["data"][0]
    assert data.rulebook.input_indices.__array_interface__["data"][0] == x.indices.data_ptr()
    assert y.core_indices() is data.rulebook.output_indices, "the output keeps the core view (no re-conversion)"
    z = spconv.SubMConv3d(2, 2, 3)(y)
    assert z.indices is y.indices and z.core_indices() is y.core_indices()


def test_cpu_path_never_imports_cupy():
    script = textwrap.dedent(
        """
        import sys
        import torch
        import sparsecore.torch as spconv
        torch.manual_seed(99004)
        indices = torch.tensor([[0, 1, 1, 1], [0, 2, 2, 2], [1, 0, 3, 1]], dtype=torch.int32)
        x = spconv.SparseConvTensor(torch.randn(3, 2, requires_grad=True), indices, [4, 4, 4], 2)
        model = spconv.SparseSequential(spconv.SubMConv3d(2, 3, 3, indice_key="s"),
                                        spconv.SparseConv3d(3, 3, 3, 2, 1, indice_key="d"),
                                        spconv.SparseInverseConv3d(3, 2, 3, indice_key="d"),
                                        spconv.SparseMaxPool3d(2))
        model(x).dense().sum().backward()
        table = spconv.HashTable(torch.device("cpu"), torch.int64, torch.int64)
        table.insert(torch.tensor([3, 4]))
        print("LOADED:" + ",".join(sorted(n for n in sys.modules if n.split(".")[0] in ("cupy", "cupy_backends"))))
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    (line,) = [line for line in done.stdout.splitlines() if line.startswith("LOADED:")]
    assert line == "LOADED:", f"the CPU path imported {line}"


def test_cuda_tensor_without_a_usable_cuda_device_is_one_clear_error():
    """core_context for a CUDA device goes through the core's one no-GPU check (CuPy's error never surfaces)."""
    from sparsecore.backends import CudaUnavailableError, require_cuda
    from sparsecore.torch._convert import core_context

    try:
        require_cuda()
    except CudaUnavailableError:
        pass
    else:
        pytest.skip("a CUDA device is visible here")
    with pytest.raises(CudaUnavailableError) as caught:
        with core_context(torch.device("cuda", 0)):
            raise AssertionError("not reached without a GPU")
    message = str(caught.value)
    assert message.startswith("a CUDA tensor (on cuda:0) in sparsecore.torch needs")
    assert "model.cpu()" in message
