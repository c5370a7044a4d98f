"""Quantize a sparse U-Net for LiDAR segmentation to int8: PTQ and QAT with spconv's fx workflow.

The network is the MinkUNet-style U-Net of ``train_segmentation_torch.py``,
written the way spconv's INT8 guide calls *fusable*: every conv -> BatchNorm ->
ReLU is a `SparseSequential`, residual blocks and decoder skips end in
``SparseReLU(out + identity)`` on SparseConvTensors (skips are added, not
concatenated), and the head is a 1x1 `SubMConv3d`. The data are the same
synthetic 64-beam scans (``sparsecore.scene``: ground, car, other), read with
the recipe's constants from ``_segmentation_common.py``; the training step and
the point mIoU are ``train_segmentation_torch.py``'s. The script

1. trains the float model (AdamW, one-cycle learning rate) and reports its
   validation mIoU over points;
2. PTQ: ``prepare_fx`` with sparsecore's qconfig mapping / backend config,
   calibration on 20 scenes never trained on, ``convert_fx``, ``transform_qdq``,
   ``remove_conv_add_dq``; reports the int8 mIoU and the relative error of the
   logits against the float model;
3. QAT: ``prepare_qat_fx`` from the float weights, a few epochs of fine-tuning
   with fake quantization, conversion; reports its int8 mIoU;
4. times the float32 and the int8 forward on the CPU on the real scan
   (``data/lidar_voxels_125k.npz``, 125,562 voxels);
5. saves the int8 model (``torch.save`` of the GraphModule), reloads it and
   checks it computes the same logits.

Only the import lines differ from spconv's guide: ``import
sparsecore.torch.quantization as spconvq``. The int8 layers run int8 x int8
products with exact int32 sums over the rulebooks (``sparsecore.int8``).

Run ``python examples/quantize_int8.py`` (a few minutes on 2 CPU cores), or a
quick check with ``--epochs 1 --qat-epochs 1 --scenes 2 --calib-scenes 2
--val-scenes 1 --points 3000 --timing-voxels 20000``.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import time
import warnings
from pathlib import Path
from typing import Iterator

import numpy as np
import torch
import torch.ao.quantization as tq
import torch.ao.quantization.quantize_fx as qfx
from torch import nn

import sparsecore.torch as spconv
import sparsecore.torch.quantization as spconvq
from sparsecore.benchmark.scenes import require_data_file
from _segmentation_common import (FEATURE_OFFSET, FEATURE_SCALE, NUM_CLASSES, WARMUP_FRACTION, WEIGHT_DECAY, Batch,
                                  class_weights, make_batches, mean_iou)
from train_segmentation_torch import as_sparse, point_confusion, train_step


# ----------------------------------------------------------------------------- data


def real_scan_tensor(max_voxels: int) -> spconv.SparseConvTensor:
    """The real scan (``data/lidar_voxels_125k.npz``) with the network's 4 features (x, y, z, range)."""
    data = np.load(require_data_file(None, "lidar_voxels_125k.npz"))
    indices, xyz = data["indices"], data["features"]
    if max_voxels and indices.shape[0] > max_voxels:
        indices, xyz = indices[:max_voxels], xyz[:max_voxels]
    means = np.concatenate([xyz, np.linalg.norm(xyz, axis=1, keepdims=True)], axis=1)
    features = ((means - FEATURE_OFFSET) / FEATURE_SCALE).astype(np.float32)
    return spconv.SparseConvTensor(torch.from_numpy(features), torch.from_numpy(np.ascontiguousarray(indices)),
                                   [int(s) for s in data["spatial_shape"]], 1)


# ----------------------------------------------------------------------------- model (fusable)


def conv_bn(conv: nn.Module, channels: int) -> spconv.SparseSequential:
    return spconv.SparseSequential(conv=conv, bn=nn.BatchNorm1d(channels, momentum=0.1))


def conv_bn_relu(conv: nn.Module, channels: int) -> spconv.SparseSequential:
    return spconv.SparseSequential(conv=conv, bn=nn.BatchNorm1d(channels, momentum=0.1), relu=nn.ReLU())


class ResidualBlock(spconv.SparseModule):
    """relu(bn(conv(relu(bn(conv(x))))) + x), written as spconv's INT8 guide asks (fuses to two int8 layers)."""

    def __init__(self, channels: int, key: str) -> None:
        super().__init__()
        self.conv1_bn_relu = conv_bn_relu(spconv.SubMConv3d(channels, channels, 3, padding=1, bias=False,
                                                            indice_key=key), channels)
        self.conv2_bn = conv_bn(spconv.SubMConv3d(channels, channels, 3, padding=1, bias=False, indice_key=key),
                                channels)
        self.relu = spconv.SparseReLU()
        self.identity = spconv.SparseIdentity()

    def forward(self, x):
        identity = self.identity(x)
        return self.relu(self.conv2_bn(self.conv1_bn_relu(x)) + identity)


class UpAdd(spconv.SparseModule):
    """relu(bn(inverse_conv(x)) + skip): the decoder step, fused into one int8 conv-add-relu."""

    def __init__(self, in_channels: int, out_channels: int, key: str) -> None:
        super().__init__()
        self.conv_bn = conv_bn(spconv.SparseInverseConv3d(in_channels, out_channels, 3, bias=False, indice_key=key),
                               out_channels)
        self.relu = spconv.SparseReLU()

    def forward(self, x, skip):
        return self.relu(self.conv_bn(x) + skip)


class FusableUNet(nn.Module):
    """Encoder 16 -> 32 -> 64 channels at strides 1, 2, 4; decoder back up, skips added; 1x1 head."""

    def __init__(self, in_channels: int = 4, num_classes: int = NUM_CLASSES, width: int = 16) -> None:
        super().__init__()
        c1, c2, c3 = width, 2 * width, 4 * width
        self.stem = conv_bn_relu(spconv.SubMConv3d(in_channels, c1, 3, padding=1, bias=False, indice_key="s1"), c1)
        self.enc1 = ResidualBlock(c1, "s1")
        self.down1 = conv_bn_relu(spconv.SparseConv3d(c1, c2, 3, 2, 1, bias=False, indice_key="down1"), c2)
        self.enc2 = ResidualBlock(c2, "s2")
        self.down2 = conv_bn_relu(spconv.SparseConv3d(c2, c3, 3, 2, 1, bias=False, indice_key="down2"), c3)
        self.enc3 = ResidualBlock(c3, "s3")
        self.up2 = UpAdd(c3, c2, "down2")
        self.dec2 = ResidualBlock(c2, "s2")
        self.up1 = UpAdd(c2, c1, "down1")
        self.dec1 = ResidualBlock(c1, "s1")
        self.head = spconv.SubMConv3d(c1, num_classes, 1, indice_key="head")

    def forward(self, x):
        skip1 = self.enc1(self.stem(x))
        skip2 = self.enc2(self.down1(skip1))
        y = self.dec2(self.up2(self.enc3(self.down2(skip2)), skip2))
        y = self.dec1(self.up1(y, skip1))
        return self.head(y).features  # logits [num_voxels, num_classes]


# ----------------------------------------------------------------------------- training and evaluation


@torch.no_grad()
def evaluate(model: nn.Module, batches: list[Batch]) -> float:
    """Validation mIoU over points (each point takes its voxel's class)."""
    return mean_iou(point_confusion(model, batches))[0]


def train(model: nn.Module, batches: list[Batch], epochs: int, lr: float, seed: int, label: str) -> None:
    criterion = nn.CrossEntropyLoss(weight=torch.from_numpy(class_weights(batches)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=WEIGHT_DECAY)
    steps = max(1, epochs * len(batches))
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, lr, total_steps=steps, pct_start=WARMUP_FRACTION,
                                                    cycle_momentum=False)
    rng = np.random.default_rng(seed)
    model.train()
    for epoch in range(1, epochs + 1):
        losses = []
        for index in rng.permutation(len(batches)):
            losses.append(train_step(model, batches[index], criterion, optimizer, scheduler))
        print(f"{label} epoch {epoch}/{epochs}: loss {np.mean(losses):.3f}", flush=True)


@contextlib.contextmanager
def torch_ao_calls() -> Iterator[None]:
    """Around this script's own calls of torch.ao's fx workflow (prepare_fx, prepare_qat_fx, convert_fx): torch
    2.13 marks that API deprecated on every call, and spconv's workflow is built on it (docs/quantization.md says
    what runs the int8 forward). That one notice is ignored inside the block, nothing else and nowhere else."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"torch\.ao\.quantization is deprecated", category=DeprecationWarning)
        yield


def convert(prepared: nn.Module, mapping, backend) -> torch.fx.GraphModule:
    """The guide's conversion: lowering registration, convert_fx, transform_qdq, remove_conv_add_dq."""
    spconvq.prepare_spconv_torch_inference(False)
    with torch_ao_calls():
        converted = qfx.convert_fx(prepared, qconfig_mapping=mapping, backend_config=backend)
    converted = spconvq.transform_qdq(converted)
    return spconvq.remove_conv_add_dq(converted)


@torch.no_grad()
def relative_error(model: nn.Module, reference: nn.Module, batches: list[Batch]) -> float:
    """Mean over batches of ||model - reference|| / ||reference|| on the logits."""
    errors = [float((model(as_sparse(b)) - reference(as_sparse(b))).norm() / reference(as_sparse(b)).norm())
              for b in batches]
    return float(np.mean(errors))


@torch.no_grad()
def median_time(model: nn.Module, x: spconv.SparseConvTensor, repeats: int) -> float:
    model(x)  # warm-up (kernel caches, allocations)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        model(x)
        times.append(time.perf_counter() - start)
    return float(np.median(times))


# ----------------------------------------------------------------------------- main


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--epochs", type=int, default=8, help="float training epochs")
    parser.add_argument("--qat-epochs", type=int, default=2, help="QAT fine-tuning epochs")
    parser.add_argument("--scenes", type=int, default=12, help="training scenes")
    parser.add_argument("--calib-scenes", type=int, default=20, help="PTQ calibration scenes (never trained on)")
    parser.add_argument("--val-scenes", type=int, default=3, help="validation scenes")
    parser.add_argument("--points", type=int, default=0, help="keep at most this many points per scene (0: all)")
    parser.add_argument("--batch-size", type=int, default=2, help="scenes per training step")
    parser.add_argument("--lr", type=float, default=0.02, help="peak learning rate of the float training")
    parser.add_argument("--qat-lr", type=float, default=1e-3, help="peak learning rate of QAT")
    parser.add_argument("--timing-voxels", type=int, default=0, help="voxels of the real scan to time (0: all)")
    parser.add_argument("--timing-repeats", type=int, default=3, help="timed forwards per model (median)")
    parser.add_argument("--threads", type=int, default=2, help="torch and sparsecore CPU threads")
    parser.add_argument("--seed", type=int, default=0, help="seed of the scenes and the initial weights")
    parser.add_argument("--out", type=Path, default=Path("runs/quantize_int8"), help="folder for unet_int8.pt")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    return args


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    start = time.perf_counter()
    train_batches = make_batches(range(args.seed, args.seed + args.scenes), args.batch_size, args.points)
    calib_batches = make_batches(range(2000 + args.seed, 2000 + args.seed + args.calib_scenes), args.batch_size,
                                 args.points)
    val_batches = make_batches(range(1000 + args.seed, 1000 + args.seed + args.val_scenes), args.batch_size,
                               args.points)

    # 1. float model
    model = FusableUNet()
    train(model, train_batches, args.epochs, args.lr, args.seed, "float")
    model.eval()
    float_miou = evaluate(model, val_batches)
    print(f"float32 val mIoU {float_miou:.3f}", flush=True)

    # 2. PTQ (the guide's sequence)
    is_qat = False
    qconfig_mapping = spconvq.get_default_spconv_qconfig_mapping(is_qat)
    prepare_cfg = spconvq.get_spconv_prepare_custom_config()
    backend_cfg = spconvq.get_spconv_backend_config()
    with torch_ao_calls():
        prepared = qfx.prepare_fx(copy.deepcopy(model), qconfig_mapping, (), backend_config=backend_cfg,
                                  prepare_custom_config=prepare_cfg)
    with torch.no_grad():
        for batch in calib_batches:
            prepared(as_sparse(batch))
    ptq_model = convert(prepared, qconfig_mapping, backend_cfg)
    ptq_miou = evaluate(ptq_model, val_batches)
    ptq_error = relative_error(ptq_model, model, val_batches)
    layers = spconvq.tensorrt_parameters(ptq_model)
    print(f"PTQ int8 val mIoU {ptq_miou:.3f} ({len(layers)} int8 conv layers, calibrated on "
          f"{args.calib_scenes} scenes); logits relative error vs float {ptq_error:.4f}", flush=True)

    # 3. QAT (the guide's sequence), starting from the float weights
    is_qat = True
    qat_mapping = spconvq.get_default_spconv_qconfig_mapping(is_qat)
    qat_model = copy.deepcopy(model).train()
    with torch_ao_calls():
        prepared_qat = qfx.prepare_qat_fx(qat_model, qat_mapping, (), backend_config=backend_cfg,
                                          prepare_custom_config=spconvq.get_spconv_prepare_custom_config())
    train(prepared_qat, train_batches, args.qat_epochs, args.qat_lr, args.seed + 1, "QAT")
    prepared_qat.apply(tq.disable_observer)
    prepared_qat.eval()
    qat_int8 = convert(prepared_qat, qat_mapping, backend_cfg)
    qat_miou = evaluate(qat_int8, val_batches)
    print(f"QAT int8 val mIoU {qat_miou:.3f}", flush=True)

    # 4. CPU time on the real scan
    scan = real_scan_tensor(args.timing_voxels)
    float_time = median_time(model, scan, args.timing_repeats)
    int8_time = median_time(qat_int8, scan, args.timing_repeats)
    print(f"forward on the real scan ({scan.features.shape[0]:,} voxels, {args.threads} threads): float32 "
          f"{float_time * 1e3:.0f} ms, int8 {int8_time * 1e3:.0f} ms (int8 / float32 = {int8_time / float_time:.2f})")

    # 5. save, reload, compare
    path = args.out / "unet_int8.pt"
    torch.save(qat_int8, path)
    reloaded = torch.load(path, weights_only=False)
    with torch.no_grad():
        same = torch.equal(reloaded(as_sparse(val_batches[0])), qat_int8(as_sparse(val_batches[0])))
    if not same:
        raise RuntimeError("the reloaded int8 model computes different logits")
    print(f"saved the int8 model to {path}; reloaded: same logits")
    print(f"summary: mIoU float32 {float_miou:.3f}, PTQ int8 {ptq_miou:.3f}, QAT int8 {qat_miou:.3f}; "
          f"{time.perf_counter() - start:.0f} s in all")


if __name__ == "__main__":
    main()
