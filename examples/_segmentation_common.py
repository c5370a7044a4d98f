"""What the segmentation examples share: data, recipe, mIoU and the plot (NumPy only).

``train_segmentation_torch.py`` and ``train_segmentation_jax.py`` train the same
network on the same data with the same recipe; everything that does not depend
on the framework lives here, so the two cannot drift apart (``quantize_int8.py``
reads its data and its mIoU from here too):

- the synthetic 64-beam scans (``sparsecore.scene``: ground (0), car (1), other
  (2: poles and walls)), the voxelization and the per-voxel labels;
- the command line (the same flags and defaults in both);
- the initial weights (drawn here with NumPy from ``--seed``): with the same
  starting point the two frameworks' training curves agree to rounding, so their
  mIoU compares the frontends, not two random initialisations (on this short
  schedule different initialisations alone move the final mIoU by 0.2);
- the training recipe: class weights (inverse square root of the voxel
  frequency), AdamW (betas 0.9 / 0.999, eps 1e-8, weight decay 1e-4) with a
  one-cycle cosine learning rate (`learning_rates`: peak ``--lr``, 30 % warm-up,
  start at peak / 25, end at peak / 25e4; no momentum cycling), batch norm with
  momentum 0.1 and eps 1e-5, running statistics at evaluation;
- the point mIoU, the batch order of each epoch and the loss / mIoU plot.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import numpy as np

import sparsecore as sc
from sparsecore.scene import CLASS_NAMES, SceneConfig, lidar_scene

NUM_CLASSES = len(CLASS_NAMES)
IN_CHANNELS = 4  # voxel means of x, y, z, range
VOXEL_SIZE = (0.25, 0.25, 0.25)
RANGE = (-20.0, -20.0, -2.0, 20.0, 20.0, 4.0)  # x, y, z min then max, metres
SCENE = SceneConfig(azimuth_steps=360, max_range=20.0, placement_radius=15.0, num_cars=6, num_poles=8)
# the voxel features (means of x, y, z, range) scaled to about [-1, 1]; height above the ground is the main cue
FEATURE_OFFSET = np.array([0.0, 0.0, -1.7, 0.0], np.float32)
FEATURE_SCALE = np.array([20, 20, 2, 20], np.float32)

# the training recipe of both examples
WEIGHT_DECAY = 1e-4
WARMUP_FRACTION = 0.3  # of the steps, learning rate rising from peak / DIV_FACTOR to peak
DIV_FACTOR = 25.0
FINAL_DIV_FACTOR = 1e4  # the last step's learning rate is peak / (DIV_FACTOR * FINAL_DIV_FACTOR)
BN_MOMENTUM = 0.1
BN_EPS = 1e-5


@dataclass(frozen=True)
class Batch:
    """One voxelized batch of scenes (NumPy).

    Attributes:
        features: float32 ``[M, 4]`` scaled voxel means.
        indices: int32 ``[M, 4]`` (batch, z, y, x).
        voxel_labels: int64 ``[M]``, the most common label of each voxel's points.
        point_ids: int64 ``[P]``, each point's voxel row (-1: outside the grid or dropped).
        point_labels: int64 ``[P]``.
        batch_size: scenes in the batch.
        grid_size: the spatial shape (z, y, x).
    """

    features: np.ndarray
    indices: np.ndarray
    voxel_labels: np.ndarray
    point_ids: np.ndarray
    point_labels: np.ndarray
    batch_size: int
    grid_size: tuple[int, ...]


def initial_weights(seed: int, in_channels: int = IN_CHANNELS, num_classes: int = NUM_CLASSES,
                    width: int = 16) -> dict[str, dict[str, np.ndarray]]:
    """The network's initial conv and head weights (NumPy), so both examples start from the same point.

    Convs: ``{"<layer>": {"<conv>": [out, 3, 3, 3, in]}}`` drawn like spconv's (and ``sparsecore.torch``'s,
    ``sparsecore.jax.init_conv``'s) ``U(-1/sqrt(fan_in), 1/sqrt(fan_in))``, ``fan_in = 27 * in``;
    ``"head"``: ``{"weight": [width, num_classes], "bias": [num_classes]}`` like ``torch.nn.Linear``.
    Layers with one conv name it ``"conv"``, residual blocks ``"conv1"`` and ``"conv2"``.
    Batch norms start at scale 1, shift 0 in both frameworks.
    """
    rng = np.random.default_rng(seed)
    c1, c2, c3 = width, 2 * width, 4 * width

    def conv(cin, cout):
        bound = 1.0 / np.sqrt(27 * cin)
        return rng.uniform(-bound, bound, (cout, 3, 3, 3, cin)).astype(np.float32)

    weights = {}
    for name, (cin, cout) in {"stem": (in_channels, c1), "down1": (c1, c2), "down2": (c2, c3), "up2": (c3, c2),
                              "dec2": (2 * c2, c2), "up1": (c2, c1), "dec1": (2 * c1, c1)}.items():
        weights[name] = {"conv": conv(cin, cout)}
    for name, channels in {"enc1": c1, "enc2": c2, "enc3": c3}.items():
        weights[name] = {"conv1": conv(channels, channels), "conv2": conv(channels, channels)}
    bound = 1.0 / np.sqrt(c1)
    weights["head"] = {"weight": rng.uniform(-bound, bound, (c1, num_classes)).astype(np.float32),
                       "bias": rng.uniform(-bound, bound, num_classes).astype(np.float32)}
    return weights


def learning_rates(steps: int, peak: float) -> np.ndarray:
    """float64 ``[steps]``: the one-cycle cosine learning rate of every step (torch's ``OneCycleLR`` curve).

    Rises from ``peak / DIV_FACTOR`` to ``peak`` over the first ``WARMUP_FRACTION`` of the
    steps, then falls to ``peak / (DIV_FACTOR * FINAL_DIV_FACTOR)`` at the last step. Both
    examples read their rates from here, so their schedules are the same numbers.
    """
    start, low = peak / DIV_FACTOR, peak / (DIV_FACTOR * FINAL_DIV_FACTOR)
    top = WARMUP_FRACTION * steps - 1
    rates = np.empty(max(steps, 0))
    for step in range(steps):
        if step <= top:
            begin, end, fraction = start, peak, step / max(top, 1e-12)
        else:
            begin, end, fraction = peak, low, (step - top) / max(steps - 1 - top, 1e-12)
        rates[step] = end + (begin - end) / 2 * (1 + np.cos(np.pi * min(fraction, 1.0)))
    return rates


def parse_args(description: str, default_out: str, extra: list[tuple[str, dict]] = ()) -> argparse.Namespace:
    """The examples' command line; ``extra`` adds framework-specific ``(flag, add_argument kwargs)``."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--epochs", type=int, default=8, help="training epochs")
    parser.add_argument("--scenes", type=int, default=12, help="training scenes")
    parser.add_argument("--val-scenes", type=int, default=3, help="validation scenes (never trained on)")
    parser.add_argument("--points", type=int, default=0, help="keep at most this many points per scene (0: all)")
    parser.add_argument("--batch-size", type=int, default=2, help="scenes per training step")
    parser.add_argument("--lr", type=float, default=0.02, help="peak learning rate of the one-cycle schedule")
    parser.add_argument("--out", type=Path, default=Path(default_out),
                        help="folder for the checkpoint and training.png")
    parser.add_argument("--seed", type=int, default=0, help="seed of the scenes and the initial weights")
    for flag, kwargs in extra:
        parser.add_argument(flag, **kwargs)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    return args


def make_scenes(seeds: range, max_points: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Ray-casts one scene per seed; keeps at most ``max_points`` random points of each (0: all)."""
    clouds, labels = [], []
    for seed in seeds:
        scene = lidar_scene(seed, SCENE)
        keep = np.arange(scene.num_points)
        if max_points and scene.num_points > max_points:
            keep = np.sort(np.random.default_rng(seed).choice(scene.num_points, max_points, replace=False))
        clouds.append(scene.points[keep])
        labels.append(scene.labels[keep])
    return clouds, labels


def voxelize(clouds: list[np.ndarray], labels: list[np.ndarray]) -> Batch:
    """One batch: scaled voxel means, indices, voxel labels (majority vote), point labels and ids."""
    batch = sc.voxelize_batch(clouds, VOXEL_SIZE, RANGE, max_num_points_per_voxel=8, max_num_voxels=100_000)
    means = sc.voxel_means(batch)  # [M, 4]: x, y, z, range
    features = (means - FEATURE_OFFSET) / FEATURE_SCALE
    point_ids = np.concatenate(batch.point_voxel_id).astype(np.int64)
    point_labels = np.concatenate(labels).astype(np.int64)
    valid = point_ids >= 0
    votes = np.zeros((batch.num_voxels, NUM_CLASSES), np.int64)
    np.add.at(votes, (point_ids[valid], point_labels[valid]), 1)
    return Batch(np.ascontiguousarray(features, dtype=np.float32), np.ascontiguousarray(batch.indices, np.int32),
                 votes.argmax(axis=1), point_ids, point_labels, int(batch.batch_size), tuple(batch.grid_size))


def make_batches(seeds: range, batch_size: int, max_points: int) -> list[Batch]:
    """The scenes of ``seeds`` (see `make_scenes`), voxelized ``batch_size`` at a time."""
    clouds, labels = make_scenes(seeds, max_points)
    return [voxelize(clouds[i:i + batch_size], labels[i:i + batch_size]) for i in range(0, len(clouds), batch_size)]


def load_data(args: argparse.Namespace) -> tuple[list[Batch], list[Batch]]:
    """Training and validation batches (validation scenes are seeds 1000+, never trained on)."""
    train = make_batches(range(args.seed, args.seed + args.scenes), args.batch_size, args.points)
    val = make_batches(range(1000 + args.seed, 1000 + args.seed + args.val_scenes), args.batch_size, args.points)
    points = sum(b.point_labels.shape[0] for b in train)
    voxels = sum(b.features.shape[0] for b in train)
    print(f"{args.scenes} training scenes, {points:,} points, {voxels:,} voxels")
    return train, val


def class_weights(batches: list[Batch]) -> np.ndarray:
    """float32 ``[NUM_CLASSES]``: inverse square root of each class's voxel frequency, mean 1."""
    counts = np.bincount(np.concatenate([b.voxel_labels for b in batches]), minlength=NUM_CLASSES)
    weights = np.sqrt(counts.sum() / np.maximum(counts, 1))
    return (weights / weights.mean()).astype(np.float32)


def epoch_orders(seed: int, epochs: int, batches: int) -> list[list[int]]:
    """The batch order of every epoch (a seeded permutation each)."""
    rng = np.random.default_rng(seed)
    return [rng.permutation(batches).tolist() for _ in range(epochs)]


def confusion(point_labels: np.ndarray, predicted: np.ndarray) -> np.ndarray:
    """int64 ``[NUM_CLASSES, NUM_CLASSES]``: rows true class, columns predicted class."""
    codes = np.asarray(point_labels, np.int64) * NUM_CLASSES + np.asarray(predicted, np.int64)
    return np.bincount(codes, minlength=NUM_CLASSES ** 2).reshape(NUM_CLASSES, NUM_CLASSES)


def mean_iou(matrix: np.ndarray) -> tuple[float, list[float]]:
    """``(mIoU, per-class IoU)`` of a confusion matrix."""
    hits = np.diag(matrix).astype(np.float64)
    union = matrix.sum(0) + matrix.sum(1) - np.diag(matrix)
    iou = hits / np.maximum(union, 1)
    return float(iou.mean()), iou.tolist()


def report_epoch(epoch: int, losses: list[float], steps: int, miou: float, ious: list[float]) -> None:
    per_class = ", ".join(f"{name} {iou:.2f}" for name, iou in zip(CLASS_NAMES, ious))
    print(f"epoch {epoch}: loss {np.mean(losses[-steps:]):.3f}, val mIoU {miou:.3f} ({per_class})", flush=True)


def plot_curves(losses: list[float], mious: list[float], path: Path, framework: str) -> None:
    """Writes the training loss per step and the validation mIoU per epoch to ``path`` (PNG), titled with
    the ``framework`` that trained (``"sparsecore.torch"`` or ``"sparsecore.jax"``)."""
    import matplotlib

    matplotlib.use("Agg")  # write PNGs, no display needed
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.plot(losses)
    left.set(xlabel="step", ylabel="training loss", title="loss")
    right.plot(range(1, len(mious) + 1), mious, marker="o")
    right.axhline(1 / NUM_CLASSES, color="grey", linestyle="--", label="1 / classes")
    right.set(xlabel="epoch", ylabel="validation mIoU", title="mIoU", ylim=(0, 1))
    right.legend()
    figure.suptitle(f"sparse U-Net segmentation trained with {framework}")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def finish(checkpoint: Path, losses: list[float], mious: list[float], out: Path, start: float, framework: str) -> None:
    """The end of a training run, once the reloaded checkpoint computed the same outputs: the plot (titled with
    ``framework``) and the final line (``start``: the run's ``time.perf_counter()`` at its beginning)."""
    import time

    print(f"checkpoint {checkpoint} reloaded: same outputs")
    plot_curves(losses, mious, out / "training.png", framework)
    print(f"final val mIoU {mious[-1]:.3f}; plot {out / 'training.png'}; "
          f"{time.perf_counter() - start:.0f} s in all")
