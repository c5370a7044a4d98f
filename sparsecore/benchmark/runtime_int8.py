"""The int8 rows of ``python -m sparsecore.benchmark runtime --int8``.

The benchmark's SECOND-style backbone goes through spconv's PTQ workflow
(`sparsecore.torch.quantization`: ``prepare_fx`` with spconv's qconfig
mapping, calibrated on the scan itself, ``convert_fx``, `transform_qdq`,
`remove_conv_add_dq`), is exported with ``export_onnx(..., precision="int8")``
and timed both as the converted torch model and through `sparsecore.runtime`'s
int8 mode (every sparse conv int8 x int8 with int32 sums; the dense output
dequantized by ``ScatterDense``).
"""

from __future__ import annotations

import tempfile
import warnings
from pathlib import Path
from typing import Any, Callable

__all__ = ["int8_variants"]


def _converted(net: Any, example: Any, bev_shape: tuple[int, ...]) -> Any:
    import torch
    import torch.ao.quantization.quantize_fx as qfx
    from torch import nn

    import sparsecore.torch.quantization as spconvq

    class Traceable(nn.Module):  # the backbone with its BEV view as constants (fx cannot unpack shapes)
        def __init__(self) -> None:
            super().__init__()
            self.net = net

        def forward(self, x: Any) -> Any:
            return self.net(x).dense().view(*bev_shape)

    mapping = spconvq.get_default_spconv_qconfig_mapping(False)
    backend = spconvq.get_spconv_backend_config()
    with warnings.catch_warnings():  # torch marks these two calls of ours deprecated (the fx workflow): that alone
        warnings.filterwarnings("ignore", message=r"torch\.ao\.quantization is deprecated", category=DeprecationWarning)
        prepared = qfx.prepare_fx(Traceable().eval(), mapping, (), backend_config=backend,
                                  prepare_custom_config=spconvq.get_spconv_prepare_custom_config())
        with torch.no_grad():
            prepared(example)  # calibration: the scan itself
        spconvq.prepare_spconv_torch_inference(True)
        converted = qfx.convert_fx(prepared, qconfig_mapping=mapping, backend_config=backend)
    return spconvq.remove_conv_add_dq(spconvq.transform_qdq(converted))


def int8_variants(model: Any, example: Any, run_input: Callable[[], Any], core_features: Any, core_indices: Any,
                  batch_size: int, spatial_shape: list[int]) -> dict[str, Callable[[], Any]]:
    """The timed functions ``"sparsecore.torch int8"`` and ``"sparsecore.runtime int8"``.

    Args:
        model: the benchmark's float backbone (its ``net`` is quantized; BatchNorm folded by ``prepare_fx``).
        example: the CPU `SparseConvTensor` of the scan (calibration and export).
        run_input: makes the `SparseConvTensor` the torch model runs on.
        core_features, core_indices: the scan as the runtime takes it (NumPy or CuPy).
        batch_size, spatial_shape: the scan's.

    Returns:
        name -> function returning the dense BEV output (torch tensor or array).
    """
    import torch

    import sparsecore.runtime as runtime
    import sparsecore.torch as spconv

    with torch.no_grad():
        bev_shape = tuple(model(example).shape)
    converted = _converted(model.net, example, bev_shape)
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / "second_int8.onnx"
        spconv.export_onnx(converted, example, path, precision="int8")
        session = runtime.load(path)

    def torch_int8() -> Any:
        with torch.no_grad():
            return converted(run_input())

    return {"sparsecore.torch int8": torch_int8,
            "sparsecore.runtime int8": lambda: session.run(core_features, core_indices, batch_size,
                                                           spatial_shape).dense}
