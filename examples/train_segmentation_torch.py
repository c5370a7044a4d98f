"""Train a MinkUNet-style sparse U-Net for LiDAR semantic segmentation with sparsecore.torch.

The data are synthetic 64-beam scans (``sparsecore.scene``): every point is
labelled ground (0), car (1) or other (2: poles and walls). Each scene is its
own seed, so training and validation scenes differ. The script:

1. ray-casts the scenes and voxelizes them once (``sparsecore.voxelize_batch``),
2. trains the network (SubMConv3d residual blocks, strided SparseConv3d down,
   SparseInverseConv3d up with indice_keys, skip concatenation, BatchNorm,
   ReLU) with AdamW and a one-cycle learning rate, with a tqdm progress bar,
3. reports the validation mIoU over points after every epoch,
4. saves a checkpoint, reloads it into a fresh model and checks that it gives
   the same outputs,
5. writes ``training.png`` (loss and mIoU curves) to ``--out``.

``train_segmentation_jax.py`` is its JAX twin: the same data, network and
recipe (``_segmentation_common.py`` holds what they share), and the same mIoU
to within a few hundredths (docs/jax.md lists the two).

Run ``python examples/train_segmentation_torch.py`` (about two minutes on
2 CPU cores), or a quick check with ``--epochs 1 --scenes 2 --points 3000``.
"""

from __future__ import annotations

import time

import numpy as np
import torch
from torch import nn
from tqdm import tqdm

import sparsecore.torch as spconv
from _segmentation_common import (BN_EPS, BN_MOMENTUM, IN_CHANNELS, NUM_CLASSES, WEIGHT_DECAY, class_weights,
                                  confusion, epoch_orders, finish, initial_weights, learning_rates, load_data,
                                  mean_iou, parse_args, report_epoch)


def as_sparse(batch):
    return spconv.SparseConvTensor(torch.from_numpy(batch.features), torch.from_numpy(batch.indices),
                                   list(batch.grid_size), batch.batch_size)


def batch_norm(channels):
    return nn.BatchNorm1d(channels, eps=BN_EPS, momentum=BN_MOMENTUM)


# ----------------------------------------------------------------------------- model


class ResidualBlock(nn.Module):
    """Two 3x3x3 submanifold convs with BatchNorm and ReLU, plus the input (MinkUNet's basic block)."""

    def __init__(self, channels, key):
        super().__init__()
        self.conv1 = spconv.SubMConv3d(channels, channels, 3, padding=1, bias=False, indice_key=key)
        self.bn1 = batch_norm(channels)
        self.conv2 = spconv.SubMConv3d(channels, channels, 3, padding=1, bias=False, indice_key=key)
        self.bn2 = batch_norm(channels)

    def forward(self, x):
        y = self.conv1(x)
        y = y.replace_feature(torch.relu(self.bn1(y.features)))
        y = self.conv2(y)
        return y.replace_feature(torch.relu(self.bn2(y.features) + x.features))


def conv_bn_relu(conv, channels):
    return spconv.SparseSequential(conv, batch_norm(channels), nn.ReLU())


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
        self.join = spconv.JoinTable()  # skip concatenation: the channels of tensors on the same sites

    def forward(self, x):
        skip1 = self.enc1(self.stem(x))
        skip2 = self.enc2(self.down1(skip1))
        y = self.up2(self.enc3(self.down2(skip2)))
        y = self.dec2(self.join([y, skip2]))
        y = self.up1(y)
        y = self.dec1(self.join([y, skip1]))
        return self.head(y.features)  # [num_voxels, num_classes]


def load_initial_weights(model, weights):
    """Copies `initial_weights` (shared with the JAX example) into the model's convs and head."""
    state = model.state_dict()
    for name, convs in weights.items():
        if name == "head":
            state["head.weight"] = torch.from_numpy(convs["weight"].T.copy())
            state["head.bias"] = torch.from_numpy(convs["bias"])
        elif "conv" in convs:
            state[f"{name}.0.weight"] = torch.from_numpy(convs["conv"])  # SparseSequential(conv, bn, relu)
        else:
            state[f"{name}.conv1.weight"] = torch.from_numpy(convs["conv1"])
            state[f"{name}.conv2.weight"] = torch.from_numpy(convs["conv2"])
    model.load_state_dict(state)
    return model


# ----------------------------------------------------------------------------- evaluation and training step


@torch.no_grad()
def point_confusion(model, batches):
    """The confusion matrix over all points of ``batches`` (the model in the mode it is in).

    Each point gets its voxel's class (``gather_features_by_pc_voxel_id``); points outside
    the grid get zero logits, so they count as class 0 predictions.
    """
    matrix = 0
    for batch in batches:
        logits = model(as_sparse(batch))
        per_point = spconv.utils.gather_features_by_pc_voxel_id(logits, torch.from_numpy(batch.point_ids))
        matrix = matrix + confusion(batch.point_labels, per_point.argmax(dim=1).numpy())
    return matrix


def evaluate(model, batches):
    """``(mIoU, per-class IoU)`` over all points (BatchNorm on its running statistics)."""
    model.eval()
    matrix = point_confusion(model, batches)
    model.train()
    return mean_iou(matrix)


def train_step(model, batch, criterion, optimizer, scheduler):
    """One optimizer step on one batch (and one scheduler step); returns the loss."""
    loss = criterion(model(as_sparse(batch)), torch.from_numpy(batch.voxel_labels))
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    scheduler.step()
    return loss.item()


# ----------------------------------------------------------------------------- main


def main():
    args = parse_args(__doc__.split("\n")[0], "runs/segmentation",
                      [("--threads", {"type": int, "default": 2, "help": "torch CPU threads"})])
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    start = time.perf_counter()
    train, val = load_data(args)

    criterion = nn.CrossEntropyLoss(weight=torch.from_numpy(class_weights(train)))
    model = load_initial_weights(MinkUNet(in_channels=IN_CHANNELS, num_classes=NUM_CLASSES),
                                 initial_weights(args.seed))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=WEIGHT_DECAY)
    rates = learning_rates(args.epochs * len(train), args.lr)  # one-cycle, the same numbers as the JAX example
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: rates[min(step, len(rates) - 1)] / args.lr)
    losses, mious = [], []
    for epoch, order in enumerate(epoch_orders(args.seed, args.epochs, len(train)), start=1):
        progress = tqdm(order, desc=f"epoch {epoch}/{args.epochs}", leave=False)
        for index in progress:
            losses.append(train_step(model, train[index], criterion, optimizer, scheduler))
            progress.set_postfix(loss=f"{losses[-1]:.3f}")
        miou, ious = evaluate(model, val)
        mious.append(miou)
        report_epoch(epoch, losses, len(train), miou, ious)

    # Save, reload into a fresh model, and check that it computes the same thing.
    checkpoint = args.out / "checkpoint.pt"
    torch.save({"model": model.state_dict(), "epochs": args.epochs, "miou": mious[-1]}, checkpoint)
    reloaded = MinkUNet(in_channels=IN_CHANNELS, num_classes=NUM_CLASSES)
    reloaded.load_state_dict(torch.load(checkpoint)["model"])
    model.eval()
    reloaded.eval()
    with torch.no_grad():
        assert torch.equal(model(as_sparse(val[0])), reloaded(as_sparse(val[0]))), "reloaded model differs"
    finish(checkpoint, losses, mious, args.out, start, "sparsecore.torch")


if __name__ == "__main__":
    main()
