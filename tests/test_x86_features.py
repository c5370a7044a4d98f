"""sparsecore.backends.x86_features: detection of avx512_vnni / avx512_bf16 and the SPARSECORE_CPU_ISA switch.

A CPU without the features is simulated by replacing what the CPU reports; the
switch is checked for each value it takes, for bad values and for restoring the
previous setting.
"""

from __future__ import annotations

import pytest

from sparsecore.backends import x86_features
from sparsecore.backends.x86_features import CpuFeatures

BOTH = CpuFeatures(avx512_vnni=True, avx512_bf16=True)


@pytest.fixture(autouse=True)
def _no_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(x86_features.ISA_VARIABLE, raising=False)


def _machine(monkeypatch: pytest.MonkeyPatch, reported: CpuFeatures, targeted: CpuFeatures = BOTH) -> None:
    monkeypatch.setattr(x86_features, "cpu_reported_features", lambda: reported)
    monkeypatch.setattr(x86_features, "numba_can_target", lambda: targeted)


def test_cpuinfo_flags_are_read_from_the_first_flags_line(tmp_path) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu avx512f avx512_vnni sse2\n\nflags\t: avx512_bf16\n")
    assert x86_features._cpuinfo_flags(str(cpuinfo)) == {"fpu", "avx512f", "avx512_vnni", "sse2"}
    assert x86_features._cpuinfo_flags(str(tmp_path / "missing")) is None


@pytest.mark.parametrize("value, expected", [
    ("", BOTH), ("auto", BOTH), (" AUTO ", BOTH), ("generic", CpuFeatures()),
    ("vnni", CpuFeatures(avx512_vnni=True)), ("avx512_bf16", CpuFeatures(avx512_bf16=True)),
    ("bf16, avx512_vnni", BOTH)])
def test_switch_values_on_a_cpu_with_both_features(value: str, expected: CpuFeatures, monkeypatch) -> None:
    _machine(monkeypatch, BOTH)
    monkeypatch.setenv(x86_features.ISA_VARIABLE, value)
    assert x86_features.selected_features() == expected
    assert x86_features.uses("vnni") == expected.avx512_vnni
    assert x86_features.uses("avx512_bf16") == expected.avx512_bf16


def test_a_cpu_without_the_features_selects_none_and_refuses_to_force_them(monkeypatch) -> None:
    _machine(monkeypatch, CpuFeatures(avx512_vnni=True))
    assert x86_features.selected_features() == CpuFeatures(avx512_vnni=True)
    monkeypatch.setenv(x86_features.ISA_VARIABLE, "bf16")
    with pytest.raises(ValueError, match="asks for avx512_bf16, but this CPU does not report it"):
        x86_features.uses("bf16")
    _machine(monkeypatch, BOTH, CpuFeatures())  # numba cannot target them (NUMBA_CPU_NAME, no numba)
    monkeypatch.setenv(x86_features.ISA_VARIABLE, "vnni")
    with pytest.raises(ValueError, match="numba cannot target it"):
        x86_features.selected_features()
    monkeypatch.setenv(x86_features.ISA_VARIABLE, "auto")
    assert x86_features.selected_features() == CpuFeatures()


def test_bad_values_are_refused_naming_the_variable(monkeypatch) -> None:
    monkeypatch.setenv(x86_features.ISA_VARIABLE, "avx2")
    with pytest.raises(ValueError, match="SPARSECORE_CPU_ISA='avx2' is not a CPU instruction-set choice"):
        x86_features.selected_features()
    with pytest.raises(ValueError, match="feature must be one of"):
        x86_features.uses("amx")


def test_cpu_isa_sets_the_switch_for_a_block_and_restores_it(monkeypatch) -> None:
    import os

    _machine(monkeypatch, BOTH)
    with x86_features.cpu_isa("generic") as selected:
        assert selected == CpuFeatures() and not x86_features.uses("vnni")
        with x86_features.cpu_isa("vnni"):
            assert x86_features.selected_features() == CpuFeatures(avx512_vnni=True)
        assert os.environ[x86_features.ISA_VARIABLE] == "generic"
    assert x86_features.ISA_VARIABLE not in os.environ
    with pytest.raises(ValueError):  # a bad value changes nothing
        with x86_features.cpu_isa("sse"):
            pass
    assert x86_features.ISA_VARIABLE not in os.environ
    with pytest.raises(RuntimeError), x86_features.cpu_isa("generic"):
        raise RuntimeError("inside the block")
    assert x86_features.ISA_VARIABLE not in os.environ


def test_numba_cpu_name_limits_the_targetable_features(monkeypatch) -> None:
    pytest.importorskip("numba")
    detect = x86_features.numba_can_target.__wrapped__
    monkeypatch.setenv("NUMBA_CPU_NAME", "generic")
    monkeypatch.delenv("NUMBA_CPU_FEATURES", raising=False)
    assert detect() == CpuFeatures()
    monkeypatch.setenv("NUMBA_CPU_FEATURES", "+avx512f,+avx512vnni")
    assert detect() == CpuFeatures(avx512_vnni=True)


def test_available_features_need_both_the_cpu_and_numba(monkeypatch) -> None:
    _machine(monkeypatch, CpuFeatures(avx512_vnni=True, avx512_bf16=True), CpuFeatures(avx512_bf16=True))
    assert x86_features.available_features() == CpuFeatures(avx512_bf16=True)
