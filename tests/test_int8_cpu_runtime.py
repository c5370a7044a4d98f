"""sparsecore.runtime's int8 mode on the CPU takes the VNNI route where the switch selects it, with the same bits.

A libspconv int8 graph (one int8 subm conv, float input and output; the
integer reference of `runtime_graphs.int8_expected` is its oracle) runs with the
int8 size threshold lowered, once with ``SPARSECORE_CPU_ISA=auto`` and once
with ``generic`` (a CPU without avx512_vnni, simulated).
"""

from __future__ import annotations

from unittest import mock

import numpy as np
import pytest

pytest.importorskip("onnx")

import onnx  # noqa: E402

import sparsecore.runtime as runtime  # noqa: E402
from sparsecore.backends import _cpu_kernels, _int8_cpu_kernels, _int8_vnni_kernels, x86_features  # noqa: E402
from tests.runtime_graphs import SHAPE, BATCH, case_input, int8_expected, int8_model  # noqa: E402


def test_runtime_int8_session_runs_the_vnni_kernel_where_selected(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(_cpu_kernels, "NUMPY_MAX_WORK", -1)  # this small cloud takes the route a scan takes
    _, indices, features = case_input(3820, num=150)
    builder = int8_model(np.random.default_rng(3820), features)
    onnx.save(builder.model(4, "1"), str(tmp_path / "int8.onnx"))
    session = runtime.load(tmp_path / "int8.onnx")
    expected = int8_expected(builder, features, indices)
    vnni = _int8_cpu_kernels.available() and x86_features.available_features().avx512_vnni
    outputs = {}
    for isa in ("auto", "generic"):
        with x86_features.cpu_isa(isa), \
                mock.patch.object(_int8_vnni_kernels, "conv", wraps=_int8_vnni_kernels.conv) as kernel:
            out = session.run(features, indices, BATCH, SHAPE).sparse
        assert kernel.call_count == (1 if isa == "auto" and vnni else 0), isa
        np.testing.assert_array_equal(np.asarray(out.indices), indices)
        outputs[isa] = np.asarray(out.features, dtype=np.float32)
        np.testing.assert_allclose(outputs[isa], expected, rtol=1e-6, atol=1e-6)
    assert outputs["auto"].tobytes() == outputs["generic"].tobytes()
