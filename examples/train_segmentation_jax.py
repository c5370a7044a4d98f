"""Train a MinkUNet-style sparse U-Net for LiDAR semantic segmentation with sparsecore.jax and optax.

The JAX twin of ``train_segmentation_torch.py``: the same synthetic 64-beam
scans (``sparsecore.scene``; every point is ground (0), car (1) or other (2:
poles and walls)), the same voxelization, the same network (submanifold
residual blocks, strided convs down, inverse convs up, skip concatenation,
normalisation, ReLU), the same class-weighted loss, AdamW with a one-cycle
schedule. The script:

1. ray-casts the scenes, voxelizes them once and builds every batch's plan
   (rulebooks) outside ``jit`` with ``sparsecore.jax.plan``; all batches are then
   padded to the same capacities (``sparsecore.jax.repad``), so the train step
   compiles once and the evaluation forward once,
2. trains with a jitted step (``jax.value_and_grad`` + optax) and a tqdm progress bar,
3. reports the validation mIoU over points after every epoch,
4. saves the parameter pytree (``np.savez``, keys ``"stem/weight"`` etc.), reloads it
   and checks that it gives identical outputs,
5. writes ``training.png`` (loss and mIoU curves) to ``--out``.

Normalisation: ``sparsecore.jax`` has no batch norm layer (parameters are plain
pytrees, layers are functions), so the network uses a per-channel
normalisation written here in ``jnp``: mean and variance over the *valid* rows
of the tensor (``x.mask``; padding rows would otherwise pull the statistics to
zero), then a learnt scale and shift. It uses the statistics of the current
batch in training and in evaluation alike (no running averages), which is
deterministic and enough for this task; the torch example's BatchNorm uses
running averages at evaluation.

Run ``python examples/train_segmentation_jax.py`` (under a minute on
2 CPU cores), or a quick check with
``--epochs 1 --scenes 2 --val-scenes 1 --points 3000``.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # write PNGs, no display needed
import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np
import optax
from tqdm import tqdm

import sparsecore as sc
import sparsecore.jax as sj
from sparsecore.scene import CLASS_NAMES, SceneConfig, lidar_scene

NUM_CLASSES = len(CLASS_NAMES)
VOXEL_SIZE = (0.25, 0.25, 0.25)
RANGE = (-20.0, -20.0, -2.0, 20.0, 20.0, 4.0)  # x, y, z min then max, metres
SCENE = SceneConfig(azimuth_steps=360, max_range=20.0, placement_radius=15.0, num_cars=6, num_poles=8)


# ----------------------------------------------------------------------------- data


def make_scenes(seeds, max_points):
    """Ray-casts one scene per seed; keeps at most ``max_points`` random points of each."""
    clouds, labels = [], []
    for seed in seeds:
        scene = lidar_scene(seed, SCENE)
        keep = np.arange(scene.num_points)
        if max_points and scene.num_points > max_points:
            keep = np.sort(np.random.default_rng(seed).choice(scene.num_points, max_points, replace=False))
        clouds.append(scene.points[keep])
        labels.append(scene.labels[keep])
    return clouds, labels


def voxelize(clouds, labels):
    """One batch (NumPy): voxel features, indices (batch first), voxel labels, point labels and ids."""
    batch = sc.voxelize_batch(clouds, VOXEL_SIZE, RANGE, max_num_points_per_voxel=8, max_num_voxels=100_000)
    means = sc.voxel_means(batch)  # [M, 4]: x, y, z, range
    # Scale the features to about [-1, 1]; height above the ground is the main cue.
    features = (means - np.array([0.0, 0.0, -1.7, 0.0], np.float32)) / np.array([20, 20, 2, 20], np.float32)
    point_ids = np.concatenate(batch.point_voxel_id)
    point_labels = np.concatenate(labels)
    # A voxel's label is the most common label of its points.
    valid = point_ids >= 0
    votes = np.zeros((batch.num_voxels, NUM_CLASSES), np.int64)
    np.add.at(votes, (point_ids[valid], point_labels[valid]), 1)
    return {
        "features": np.ascontiguousarray(features, dtype=np.float32),
        "indices": batch.indices,
        "voxel_labels": votes.argmax(axis=1),
        "point_ids": point_ids,
        "point_labels": point_labels,
        "batch_size": batch.batch_size,
        "grid_size": tuple(batch.grid_size),
    }


def as_sparse(batch):
    """The batch's input `SparseTensor` (no plan yet)."""
    return sj.SparseTensor.from_arrays(batch["features"], batch["indices"], batch["grid_size"],
                                       batch["batch_size"])


def plan_batches(batches, params):
    """Plans every batch (outside jit), then pads all of them to common capacities.

    Equal capacities give equal plan signatures: one compile for the whole data set.
    """
    tensors = []
    for batch in batches:
        x = as_sparse(batch)
        tensors.append(x.with_plan(sj.plan(apply, params, x)))
    names = tensors[0].plan.sites
    capacities = {name: max(t.plan.sites[name].info.capacity for t in tensors) for name in names}
    for batch, x in zip(batches, tensors):
        x = sj.repad(x, capacities)
        labels = np.full(x.capacity, -1, np.int32)  # -1 on padding rows: no loss there
        labels[: len(batch["voxel_labels"])] = batch["voxel_labels"]
        batch["x"], batch["labels"] = x, jnp.asarray(labels)
    return capacities


# ----------------------------------------------------------------------------- model


def init_norm(channels):
    return {"scale": jnp.ones((channels,)), "shift": jnp.zeros((channels,))}


def init_model(key, in_channels, num_classes, width=16):
    """The parameter pytree: conv weights ``[out, 3, 3, 3, in]`` and per-channel norm scale / shift."""
    c1, c2, c3 = width, 2 * width, 4 * width
    keys = iter(jax.random.split(key, 16))

    def conv_norm(cin, cout):
        return {"conv": sj.init_conv(next(keys), cin, cout, 3), "norm": init_norm(cout)}

    def residual(channels):
        return {"conv1": sj.init_conv(next(keys), channels, channels, 3), "norm1": init_norm(channels),
                "conv2": sj.init_conv(next(keys), channels, channels, 3), "norm2": init_norm(channels)}

    bound = 1.0 / np.sqrt(c1)  # torch.nn.Linear's default initialisation
    head_w, head_b = jax.random.split(next(keys))
    return {
        "stem": conv_norm(in_channels, c1), "enc1": residual(c1),
        "down1": conv_norm(c1, c2), "enc2": residual(c2),
        "down2": conv_norm(c2, c3), "enc3": residual(c3),
        "up2": conv_norm(c3, c2), "dec2": conv_norm(2 * c2, c2),
        "up1": conv_norm(c2, c1), "dec1": conv_norm(2 * c1, c1),
        "head": {"weight": jax.random.uniform(head_w, (c1, num_classes), minval=-bound, maxval=bound),
                 "bias": jax.random.uniform(head_b, (num_classes,), minval=-bound, maxval=bound)},
    }


def normalize(x, p, eps=1e-5):
    """Per-channel normalisation over the valid rows of ``x`` (padding rows masked), then scale and shift."""
    mask = x.mask[:, None].astype(x.features.dtype)
    count = jnp.maximum(x.num_active, 1).astype(x.features.dtype)
    mean = jnp.sum(x.features * mask, axis=0) / count
    var = jnp.sum(jnp.square(x.features - mean) * mask, axis=0) / count
    y = (x.features - mean) * jax.lax.rsqrt(var + eps) * p["scale"] + p["shift"]
    return y * mask  # keep padding rows at zero


def conv_norm_relu(x, p, conv):
    y = conv(x, p["conv"]["weight"])
    return y.replace(jax.nn.relu(normalize(y, p["norm"])))


def residual_block(x, p):
    """Two 3x3x3 submanifold convs with normalisation and ReLU, plus the input (MinkUNet's basic block)."""
    y = sj.subm_conv(x, p["conv1"]["weight"])
    y = y.replace(jax.nn.relu(normalize(y, p["norm1"])))
    y = sj.subm_conv(y, p["conv2"]["weight"])
    return y.replace(jax.nn.relu(normalize(y, p["norm2"]) + x.features))


def down(x, w):
    return sj.sparse_conv(x, w, stride=2, padding=1)


def concat(y, skip):
    # an inverse conv returns to the down layer's input sites, in their row order: concatenate features
    return y.replace(jnp.concatenate([y.features, skip.features], axis=1))


def apply(params, x):
    """Encoder 16 -> 32 -> 64 channels at strides 1, 2, 4; decoder back up with skip concatenation.

    Returns ``[capacity, num_classes]`` logits on the input sites (zero-padded rows are meaningless).
    """
    skip1 = residual_block(conv_norm_relu(x, params["stem"], sj.subm_conv), params["enc1"])
    skip2 = residual_block(conv_norm_relu(skip1, params["down1"], down), params["enc2"])
    y = residual_block(conv_norm_relu(skip2, params["down2"], down), params["enc3"])
    y = conv_norm_relu(y, params["up2"], sj.inverse_conv)  # back to the sites of skip2
    y = conv_norm_relu(concat(y, skip2), params["dec2"], sj.subm_conv)
    y = conv_norm_relu(y, params["up1"], sj.inverse_conv)  # back to the sites of skip1
    y = conv_norm_relu(concat(y, skip1), params["dec1"], sj.subm_conv)
    return y.features @ params["head"]["weight"] + params["head"]["bias"]


def loss_fn(params, x, labels, class_weights):
    """Class-weighted cross entropy over the valid voxels (like torch's ``CrossEntropyLoss(weight=...)``)."""
    logits = apply(params, x)
    valid = labels >= 0
    safe = jnp.where(valid, labels, 0)
    nll = optax.softmax_cross_entropy_with_integer_labels(logits, safe)
    weight = jnp.where(valid, class_weights[safe], 0.0)
    return jnp.sum(weight * nll) / jnp.sum(weight)


# ----------------------------------------------------------------------------- evaluation

predict = jax.jit(apply)


def mean_iou(params, batches):
    """mIoU over all points of the batches (points outside the grid count as class 0 predictions)."""
    confusion = np.zeros((NUM_CLASSES, NUM_CLASSES), np.int64)
    for batch in batches:
        per_point = sj.voxels_to_points(predict(params, batch["x"]), batch["point_ids"])
        predicted = np.asarray(jnp.argmax(per_point, axis=1))
        confusion += np.bincount(batch["point_labels"] * NUM_CLASSES + predicted,
                                 minlength=NUM_CLASSES ** 2).reshape(NUM_CLASSES, NUM_CLASSES)
    hits = np.diag(confusion).astype(np.float64)
    union = confusion.sum(0) + confusion.sum(1) - np.diag(confusion)
    iou = hits / np.maximum(union, 1)
    return float(iou.mean()), iou.tolist()


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
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--scenes", type=int, default=12, help="training scenes")
    parser.add_argument("--val-scenes", type=int, default=3)
    parser.add_argument("--points", type=int, default=0, help="keep at most this many points per scene (0: all)")
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--lr", type=float, default=0.005,
                        help="peak learning rate (lower than the torch example's 0.02: no BatchNorm here)")
    parser.add_argument("--impl", choices=sj.IMPLS, default=None,
                        help="feature passes: jnp (pure XLA) or callback (the core's NumPy passes; "
                             "faster to compile); default: sparsecore.jax.default_impl()")
    parser.add_argument("--out", type=Path, default=Path("runs/segmentation_jax"))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.impl:
        sj.set_default_impl(args.impl)
    args.out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()

    # Scenes 1000+ are for validation, so they never overlap the training seeds.
    train_clouds, train_labels = make_scenes(range(args.seed, args.seed + args.scenes), args.points)
    val_clouds, val_labels = make_scenes(range(1000 + args.seed, 1000 + args.seed + args.val_scenes), args.points)
    chunks = range(0, args.scenes, args.batch_size)
    train = [voxelize(train_clouds[i:i + args.batch_size], train_labels[i:i + args.batch_size]) for i in chunks]
    val = [voxelize(val_clouds[i:i + args.batch_size], val_labels[i:i + args.batch_size])
           for i in range(0, args.val_scenes, args.batch_size)]
    voxels = sum(b["features"].shape[0] for b in train)
    print(f"{args.scenes} training scenes, {sum(len(c) for c in train_clouds):,} points, {voxels:,} voxels")

    key = jax.random.PRNGKey(args.seed)
    params = init_model(key, in_channels=4, num_classes=NUM_CLASSES)
    capacities = plan_batches(train, params)
    plan_batches(val, params)
    print(f"plans built; training capacities {capacities['input']:,} rows at stride 1 "
          f"({len(capacities)} site sets)")

    # Rare classes (poles, walls) weigh more: inverse square root of the voxel frequency.
    counts = np.bincount(np.concatenate([b["voxel_labels"] for b in train]), minlength=NUM_CLASSES)
    class_weights = np.sqrt(counts.sum() / np.maximum(counts, 1))
    class_weights = jnp.asarray(class_weights / class_weights.mean(), jnp.float32)

    schedule = optax.cosine_onecycle_schedule(max(1, args.epochs * len(train)), args.lr)
    optimizer = optax.adamw(schedule, weight_decay=1e-4)
    opt_state = optimizer.init(params)

    @jax.jit
    def train_step(params, opt_state, x, labels):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, labels, class_weights)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    rng = np.random.default_rng(args.seed)
    losses, mious = [], []
    for epoch in range(1, args.epochs + 1):
        order = rng.permutation(len(train)).tolist()
        progress = tqdm(order, desc=f"epoch {epoch}/{args.epochs}", leave=False)
        for index in progress:
            batch = train[index]
            params, opt_state, loss = train_step(params, opt_state, batch["x"], batch["labels"])
            losses.append(float(loss))
            progress.set_postfix(loss=f"{losses[-1]:.3f}")
        miou, ious = mean_iou(params, val)
        mious.append(miou)
        per_class = ", ".join(f"{name} {iou:.2f}" for name, iou in zip(CLASS_NAMES, ious))
        print(f"epoch {epoch}: loss {np.mean(losses[-len(train):]):.3f}, val mIoU {miou:.3f} ({per_class})")

    # Save, reload, and check that the reloaded parameters compute the same thing.
    checkpoint = args.out / "checkpoint.npz"
    save_params(checkpoint, params, epochs=args.epochs, miou=mious[-1])
    reloaded = load_params(checkpoint)
    assert jax.tree_util.tree_structure(reloaded) == jax.tree_util.tree_structure(params), "pytree differs"
    same = np.array_equal(np.asarray(predict(params, val[0]["x"])), np.asarray(predict(reloaded, val[0]["x"])))
    assert same, "reloaded model differs"
    print(f"checkpoint {checkpoint} reloaded: same outputs")

    figure, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.plot(losses)
    left.set(xlabel="step", ylabel="training loss", title="loss")
    right.plot(range(1, len(mious) + 1), mious, marker="o")
    right.axhline(1 / NUM_CLASSES, color="grey", linestyle="--", label="1 / classes")
    right.set(xlabel="epoch", ylabel="validation mIoU", title="mIoU", ylim=(0, 1))
    right.legend()
    figure.tight_layout()
    figure.savefig(args.out / "training.png", dpi=100)
    print(f"final val mIoU {mious[-1]:.3f}; plot {args.out / 'training.png'}; "
          f"{time.perf_counter() - start:.0f} s in all")


if __name__ == "__main__":
    main()
