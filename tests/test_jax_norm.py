"""sparsecore.jax.batch_norm: statistics of the true rows only, explicit running state, jit and grad.

Oracles: NumPy float64 statistics of the true rows; central finite differences
(float64) for the gradients; torch.nn.BatchNorm1d for the running update and
evaluation over several steps.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sparsecore.jax as sj

GRID = (8, 8, 8)


@pytest.fixture
def x64():
    previous = bool(jax.config.jax_enable_x64)
    jax.config.update("jax_enable_x64", True)
    yield
    jax.config.update("jax_enable_x64", previous)


def _tensor(rng: np.random.Generator, rows: int, channels: int, capacity: int, dtype=np.float64,
            padding_value: float = 0.0) -> tuple[sj.SparseTensor, np.ndarray]:
    flat = rng.choice(int(np.prod(GRID)), rows, replace=False)
    indices = np.stack([flat % 2, flat // 64, (flat // 8) % 8, flat % 8], 1).astype(np.int32)
    features = (rng.standard_normal((rows, channels)) * rng.uniform(0.5, 3, channels) + rng.uniform(-2, 2, channels))
    x = sj.SparseTensor.from_arrays(features.astype(dtype), indices, GRID, 2, capacity=capacity)
    if padding_value:  # garbage in the padding rows: must not enter the statistics
        padded = np.asarray(x.features).copy()
        padded[rows:] = padding_value
        x = x.replace(jnp.asarray(padded))
    return x, features


def _random_params(rng: np.random.Generator, channels: int) -> tuple[dict, dict]:
    params = {"weight": jnp.asarray(rng.uniform(0.5, 1.5, channels)), "bias": jnp.asarray(rng.uniform(-1, 1, channels))}
    state = {"running_mean": jnp.asarray(rng.uniform(-1, 1, channels)),
             "running_var": jnp.asarray(rng.uniform(0.5, 2, channels))}
    return params, state


@pytest.mark.usefixtures("x64")
@pytest.mark.parametrize("padding_value", [0.0, 1e3])
def test_train_mode_uses_the_true_rows_only(padding_value: float) -> None:
    rng = np.random.default_rng(0)
    x, features = _tensor(rng, 37, 5, 64, padding_value=padding_value)
    params, state = _random_params(rng, 5)
    momentum, eps = 0.3, 1e-4
    y, new_state = jax.jit(sj.batch_norm, static_argnames=("train", "momentum", "eps"))(
        params, state, x, train=True, momentum=momentum, eps=eps)
    mean, var = features.mean(0), features.var(0)
    expected = (features - mean) / np.sqrt(var + eps) * np.asarray(params["weight"]) + np.asarray(params["bias"])
    out = np.asarray(y.features)
    np.testing.assert_allclose(out[:37], expected, rtol=1e-10, atol=1e-10)
    np.testing.assert_array_equal(out[37:], 0)
    assert y.sites_name == x.sites_name and y.plan.signature == x.plan.signature
    np.testing.assert_allclose(new_state["running_mean"],
                               (1 - momentum) * np.asarray(state["running_mean"]) + momentum * mean, rtol=1e-12)
    np.testing.assert_allclose(new_state["running_var"],
                               (1 - momentum) * np.asarray(state["running_var"]) + momentum * features.var(0, ddof=1),
                               rtol=1e-12)


@pytest.mark.usefixtures("x64")
def test_eval_mode_uses_the_running_statistics_and_keeps_the_state() -> None:
    rng = np.random.default_rng(1)
    x, features = _tensor(rng, 20, 3, 32, padding_value=-7.0)
    params, state = _random_params(rng, 3)
    y, same = sj.batch_norm(params, state, x, train=False, eps=1e-3)
    mean, var = np.asarray(state["running_mean"]), np.asarray(state["running_var"])
    expected = (features - mean) / np.sqrt(var + 1e-3) * np.asarray(params["weight"]) + np.asarray(params["bias"])
    np.testing.assert_allclose(np.asarray(y.features)[:20], expected, rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(np.asarray(y.features)[20:], 0)
    for key in state:
        np.testing.assert_array_equal(same[key], state[key])


@pytest.mark.usefixtures("x64")
@pytest.mark.parametrize("train", [True, False])
def test_gradients_match_finite_differences(train: bool) -> None:
    rng = np.random.default_rng(2)
    x, _ = _tensor(rng, 11, 3, 16)
    params, state = _random_params(rng, 3)
    cotangent = jnp.asarray(rng.standard_normal((16, 3)))

    def loss(features, weight, bias):
        y, _ = sj.batch_norm({"weight": weight, "bias": bias}, state, x.replace(features), train=train)
        return jnp.vdot(jnp.tanh(y.features), cotangent)

    args = [x.features, params["weight"], params["bias"]]
    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(*args)
    step = 1e-6
    for which, (arg, grad) in enumerate(zip(args, grads)):
        flat = np.asarray(arg).ravel()
        numeric = np.zeros_like(flat)
        for i in range(flat.size):
            up, down = flat.copy(), flat.copy()
            up[i] += step
            down[i] -= step
            plus = [*args]
            minus = [*args]
            plus[which] = jnp.asarray(up.reshape(np.shape(arg)))
            minus[which] = jnp.asarray(down.reshape(np.shape(arg)))
            numeric[i] = (float(loss(*plus)) - float(loss(*minus))) / (2 * step)
        np.testing.assert_allclose(np.asarray(grad).ravel(), numeric, rtol=1e-6, atol=1e-7)
    # padding rows get no gradient: they do not enter the output
    np.testing.assert_array_equal(np.asarray(grads[0])[11:], 0)


def test_matches_torch_batchnorm1d_over_several_steps() -> None:
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(3)
    bn = torch.nn.BatchNorm1d(4, momentum=0.2)
    with torch.no_grad():
        bn.weight.copy_(torch.from_numpy(rng.uniform(0.5, 1.5, 4).astype(np.float32)))
        bn.bias.copy_(torch.from_numpy(rng.uniform(-1, 1, 4).astype(np.float32)))
    params = {"weight": jnp.asarray(bn.weight.detach().numpy()), "bias": jnp.asarray(bn.bias.detach().numpy())}
    state = {key: jnp.asarray(value.numpy()) for key, value in bn.state_dict().items() if key.startswith("running")}
    state["num_batches_tracked"] = jnp.asarray(0)
    step = jax.jit(sj.batch_norm, static_argnames=("train", "momentum"))
    for rows in (30, 41, 25):
        x, features = _tensor(rng, rows, 4, 64, dtype=np.float32, padding_value=5.0)
        expected = bn(torch.from_numpy(features.astype(np.float32))).detach().numpy()
        y, state = step(params, state, x, train=True, momentum=0.2)
        np.testing.assert_allclose(np.asarray(y.features)[:rows], expected, rtol=1e-4, atol=1e-5)
    for key in ("running_mean", "running_var"):
        np.testing.assert_allclose(np.asarray(state[key]), getattr(bn, key).numpy(), rtol=1e-5, atol=1e-6)
    assert int(state["num_batches_tracked"]) == int(bn.num_batches_tracked) == 3
    bn.eval()
    x, features = _tensor(rng, 19, 4, 32, dtype=np.float32)
    y, _ = sj.batch_norm(params, state, x, train=False)
    np.testing.assert_allclose(np.asarray(y.features)[:19], bn(torch.from_numpy(features.astype(np.float32)))
                               .detach().numpy(), rtol=1e-4, atol=1e-5)


@pytest.mark.usefixtures("x64")
def test_axis_name_shares_the_statistics_of_every_member() -> None:
    rng = np.random.default_rng(4)
    x, first = _tensor(rng, 23, 3, 32)
    second = rng.standard_normal((23, 3)) * 2 + 1
    stacked = jnp.stack([x.features, jnp.asarray(np.pad(second, ((0, 9), (0, 0))))])
    params, state = _random_params(rng, 3)

    def member(features):
        y, new_state = sj.batch_norm(params, state, x.replace(features), train=True, axis_name="devices")
        return y.features, new_state["running_mean"]

    out, running = jax.vmap(member, axis_name="devices")(stacked)
    both = np.concatenate([first, second])
    mean, var = both.mean(0), both.var(0)
    scale, shift = np.asarray(params["weight"]), np.asarray(params["bias"])
    np.testing.assert_allclose(np.asarray(out[0])[:23], (first - mean) / np.sqrt(var + 1e-5) * scale + shift,
                               rtol=1e-10)
    np.testing.assert_allclose(np.asarray(out[1])[:23], (second - mean) / np.sqrt(var + 1e-5) * scale + shift,
                               rtol=1e-10)
    np.testing.assert_allclose(np.asarray(running[0]), 0.9 * np.asarray(state["running_mean"]) + 0.1 * mean,
                               rtol=1e-12)


def test_empty_input_keeps_the_state_and_gives_empty_output() -> None:
    x = sj.SparseTensor.from_arrays(np.zeros((0, 2), np.float32), np.zeros((0, 4), np.int32), GRID, 1, capacity=8)
    params, state = sj.init_batch_norm(2)
    y, new_state = jax.jit(sj.batch_norm, static_argnames="train")(params, state, x, train=True)
    np.testing.assert_array_equal(np.asarray(y.features), 0)
    for key in state:
        np.testing.assert_array_equal(new_state[key], state[key])


def test_padding_rows_stay_zero_with_non_finite_parameters() -> None:
    rng = np.random.default_rng(5)
    x, _ = _tensor(rng, 10, 2, 16, dtype=np.float32)
    params = {"weight": jnp.asarray([np.inf, 1.0], jnp.float32), "bias": jnp.asarray([0.0, np.nan], jnp.float32)}
    _, state = sj.init_batch_norm(2)
    for train in (True, False):
        y, _ = sj.batch_norm(params, state, x, train=train)
        np.testing.assert_array_equal(np.asarray(y.features)[10:], 0)


def test_init_batch_norm_values() -> None:
    params, state = sj.init_batch_norm(3)
    np.testing.assert_array_equal(params["weight"], 1)
    np.testing.assert_array_equal(params["bias"], 0)
    np.testing.assert_array_equal(state["running_mean"], 0)
    np.testing.assert_array_equal(state["running_var"], 1)


@pytest.mark.parametrize("case, match", [
    ("params", r"params\['weight'\] must have shape \[3\].*got \(4,\)"),
    ("state", r"state must be a mapping with 'running_var'.*got \['running_mean'\]"),
    ("train", r"train must be a Python bool"),
    ("momentum", r"momentum must be a number in \[0.0, 1.0\], got 1.5"),
    ("eps", r"eps must be a number in \(0.0, inf\], got 0"),
    ("tensor", r"x must be a sparsecore.jax.SparseTensor, got ndarray"),
    ("channels", r"num_features must be a positive int \(the channels\), got 0"),
    ("int state", r"state\['running_mean'\] must be a float array, got dtype int32"),
])
def test_bad_arguments_are_named(case: str, match: str) -> None:
    rng = np.random.default_rng(6)
    x, _ = _tensor(rng, 5, 3, 8, dtype=np.float32)
    params, state = sj.init_batch_norm(3)
    kwargs = {"train": True}
    error = ValueError
    if case == "params":
        params = sj.init_batch_norm(4)[0]
    elif case == "state":
        state = {"running_mean": state["running_mean"]}
    elif case == "train":
        kwargs["train"], error = "yes", TypeError
    elif case == "momentum":
        kwargs["momentum"] = 1.5
    elif case == "eps":
        kwargs["eps"] = 0
    elif case == "tensor":
        x, error = np.zeros((5, 3)), TypeError
    elif case == "channels":
        with pytest.raises(ValueError, match=match):
            sj.init_batch_norm(0)
        return
    elif case == "int state":
        state = {"running_mean": jnp.zeros(3, jnp.int32), "running_var": state["running_var"]}
        error = TypeError
    with pytest.raises(error, match=match):
        sj.batch_norm(params, state, x, **kwargs)
