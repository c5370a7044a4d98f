"""The same layers give the same numbers in sparsecore.jax and sparsecore.torch for the same weights.

A small U-Net-like block (subm conv with bias, strided conv, subm conv, inverse
conv, max / avg pools, global pools) runs in both frontends in float64 with the
torch modules' own weights copied into the JAX parameters (the layouts are the
same, ``[out, *kernel, in // groups]``); outputs and weight gradients must agree.
Skipped when sparsecore.torch (or a layer it needs) is not available.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
spt = pytest.importorskip("sparsecore.torch")

import sparsecore.jax as sj  # noqa: E402

try:
    from .test_jax_oracle import random_features, random_sites, x64  # noqa: F401 (fixture)
except ImportError:
    from test_jax_oracle import random_features, random_sites, x64  # type: ignore[no-redef]  # noqa: F401

pytestmark = pytest.mark.usefixtures("x64")

NEEDED = ("SparseConvTensor", "SubMConv3d", "SparseConv3d", "SparseInverseConv3d", "SparseMaxPool3d",
          "SparseAvgPool3d", "SparseGlobalMaxPool", "SparseGlobalAvgPool")
missing = [name for name in NEEDED if not hasattr(spt, name)]
if missing:
    pytest.skip(f"sparsecore.torch lacks {missing}", allow_module_level=True)


def _modules():
    torch.manual_seed(0)
    return torch.nn.ModuleDict({
        "a": spt.SubMConv3d(3, 4, 3, bias=True, indice_key="subm1"),
        "down": spt.SparseConv3d(4, 5, 3, stride=2, padding=1, bias=False, indice_key="down"),
        "b": spt.SubMConv3d(5, 5, 3, bias=False, indice_key="subm2"),
        "up": spt.SparseInverseConv3d(5, 4, 3, indice_key="down", bias=True),
    }).double()


def _torch_forward(mods, features, indices, shape, batch):
    x = spt.SparseConvTensor(features, indices, shape, batch)
    x = mods["a"](x)
    x = x.replace_feature(torch.relu(x.features))
    y = mods["down"](x)
    y = mods["b"](y)
    pooled_max = spt.SparseMaxPool3d(2, 2)(y)
    pooled_avg = spt.SparseAvgPool3d(3, 2, 1)(y)
    up = mods["up"](y)
    return up, pooled_max, pooled_avg, spt.SparseGlobalMaxPool()(up), spt.SparseGlobalAvgPool()(y)


def _jax_forward(p, x, impl):
    x = sj.subm_conv(x, p["a.weight"], p["a.bias"], impl=impl)
    x = x.replace(jax.nn.relu(x.features))
    y = sj.sparse_conv(x, p["down.weight"], stride=2, padding=1, impl=impl)
    y = sj.subm_conv(y, p["b.weight"], impl=impl)
    pooled_max = sj.sparse_max_pool(y, 2, 2, impl=impl)
    pooled_avg = sj.sparse_avg_pool(y, 3, 2, 1, impl=impl)
    up = sj.inverse_conv(y, p["up.weight"], p["up.bias"], impl=impl)
    return up, pooled_max, pooled_avg, sj.global_max_pool(up), sj.global_avg_pool(y)


def _rows_by_site(features, indices):
    order = np.lexsort(np.asarray(indices).T[::-1])
    return np.asarray(features)[order], np.asarray(indices)[order]


@pytest.mark.parametrize("impl", ["jnp", "callback"])
def test_same_layers_same_numbers_in_jax_and_torch(impl):
    rng = np.random.default_rng(31)
    shape, batch = (9, 10, 8), 2
    indices = random_sites(rng, shape, batch, 150)
    features = random_features(rng, indices.shape[0], 3)
    mods = _modules()
    params = sj.params_from_state_dict(mods.state_dict())
    params = {f"{k}.{n}": v for k, group in params.items() for n, v in group.items()}

    t_features = torch.tensor(features, requires_grad=True)
    t_outs = _torch_forward(mods, t_features, torch.tensor(indices, dtype=torch.int32), list(shape), batch)

    x = sj.SparseTensor.from_arrays(features, indices, shape, batch)
    x = x.with_plan(sj.plan(_jax_forward, params, x, impl))
    j_outs = jax.jit(_jax_forward, static_argnums=2)(params, x, impl)

    for t_out, j_out in zip(t_outs[:3], j_outs[:3]):
        n = int(j_out.num_active)
        got, got_sites = _rows_by_site(j_out.features[:n], j_out.indices[:n])
        want, want_sites = _rows_by_site(t_out.features.detach().numpy(), t_out.indices.numpy())
        np.testing.assert_array_equal(got_sites, want_sites)
        np.testing.assert_allclose(got, want, rtol=1e-11, atol=1e-11)
    for t_out, j_out in zip(t_outs[3:], j_outs[3:]):
        np.testing.assert_allclose(np.asarray(j_out), t_out.detach().numpy(), rtol=1e-11, atol=1e-11)

    # gradients of one scalar made from every output, in both frontends
    weights = [rng.standard_normal(np.asarray(o.features.shape if hasattr(o, "features") else o.shape))
               for o in t_outs]
    t_loss = sum((o.features if hasattr(o, "features") else o).mul(torch.tensor(w)).sum()
                 for o, w in zip(t_outs, weights))
    t_loss.backward()

    def j_loss(p, f):
        outs = _jax_forward(p, x.replace(f), impl)
        total = 0.0
        for o, w, t_o in zip(outs, weights, t_outs):
            if hasattr(o, "features"):  # align torch's row order with the jax tensor's
                n = int(t_o.features.shape[0])
                total = total + jnp.sum(o.features[:n] * jnp.asarray(w))
            else:
                total = total + jnp.sum(o * jnp.asarray(w))
        return total

    # jax and torch outputs list their rows in the same (core) order: checked above via the sorted sites
    for t_o, j_o in zip(t_outs[:3], j_outs[:3]):
        np.testing.assert_array_equal(np.asarray(j_o.indices[: int(j_o.num_active)]), t_o.indices.numpy())
    grads, grad_features = jax.jit(jax.grad(j_loss, argnums=(0, 1)))(params, x.features)
    for name, module_name in (("a.weight", "a"), ("a.bias", "a"), ("down.weight", "down"), ("b.weight", "b"),
                              ("up.weight", "up"), ("up.bias", "up")):
        attribute = name.split(".")[1]
        want = getattr(mods[module_name], attribute).grad.numpy()
        np.testing.assert_allclose(np.asarray(grads[name]), want, rtol=1e-10, atol=1e-10, err_msg=name)
    np.testing.assert_allclose(np.asarray(grad_features[: indices.shape[0]]), t_features.grad.numpy(),
                               rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("impl", ["jnp", "callback"])
def test_checkpoint_with_1x1_layers_computes_as_in_torch(impl):
    """spconv reads a 1x1 layer's stored weight as ``view(in, out)`` (sparsecore.torch follows it,
    tested against spconv itself); a checkpoint loaded into JAX must compute the same numbers."""
    torch.manual_seed(5)
    mods = torch.nn.ModuleDict({
        "a": spt.SubMConv3d(3, 5, 3, bias=True, indice_key="s"),
        "project": spt.SubMConv3d(5, 7, 1, bias=True),
        "pointwise": spt.SparseConv3d(7, 4, 1, bias=False),
    }).double()
    rng = np.random.default_rng(41)
    shape, batch = (7, 8, 9), 2
    indices = random_sites(rng, shape, batch, 120)
    features = random_features(rng, indices.shape[0], 3)
    x = spt.SparseConvTensor(torch.tensor(features), torch.tensor(indices, dtype=torch.int32), list(shape), batch)
    want = mods["pointwise"](mods["project"](mods["a"](x)))

    tree = sj.params_from_state_dict(mods.state_dict())

    def forward(p, t):
        t = sj.subm_conv(t, p["a"]["weight"], p["a"]["bias"], impl=impl)
        t = sj.subm_conv(t, p["project"]["weight"], p["project"]["bias"], impl=impl)
        return sj.sparse_conv(t, p["pointwise"]["weight"], impl=impl)

    jx = sj.SparseTensor.from_arrays(features, indices, shape, batch)
    jx = jx.with_plan(sj.plan(forward, tree, jx))
    got = jax.jit(forward)(tree, jx)
    n = int(got.num_active)
    got_rows, got_sites = _rows_by_site(got.features[:n], got.indices[:n])
    want_rows, want_sites = _rows_by_site(want.features.detach().numpy(), want.indices.numpy())
    np.testing.assert_array_equal(got_sites, want_sites)
    np.testing.assert_allclose(got_rows, want_rows, rtol=1e-11, atol=1e-11)

    # the layout reading (spconv_1x1=False) computes something else on these non-square 1x1 layers
    plain = sj.params_from_state_dict(mods.state_dict(), spconv_1x1=False)
    assert not np.allclose(np.asarray(plain["project"]["weight"]), np.asarray(tree["project"]["weight"]))
    np.testing.assert_array_equal(np.asarray(plain["a"]["weight"]), np.asarray(tree["a"]["weight"]))
