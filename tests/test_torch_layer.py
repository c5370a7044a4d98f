"""sparsecore.torch.layer: the Nd layer classes, the layers' repr, and pickling whole models.

The public ``...{n}d`` classes are made from their ``...Nd`` base
(`layer.nd_variants`); each must be named as spconv names it, build an
``n``-D layer that refuses other inputs, keep spconv's constructor defaults,
and survive ``pickle`` (a model saved with ``torch.save`` loads and computes
the same features).
"""

from __future__ import annotations

import io

import pytest

torch = pytest.importorskip("torch")
spconv = pytest.importorskip("sparsecore.torch")
from sparsecore.torch import layer  # noqa: E402

try:
    from . import dense_oracle as do
except ImportError:
    import dense_oracle as do

FAMILIES = ("SparseConv", "SubMConv", "SparseConvTranspose", "SparseInverseConv", "SparseMaxPool", "SparseAvgPool")


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("ndim", [1, 2, 3, 4])
def test_nd_classes_build_layers_of_their_dimension(family, ndim):
    cls = getattr(spconv, f"{family}{ndim}d")
    assert cls.__name__ == cls.__qualname__ == f"{family}{ndim}d"
    assert getattr(__import__(cls.__module__, fromlist=["_"]), cls.__name__) is cls, "pickle finds it by name"
    assert f"{ndim}-D" in cls.__doc__
    if family.endswith("Pool"):
        module = cls(2)
        assert module.stride == [2] * ndim, "a pool's stride defaults to its kernel size"
    elif family == "SparseInverseConv":
        module = cls(2, 3, 3, indice_key="k")
    else:
        module = cls(2, 3, 3)
    assert module.ndim == ndim and module.kernel_size == [2 if family.endswith("Pool") else 3] * ndim
    other = 3 if ndim != 3 else 2
    indices = torch.zeros((1, other + 1), dtype=torch.int32)
    x = spconv.SparseConvTensor(torch.ones((1, 2), dtype=torch.float32), indices, [4] * other, 1)
    with pytest.raises(ValueError, match=f"{cls.__name__} is a {ndim}-D layer but the input has {other}"):
        module(x)


def test_repr_lists_non_default_geometry():
    conv = spconv.SparseConv3d(4, 8, (3, 1, 3), stride=2, padding=(1, 0, 1), dilation=1, bias=False,
                               indice_key="d")
    assert repr(conv) == ("SparseConv3d(4, 8, kernel_size=[3, 1, 3], stride=[2, 2, 2], padding=[1, 0, 1], "
                          "bias=False, indice_key='d')")
    pool = spconv.SparseMaxPool2d(3, 1, 1, dilation=2)
    assert repr(pool) == "SparseMaxPool2d(kernel_size=[3, 3], stride=[1, 1], padding=[1, 1], dilation=[2, 2])"
    assert layer.geometry_repr([2], [2], [0], [1]) == "kernel_size=[2], stride=[2]"


def test_a_pickled_model_loads_and_computes_the_same():
    rng = do.make_rng(99700)
    shape = [6, 5, 7]
    indices = do.random_indices(rng, shape, 2, 0.3)
    x = spconv.SparseConvTensor(torch.tensor(do.random_features(rng, indices.shape[0], 3)),
                                torch.from_numpy(indices), shape, 2)
    model = spconv.SparseSequential(spconv.SubMConv3d(3, 4, 3, indice_key="s"), spconv.SparseReLU(),
                                    spconv.SparseConv3d(4, 4, 2, 2, indice_key="d"), spconv.SparseAvgPool3d(1),
                                    spconv.SparseInverseConv3d(4, 2, 2, indice_key="d")).double()
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert [type(m) for m in loaded] == [type(m) for m in model]
    expected, actual = model(x), loaded(x)
    assert torch.equal(actual.features, expected.features) and actual.indices is x.indices


# --------------------------------------------------------------------------- one module owns the forward


@pytest.mark.parametrize("make", [lambda: spconv.SubMConv3d(4, 4, 3), lambda: spconv.SparseConv3d(4, 4, 3, 2, 1),
                                  lambda: spconv.SparseMaxPool3d(2), lambda: spconv.SparseAvgPool3d(3, 1, 1)],
                         ids=["subm", "regular", "max-pool", "avg-pool"])
def test_one_module_owns_a_layers_forward(make):
    """From the module call to the output tensor, `sparsecore.torch.layer` runs the layer: it is entered first
    and left last, and every other module of the frontend is a service it calls (counted with the op's
    machinery as one box; the path before the straightening, through conv, layer, _geometry, ops, tensor and
    indice_data, crossed 84 module boundaries for a SubMConv3d, 75 of them returns to a module left)."""
    try:
        from .module_transitions import module_transitions
    except ImportError:
        from module_transitions import module_transitions

    rng = do.make_rng(93500)
    indices = torch.from_numpy(do.random_indices(rng, [6, 7, 5], 1, 0.3))
    features = torch.tensor(do.random_features(rng, indices.shape[0], 4), dtype=torch.float32)
    layer = make()
    layer(spconv.SparseConvTensor(features, indices, [6, 7, 5], 1))  # lazy imports out of the count
    x = spconv.SparseConvTensor(features, indices, [6, 7, 5], 1)
    counted = module_transitions(lambda: layer(x), opaque=("sparsecore.torch._op_table",))
    short = [module.rsplit(".", 1)[-1] for module in counted.path]
    assert short[:2] == ["fx", "layer"] and short[-2:] == ["layer", "fx"], short
    assert not {"_geometry", "ops", "pool"} & set(short), short  # no detour through the old adapters
    assert counted.returns <= 45, (counted.returns, short)
