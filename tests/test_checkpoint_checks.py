"""sparsecore.torch.checkpoint_checks, through a conv layer's load_state_dict: a checkpoint of the layer's own
values loads exactly (torch's copy is the oracle); non-finite, int, bool and complex values for float parameters and
the two layouts mistaken for spconv's are refused naming the key; the documented switch loads as torch does."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import sparsecore.torch as spconv  # noqa: E402
from tests.dense_oracle import make_rng  # noqa: E402


def _layer() -> "spconv.SubMConv3d":
    return spconv.SubMConv3d(4, 5, 3, bias=True, indice_key="k")


def _state(**values) -> dict:
    rng = make_rng(3990)
    state = {"weight": torch.from_numpy(rng.standard_normal((5, 3, 3, 3, 4)).astype(np.float32)),
             "bias": torch.from_numpy(rng.standard_normal(5).astype(np.float32))}
    state.update(values)
    return state


def test_a_checkpoint_of_float_values_loads_exactly(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SPARSECORE_CHECKPOINT_CHECKS", raising=False)
    monkeypatch.delenv("SPCONV_SAVED_WEIGHT_LAYOUT", raising=False)
    layer, state = _layer(), _state()
    layer.load_state_dict(state)
    torch.testing.assert_close(layer.weight.detach(), state["weight"], rtol=0, atol=0)
    half = _state(bias=state["bias"].half())  # another float dtype is converted, as torch does
    layer.load_state_dict(half)
    torch.testing.assert_close(layer.bias.detach(), half["bias"].float(), rtol=0, atol=0)


@pytest.mark.parametrize("key, value, error, message", [
    ("weight", "nan", ValueError, "state_dict\\['weight'\\] holds 1 non-finite value\\(s\\) of 540 \\(first: nan"),
    ("bias", torch.tensor([0.0, np.inf, 0.0, 0.0, 0.0]), ValueError, "state_dict\\['bias'\\] holds 1 non-finite"),
    ("bias", torch.arange(5), TypeError, "state_dict\\['bias'\\] has dtype torch.int64"),
    ("bias", torch.ones(5, dtype=torch.bool), TypeError, "state_dict\\['bias'\\] has dtype torch.bool"),
    ("bias", torch.ones(5, dtype=torch.complex64), TypeError, "state_dict\\['bias'\\] has dtype torch.complex64"),
    ("weight", "dense", ValueError, "torch's dense layout \\[out, in, \\*kernel\\].*permute\\(0, 2, 3, 4, 1\\)"),
])
def test_a_value_or_layout_torch_would_take_is_refused_naming_the_key(key, value, error, message,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SPARSECORE_CHECKPOINT_CHECKS", raising=False)
    monkeypatch.delenv("SPCONV_SAVED_WEIGHT_LAYOUT", raising=False)
    state = _state()
    if value == "nan":
        value = state["weight"].clone()
        value[1, 2, 0, 1, 3] = float("nan")
    elif value == "dense":
        value = state["weight"].permute(0, 4, 1, 2, 3).contiguous()
    state[key] = value
    for strict in (True, False):
        with pytest.raises(error, match=message):
            _layer().load_state_dict(state, strict=strict)


def test_the_switch_loads_as_torch_does(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPARSECORE_CHECKPOINT_CHECKS", "off")
    state = _state(bias=torch.tensor([1, 0, 2, 0, 3]))
    state["weight"][0, 0, 0, 0, 0] = float("nan")
    layer = _layer()
    layer.load_state_dict(state)
    reference = torch.nn.Parameter(torch.zeros(5))
    with torch.no_grad():
        reference.copy_(state["bias"])  # torch's own copy: the oracle
    torch.testing.assert_close(layer.bias.detach(), reference.detach())
    assert torch.isnan(layer.weight[0, 0, 0, 0, 0])


def test_a_transposed_1x1_weight_is_refused_and_spconv_s_own_loads(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SPCONV_SAVED_WEIGHT_LAYOUT", raising=False)
    rng = make_rng(3991)
    stored = torch.from_numpy(rng.standard_normal((6, 1, 1, 1, 4)).astype(np.float32))
    layer = spconv.SubMConv3d(4, 6, 1, bias=False)
    with pytest.raises(ValueError, match="a 1x1 weight saved transposed.*weight.reshape\\(\\[6, 1, 1, 1, 4\\]\\)"):
        layer.load_state_dict({"weight": stored.permute(4, 1, 2, 3, 0).contiguous()})
    layer.load_state_dict({"weight": stored})
    torch.testing.assert_close(layer.weight.detach(), stored, rtol=0, atol=0)
