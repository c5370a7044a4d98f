"""Train a MinkUNet-style sparse U-Net for LiDAR semantic segmentation with sparsecore.jax and optax.

The JAX twin of ``train_segmentation_torch.py``: the same synthetic 64-beam
scans (``sparsecore.scene``; every point is ground (0), car (1) or other (2:
poles and walls)), the same voxelization, the same network (submanifold
residual blocks, strided convs down, inverse convs up, skip concatenation,
batch norm, ReLU), the same class-weighted loss, AdamW with the same one-cycle
schedule (``_segmentation_common.py`` holds what the two share). The script:

1. ray-casts the scenes, voxelizes them once and builds every batch's plan
   (rulebooks) outside ``jit`` with ``sparsecore.jax.plan``; all batches are then
   padded to the same capacities (``sparsecore.jax.repad``), so the train step
   compiles once and the evaluation forward once,
2. trains with a jitted step (``jax.value_and_grad`` + optax) and a tqdm progress bar,
3. reports the validation mIoU over points after every epoch,
4. saves the parameters and the batch-norm state (``np.savez``, keys like
   ``"params/stem/conv/weight"``), reloads them and checks that they give identical outputs,
5. writes ``training.png`` (loss and mIoU curves) to ``--out``.

Batch norm is ``sparsecore.jax.batch_norm``: the statistics of the true rows of
the batch in training (padding rows excluded), the running statistics at
evaluation, carried as an explicit ``state`` pytree beside the parameters
(``apply(params, state, x, train) -> (logits, new_state)``), like flax's
``batch_stats``.

Run ``python examples/train_segmentation_jax.py`` (a few minutes on 2 CPU
cores), or a quick check with ``--epochs 1 --scenes 2 --val-scenes 1 --points 3000``.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm import tqdm

import sparsecore.jax as sj
from _segmentation_common import (BN_EPS, BN_MOMENTUM, WEIGHT_DECAY, class_weights, confusion, epoch_orders,
                                  finish, initial_weights, learning_rates, load_data, mean_iou, parse_args,
                                  report_epoch)


# ----------------------------------------------------------------------------- data


def as_sparse(batch):
    """The batch's input `SparseTensor` (no plan yet)."""
    return sj.SparseTensor.from_arrays(batch.features, batch.indices, batch.grid_size, batch.batch_size)


def plan_batches(batches, params, state, impl=None):
    """Plans every batch (outside jit, with the feature-pass ``impl``), then pads all of them to common capacities.

    Equal capacities give equal plan signatures: one compile for the whole data set.
    Returns the capacities and, per batch, ``(tensor, voxel labels padded with -1)``.
    """
    tensors = []
    for batch in batches:
        x = as_sparse(batch)
        tensors.append(x.with_plan(sj.plan(apply, params, state, x, False).with_impl(impl)))
    names = tensors[0].plan.sites
    capacities = {name: max(t.plan.sites[name].info.capacity for t in tensors) for name in names}
    planned = []
    for batch, x in zip(batches, tensors):
        x = sj.repad(x, capacities)
        labels = np.full(x.capacity, -1, np.int32)  # -1 on padding rows: no loss there
        labels[: len(batch.voxel_labels)] = batch.voxel_labels
        planned.append((x, jnp.asarray(labels)))
    return capacities, planned


# ----------------------------------------------------------------------------- model


def init_model(weights, width=16):
    """``(params, state)`` from `initial_weights` (shared with the torch example): conv weights
    ``[out, 3, 3, 3, in]`` and the head as given, batch norms at scale 1, shift 0 with fresh running statistics."""
    params = jax.tree_util.tree_map(jnp.asarray, weights)
    state = {}
    for name, convs in params.items():
        if name == "head":
            continue
        for conv_name in list(convs):
            norm_name = conv_name.replace("conv", "norm")
            norm, stats = sj.init_batch_norm(convs[conv_name].shape[0])
            params[name] = {**params[name], conv_name: {"weight": convs[conv_name]}, norm_name: norm}
            state.setdefault(name, {})[norm_name] = stats
    return params, state


def apply(params, state, x, train):
    """Encoder 16 -> 32 -> 64 channels at strides 1, 2, 4; decoder back up with skip concatenation.

    Returns ``([capacity, num_classes] logits on the input sites, new batch-norm state)``;
    the logits of padding rows are meaningless.
    """
    new_state = {}

    def norm(y, name, key):
        y, new_state.setdefault(name, {})[key] = sj.batch_norm(params[name][key], state[name][key], y, train=train,
                                                                momentum=BN_MOMENTUM, eps=BN_EPS)
        return y

    def conv_norm_relu(x, name, conv):
        y = norm(conv(x, params[name]["conv"]["weight"]), name, "norm")
        return y.replace(jax.nn.relu(y.features))

    def residual_block(x, name):  # two 3x3x3 submanifold convs plus the input (MinkUNet's basic block)
        y = norm(sj.subm_conv(x, params[name]["conv1"]["weight"]), name, "norm1")
        y = norm(sj.subm_conv(y.replace(jax.nn.relu(y.features)), params[name]["conv2"]["weight"]), name, "norm2")
        return y.replace(jax.nn.relu(y.features + x.features))

    def down(x, w):
        return sj.sparse_conv(x, w, stride=2, padding=1)

    def concat(y, skip):  # an inverse conv returns to the down layer's input sites, in their row order
        return y.replace(jnp.concatenate([y.features, skip.features], axis=1))

    skip1 = residual_block(conv_norm_relu(x, "stem", sj.subm_conv), "enc1")
    skip2 = residual_block(conv_norm_relu(skip1, "down1", down), "enc2")
    y = residual_block(conv_norm_relu(skip2, "down2", down), "enc3")
    y = conv_norm_relu(y, "up2", sj.inverse_conv)  # back to the sites of skip2
    y = conv_norm_relu(concat(y, skip2), "dec2", sj.subm_conv)
    y = conv_norm_relu(y, "up1", sj.inverse_conv)  # back to the sites of skip1
    y = conv_norm_relu(concat(y, skip1), "dec1", sj.subm_conv)
    return y.features @ params["head"]["weight"] + params["head"]["bias"], new_state


def loss_fn(params, state, x, labels, weights):
    """Class-weighted cross entropy over the valid voxels (like torch's ``CrossEntropyLoss(weight=...)``)."""
    logits, new_state = apply(params, state, x, True)
    valid = labels >= 0
    safe = jnp.where(valid, labels, 0)
    nll = optax.softmax_cross_entropy_with_integer_labels(logits, safe)
    weight = jnp.where(valid, weights[safe], 0.0)
    return jnp.sum(weight * nll) / jnp.sum(weight), new_state


# ----------------------------------------------------------------------------- evaluation


@jax.jit
def predict(params, state, x):
    return apply(params, state, x, False)[0]


def evaluate(params, state, batches, planned):
    """``(mIoU, per-class IoU)`` over all points (batch norm on its running statistics).

    Each point gets its voxel's logits (``voxels_to_points``); points outside the grid get
    zeros, so they count as class 0 predictions.
    """
    matrix = 0
    for batch, (x, _) in zip(batches, planned):
        per_point = sj.voxels_to_points(predict(params, state, x), batch.point_ids)
        matrix = matrix + confusion(batch.point_labels, np.asarray(jnp.argmax(per_point, axis=1)))
    return mean_iou(matrix)


# ----------------------------------------------------------------------------- checkpoints


def save_params(path, params, **extra):
    """``np.savez`` of the flattened pytree (keys like ``"enc1/conv1/weight"``) plus scalars."""
    flat = {"/".join(str(k.key) for k in key_path): np.asarray(leaf)
            for key_path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]}
    np.savez(path, **flat, **{f"meta:{k}": np.asarray(v) for k, v in extra.items()})


def load_params(path):
    """The nested dict of arrays written by `save_params` (metadata left out)."""
    params = {}
    with np.load(path) as data:
        for name in data.files:
            if name.startswith("meta:"):
                continue
            *parents, leaf = name.split("/")
            node = params
            for parent in parents:
                node = node.setdefault(parent, {})
            node[leaf] = jnp.asarray(data[name])
    return params


# ----------------------------------------------------------------------------- main


def main():
    args = parse_args(__doc__.split("\n")[0], "runs/segmentation_jax",
                      [("--impl", {"choices": sj.IMPLS, "default": None,
                                   "help": "feature passes: jnp (pure XLA) or callback (the core's NumPy passes; "
                                           "faster to compile); None: sparsecore.jax.default_impl()"})])
    start = time.perf_counter()
    train, val = load_data(args)

    params, state = init_model(initial_weights(args.seed))
    capacities, train_planned = plan_batches(train, params, state, args.impl)
    _, val_planned = plan_batches(val, params, state, args.impl)
    print(f"plans built; training capacities {capacities['input']:,} rows at stride 1 "
          f"({len(capacities)} site sets)")

    weights = jnp.asarray(class_weights(train))
    rates = jnp.asarray(learning_rates(args.epochs * len(train), args.lr))  # the torch example's numbers

    def schedule(step):  # one-cycle cosine (optax.cosine_onecycle_schedule's curve, step for step like torch's)
        return rates[jnp.minimum(step, rates.shape[0] - 1)]

    optimizer = optax.adamw(schedule, b1=0.9, b2=0.999, eps=1e-8, weight_decay=WEIGHT_DECAY)
    opt_state = optimizer.init(params)

    @jax.jit
    def train_step(params, state, opt_state, x, labels):
        (loss, state), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, state, x, labels, weights)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), state, opt_state, loss

    losses, mious = [], []
    for epoch, order in enumerate(epoch_orders(args.seed, args.epochs, len(train)), start=1):
        progress = tqdm(order, desc=f"epoch {epoch}/{args.epochs}", leave=False)
        for index in progress:
            x, labels = train_planned[index]
            params, state, opt_state, loss = train_step(params, state, opt_state, x, labels)
            losses.append(float(loss))
            progress.set_postfix(loss=f"{losses[-1]:.3f}")
        miou, ious = evaluate(params, state, val, val_planned)
        mious.append(miou)
        report_epoch(epoch, losses, len(train), miou, ious)

    # Save, reload, and check that the reloaded parameters and state compute the same thing.
    checkpoint = args.out / "checkpoint.npz"
    save_params(checkpoint, {"params": params, "state": state}, epochs=args.epochs, miou=mious[-1])
    reloaded = load_params(checkpoint)
    assert jax.tree_util.tree_structure(reloaded) == jax.tree_util.tree_structure(
        {"params": params, "state": state}), "pytree differs"
    x = val_planned[0][0]
    same = np.array_equal(np.asarray(predict(params, state, x)),
                          np.asarray(predict(reloaded["params"], reloaded["state"], x)))
    assert same, "reloaded model differs"
    finish(checkpoint, losses, mious, args.out, start, "sparsecore.jax")


if __name__ == "__main__":
    main()
