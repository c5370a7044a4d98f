"""Train a MinkUNet-style sparse U-Net for LiDAR semantic segmentation with sparsecore.torch.

The data are synthetic 64-beam scans (``sparsecore.scene``): every point is
labelled ground (0), car (1) or other (2: poles and walls). Each scene is its
own seed, so training and validation scenes differ. The script:

1. ray-casts the scenes and voxelizes them once (``sparsecore.voxelize_batch``),
2. trains the network (SubMConv3d residual blocks, strided SparseConv3d down,
   SparseInverseConv3d up with indice_keys, skip concatenation, BatchNorm,
   ReLU) with a tqdm progress bar,
3. reports the validation mIoU over points after every epoch,
4. saves a checkpoint, reloads it into a fresh model and checks that it gives
   the same outputs,
5. writes ``training.png`` (loss and mIoU curves) to ``--out``.

Run ``python examples/train_segmentation_torch.py`` (about a minute and a half
on 2 CPU cores), or a quick check with ``--epochs 1 --scenes 2 --points 3000``.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # write PNGs, no display needed
import matplotlib.pyplot as plt
import numpy as np
import torch
from torch import nn
from tqdm import tqdm

import sparsecore as sc
import sparsecore.torch as spconv
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
    """One batch: voxel features, indices (batch first), voxel labels, point labels and point ids."""
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
        "features": torch.from_numpy(np.ascontiguousarray(features, dtype=np.float32)),
        "indices": torch.from_numpy(batch.indices),
        "voxel_labels": torch.from_numpy(votes.argmax(axis=1)),
        "point_ids": torch.from_numpy(point_ids),
        "point_labels": torch.from_numpy(point_labels),
        "batch_size": batch.batch_size,
        "grid_size": list(batch.grid_size),
    }


def as_sparse(batch):
    return spconv.SparseConvTensor(batch["features"], batch["indices"], batch["grid_size"], batch["batch_size"])


# ----------------------------------------------------------------------------- model


class ResidualBlock(nn.Module):
    """Two 3x3x3 submanifold convs with BatchNorm and ReLU, plus the input (MinkUNet's basic block)."""

    def __init__(self, channels, key):
        super().__init__()
        self.conv1 = spconv.SubMConv3d(channels, channels, 3, padding=1, bias=False, indice_key=key)
        self.bn1 = nn.BatchNorm1d(channels)
        self.conv2 = spconv.SubMConv3d(channels, channels, 3, padding=1, bias=False, indice_key=key)
        self.bn2 = nn.BatchNorm1d(channels)

    def forward(self, x):
        y = self.conv1(x)
        y = y.replace_feature(torch.relu(self.bn1(y.features)))
        y = self.conv2(y)
        return y.replace_feature(torch.relu(self.bn2(y.features) + x.features))


def conv_bn_relu(conv, channels):
    return spconv.SparseSequential(conv, nn.BatchNorm1d(channels), nn.ReLU())


class MinkUNet(nn.Module):
    """Encoder 16 -> 32 -> 64 channels at strides 1, 2, 4; decoder back up with skip concatenation."""

    def __init__(self, in_channels, num_classes, width=16):
        super().__init__()
        c1, c2, c3 = width, 2 * width, 4 * width
        self.stem = conv_bn_relu(spconv.SubMConv3d(in_channels, c1, 3, padding=1, bias=False, indice_key="s1"), c1)
        self.enc1 = ResidualBlock(c1, "s1")
        self.down1 = conv_bn_relu(spconv.SparseConv3d(c1, c2, 3, stride=2, padding=1, bias=False,
                                                      indice_key="down1"), c2)
        self.enc2 = ResidualBlock(c2, "s2")
        self.down2 = conv_bn_relu(spconv.SparseConv3d(c2, c3, 3, stride=2, padding=1, bias=False,
                                                      indice_key="down2"), c3)
        self.enc3 = ResidualBlock(c3, "s3")
        # SparseInverseConv3d with the down layer's key restores that layer's input sites, in order.
        self.up2 = conv_bn_relu(spconv.SparseInverseConv3d(c3, c2, 3, bias=False, indice_key="down2"), c2)
        self.dec2 = conv_bn_relu(spconv.SubMConv3d(2 * c2, c2, 3, padding=1, bias=False, indice_key="s2"), c2)
        self.up1 = conv_bn_relu(spconv.SparseInverseConv3d(c2, c1, 3, bias=False, indice_key="down1"), c1)
        self.dec1 = conv_bn_relu(spconv.SubMConv3d(2 * c1, c1, 3, padding=1, bias=False, indice_key="s1"), c1)
        self.head = nn.Linear(c1, num_classes)

    def forward(self, x):
        skip1 = self.enc1(self.stem(x))
        skip2 = self.enc2(self.down1(skip1))
        y = self.up2(self.enc3(self.down2(skip2)))
        y = self.dec2(y.replace_feature(torch.cat([y.features, skip2.features], dim=1)))
        y = self.up1(y)
        y = self.dec1(y.replace_feature(torch.cat([y.features, skip1.features], dim=1)))
        return self.head(y.features)  # [num_voxels, num_classes]


# ----------------------------------------------------------------------------- evaluation


def point_predictions(model, batch):
    """Class of every point: the voxel's prediction handed back through point_voxel_id."""
    logits = model(as_sparse(batch))
    per_point = spconv.utils.gather_features_by_pc_voxel_id(logits, batch["point_ids"])
    return per_point.argmax(dim=1)


@torch.no_grad()
def mean_iou(model, batches):
    """mIoU over all points of the batches (points outside the grid count as class 0 predictions)."""
    model.eval()
    confusion = torch.zeros(NUM_CLASSES, NUM_CLASSES, dtype=torch.int64)
    for batch in batches:
        predicted = point_predictions(model, batch)
        confusion += torch.bincount(batch["point_labels"] * NUM_CLASSES + predicted,
                                    minlength=NUM_CLASSES ** 2).view(NUM_CLASSES, NUM_CLASSES)
    model.train()
    hits = confusion.diag().double()
    union = confusion.sum(0) + confusion.sum(1) - confusion.diag()
    iou = hits / union.clamp(min=1).double()
    return float(iou.mean()), iou.tolist()


# ----------------------------------------------------------------------------- main


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--scenes", type=int, default=12, help="training scenes")
    parser.add_argument("--val-scenes", type=int, default=3)
    parser.add_argument("--points", type=int, default=0, help="keep at most this many points per scene (0: all)")
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--lr", type=float, default=0.02)
    parser.add_argument("--out", type=Path, default=Path("runs/segmentation"))
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
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

    # Rare classes (poles, walls) weigh more: inverse square root of the voxel frequency.
    counts = torch.bincount(torch.cat([b["voxel_labels"] for b in train]), minlength=NUM_CLASSES).double()
    class_weights = (counts.sum() / counts.clamp(min=1)).sqrt()
    criterion = nn.CrossEntropyLoss(weight=(class_weights / class_weights.mean()).float())

    model = MinkUNet(in_channels=4, num_classes=NUM_CLASSES)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, args.lr, total_steps=args.epochs * len(train))
    losses, mious = [], []
    for epoch in range(1, args.epochs + 1):
        order = torch.randperm(len(train)).tolist()
        progress = tqdm(order, desc=f"epoch {epoch}/{args.epochs}", leave=False)
        for index in progress:
            batch = train[index]
            loss = criterion(model(as_sparse(batch)), batch["voxel_labels"])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            scheduler.step()
            losses.append(loss.item())
            progress.set_postfix(loss=f"{loss.item():.3f}")
        miou, ious = mean_iou(model, val)
        mious.append(miou)
        per_class = ", ".join(f"{name} {iou:.2f}" for name, iou in zip(CLASS_NAMES, ious))
        print(f"epoch {epoch}: loss {np.mean(losses[-len(train):]):.3f}, val mIoU {miou:.3f} ({per_class})")

    # Save, reload into a fresh model, and check that it computes the same thing.
    checkpoint = args.out / "checkpoint.pt"
    torch.save({"model": model.state_dict(), "epochs": args.epochs, "miou": mious[-1]}, checkpoint)
    reloaded = MinkUNet(in_channels=4, num_classes=NUM_CLASSES)
    reloaded.load_state_dict(torch.load(checkpoint)["model"])
    model.eval()
    reloaded.eval()
    with torch.no_grad():
        assert torch.equal(model(as_sparse(val[0])), reloaded(as_sparse(val[0]))), "reloaded model differs"
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
