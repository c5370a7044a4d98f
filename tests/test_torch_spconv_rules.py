"""sparsecore.torch.spconv_rules: fused activations, saved weight layouts, the 1x1 key rule.

Fused activations go against torch's own functions applied to the output of
the same layer without one; ``SPCONV_SAVED_WEIGHT_LAYOUT`` against NumPy
transposes of the saved array; the 1x1 key rule against what spconv does (a
SubM 1x1 layer neither reads nor saves its key, a strided one keeps it).
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
spconv = pytest.importorskip("sparsecore.torch")
from sparsecore.torch import spconv_rules  # noqa: E402

try:
    from . import dense_oracle as do
except ImportError:
    import dense_oracle as do

SHAPE = [5, 6, 4]


def _input(seed, channels=3):
    rng = do.make_rng(99600, seed)
    indices = do.random_indices(rng, SHAPE, 2, 0.3)
    features = torch.tensor(do.random_features(rng, indices.shape[0], channels))
    return spconv.SparseConvTensor(features, torch.from_numpy(indices), SHAPE, 2)


@pytest.mark.parametrize("act_type, reference", [
    ("sigmoid", torch.sigmoid),
    ("LeakyReLU", lambda t: torch.nn.functional.leaky_relu(t, 0.2)),
    ("none", lambda t: t),
])
def test_fused_activations(act_type, reference):
    x = _input(1)
    fused = spconv.SparseConvolution(3, 3, 4, 3, subm=True, act_type=act_type, act_alpha=0.2).double()
    plain = spconv.SubMConv3d(3, 4, 3).double()
    plain.load_state_dict(fused.state_dict())
    torch.testing.assert_close(fused(x).features, reference(plain(x).features), rtol=1e-14, atol=1e-14)


def test_unknown_activation_names_the_accepted_ones():
    with pytest.raises(ValueError, match="act_type must be None, 'relu', 'sigmoid' or 'leaky_relu', got 'gelu'"):
        spconv.SparseConvolution(3, 3, 3, 3, act_type="gelu")


@pytest.mark.parametrize("layout, to_saved", [
    ("RSKC", lambda w: np.transpose(w, (1, 2, 3, 0, 4))),  # [out, *k, in] saved as [*k, out, in]
    ("RSCK", lambda w: np.transpose(w, (1, 2, 3, 4, 0))),  # saved as [*k, in, out]
])
def test_saved_weight_layouts_load_as_krsc(monkeypatch, layout, to_saved):
    rng = do.make_rng(99610)
    weight = rng.standard_normal((4, 3, 2, 1, 5))  # [out, *k, in]
    monkeypatch.setenv("SPCONV_SAVED_WEIGHT_LAYOUT", layout)
    layer = spconv.SparseConv3d(5, 4, (3, 2, 1), bias=False).double()
    layer.load_state_dict({"weight": torch.from_numpy(np.ascontiguousarray(to_saved(weight)))})
    np.testing.assert_array_equal(layer.weight.detach().numpy(), weight)
    monkeypatch.setenv("SPCONV_SAVED_WEIGHT_LAYOUT", "KCRS")
    with pytest.raises(ValueError, match="must be KRSC, RSKC or RSCK, got 'KCRS'"):
        layer.load_state_dict({"weight": torch.from_numpy(weight)})


def test_one_by_one_key_rule():
    x = _input(2)
    subm = spconv.SubMConv3d(3, 4, 1, indice_key="k")
    strided = spconv.SparseConv3d(3, 4, 1, 2, indice_key="s")
    assert spconv_rules.layer_rulebook_key(subm) is None
    assert spconv_rules.layer_rulebook_key(strided) == "s"
    assert spconv_rules.layer_rulebook_key(spconv.SubMConv3d(3, 4, 3, indice_key="k")) == "k"
    y = subm.double()(x)
    assert "k" not in y.indice_dict, "spconv's 1x1 shortcut saves no rulebook"
    # the 3x3 layer that owns the key still builds and saves its own rulebook afterwards
    z = spconv.SubMConv3d(4, 4, 3, indice_key="k").double()(y)
    assert "k" in z.indice_dict
    assert "s" in strided.double()(x).indice_dict
