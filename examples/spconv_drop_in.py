"""Run a model written for spconv 2.x under sparsecore by changing one import.

The backbone below is the sparse 3D part of a SECOND / PointPillars-era
detector (8x downsampling, SubMConv3d + BatchNorm1d + ReLU blocks, strided
SparseConv3d with indice_keys, then ``.dense()`` into a bird's-eye-view map),
written the way spconv users write it. Its code only refers to the module it
is given as ``spconv``; in your own code that is simply::

    import sparsecore.torch as spconv     # was: import spconv.pytorch as spconv

The script runs the backbone on a voxelized synthetic KITTI-like scan with
sparsecore, forward and backward. When real spconv is installed it also
builds the same backbone with spconv, loads sparsecore's state_dict into it
and compares the outputs (spconv's CPU build is run single-threaded: it races
with more threads); then it goes the other way with a segmentation head of
1x1 layers (a SubMConv3d 1x1 projection sharing a 3x3 layer's indice_key, a
1x1 classifier): built with spconv, its state_dict loads unchanged into
sparsecore.torch and gives spconv's outputs (1x1 layers read the stored weight
as spconv does, ``weight.view(in, out)``).

Run ``python examples/spconv_drop_in.py``; ``--no-spconv`` skips the comparison.
"""

from __future__ import annotations

import argparse
import sys
import time
from functools import partial

import numpy as np

try:
    import torch
    from torch import nn
except ModuleNotFoundError as missing:
    if missing.name != "torch":
        raise
    raise SystemExit("error: examples/spconv_drop_in.py runs a spconv model under sparsecore.torch and needs PyTorch, "
                     "which is not installed here: pip install 'sparsecore-conv[torch]' (or see https://pytorch.org "
                     "for a CUDA build); examples/voxelize_numpy.py runs on the core alone") from None

import sparsecore as sc
import sparsecore.torch
from sparsecore.scene import lidar_scene

VOXEL_SIZE = (0.05, 0.05, 0.1)  # KITTI-style grid: x, y, z in metres
RANGE = (0.0, -40.0, -3.0, 70.4, 40.0, 1.0)


# ----------------------------------------------------------------------------- the spconv model


def post_act_block(spconv, in_channels, out_channels, kernel_size, indice_key, stride=1, padding=0,
                   conv_type="subm", norm_fn=None):
    if conv_type == "subm":
        conv = spconv.SubMConv3d(in_channels, out_channels, kernel_size, bias=False, indice_key=indice_key)
    else:
        conv = spconv.SparseConv3d(in_channels, out_channels, kernel_size, stride=stride, padding=padding,
                                   bias=False, indice_key=indice_key)
    return spconv.SparseSequential(conv, norm_fn(out_channels), nn.ReLU())


class VoxelBackBone8x(nn.Module):
    def __init__(self, spconv, input_channels, grid_size):
        super().__init__()
        norm_fn = partial(nn.BatchNorm1d, eps=1e-3, momentum=0.01)
        self.sparse_shape = grid_size[::-1] + np.array([1, 0, 0])  # zyx, one extra z cell
        self.spconv = spconv
        self.conv_input = spconv.SparseSequential(
            spconv.SubMConv3d(input_channels, 16, 3, padding=1, bias=False, indice_key="subm1"),
            norm_fn(16), nn.ReLU())
        block = partial(post_act_block, spconv)
        self.conv1 = spconv.SparseSequential(block(16, 16, 3, norm_fn=norm_fn, padding=1, indice_key="subm1"))
        self.conv2 = spconv.SparseSequential(
            block(16, 32, 3, norm_fn=norm_fn, stride=2, padding=1, indice_key="spconv2", conv_type="spconv"),
            block(32, 32, 3, norm_fn=norm_fn, padding=1, indice_key="subm2"),
            block(32, 32, 3, norm_fn=norm_fn, padding=1, indice_key="subm2"))
        self.conv3 = spconv.SparseSequential(
            block(32, 64, 3, norm_fn=norm_fn, stride=2, padding=1, indice_key="spconv3", conv_type="spconv"),
            block(64, 64, 3, norm_fn=norm_fn, padding=1, indice_key="subm3"),
            block(64, 64, 3, norm_fn=norm_fn, padding=1, indice_key="subm3"))
        self.conv4 = spconv.SparseSequential(
            block(64, 64, 3, norm_fn=norm_fn, stride=2, padding=(0, 1, 1), indice_key="spconv4",
                  conv_type="spconv"),
            block(64, 64, 3, norm_fn=norm_fn, padding=1, indice_key="subm4"),
            block(64, 64, 3, norm_fn=norm_fn, padding=1, indice_key="subm4"))
        self.conv_out = spconv.SparseSequential(
            spconv.SparseConv3d(64, 128, (3, 1, 1), stride=(2, 1, 1), padding=0, bias=False,
                                indice_key="spconv_down2"),
            norm_fn(128), nn.ReLU())

    def forward(self, voxel_features, voxel_coords, batch_size):
        x = self.spconv.SparseConvTensor(features=voxel_features, indices=voxel_coords.int(),
                                         spatial_shape=self.sparse_shape, batch_size=batch_size)
        x = self.conv_input(x)
        x = self.conv4(self.conv3(self.conv2(self.conv1(x))))
        out = self.conv_out(x)
        spatial = out.dense()  # [B, C, D, H, W]
        n, c, d, h, w = spatial.shape
        return spatial.view(n, c * d, h, w)  # bird's-eye-view features for a 2D detection head


class PointHead(nn.Module):
    """A per-voxel segmentation head with 1x1 layers, as SpUNet-style networks have."""

    def __init__(self, spconv, input_channels, classes=5):
        super().__init__()
        self.stem = spconv.SparseSequential(
            spconv.SubMConv3d(input_channels, 16, 3, bias=False, indice_key="head"), nn.BatchNorm1d(16), nn.ReLU())
        self.project = spconv.SparseSequential(  # spconv's 1x1 shortcut ignores the shared key
            spconv.SubMConv3d(16, 24, 1, bias=False, indice_key="head"), nn.BatchNorm1d(24), nn.ReLU())
        self.classify = spconv.SubMConv3d(24, classes, 1, bias=True)

    def forward(self, x):
        return self.classify(self.project(self.stem(x)))


def spconv_checkpoint_loads_unchanged(real_spconv, features, coords, grid_size, batch_size):
    """An spconv 1x1 head's state_dict loaded into sparsecore.torch: (max |difference|, max |value|)."""
    shape = list(grid_size[::-1] + np.array([1, 0, 0]))
    trained = PointHead(real_spconv, features.shape[1])  # spconv's own initialisation: a stand-in checkpoint
    mine = PointHead(sparsecore.torch, features.shape[1])
    mine.load_state_dict(trained.state_dict(), strict=True)  # no conversion step
    trained.train(), mine.train()  # batch statistics (spconv's CPU build refuses a bias in eval mode)
    with torch.no_grad():
        expected = trained(real_spconv.SparseConvTensor(features, coords, shape, batch_size))
        got = mine(sparsecore.torch.SparseConvTensor(features, coords, shape, batch_size))
    assert torch.equal(got.indices, expected.indices), "submanifold layers keep the input sites"
    return float((got.features - expected.features).abs().max()), float(expected.features.abs().max())


# ----------------------------------------------------------------------------- running it


def make_inputs(num_clouds, seed):
    """Voxelized synthetic scans (mean point per voxel) as torch tensors, KITTI-style front half."""
    clouds = [lidar_scene(seed + b).points for b in range(num_clouds)]
    batch = sc.voxelize_batch(clouds, VOXEL_SIZE, RANGE, max_num_points_per_voxel=5, max_num_voxels=40_000)
    features = torch.from_numpy(np.asarray(sc.voxel_means(batch)))
    coords = torch.from_numpy(batch.indices)
    return features, coords, np.array(batch.grid_size[::-1])  # grid_size back to xyz, as detectors keep it


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--clouds", type=int, default=2, help="synthetic clouds in the batch")
    parser.add_argument("--seed", type=int, default=0, help="seed of the clouds and the weights")
    parser.add_argument("--no-spconv", action="store_true", help="do not compare with real spconv")
    args = parser.parse_args()
    torch.manual_seed(args.seed)

    features, coords, grid_size = make_inputs(args.clouds, args.seed)
    print(f"{args.clouds} clouds, {len(features):,} voxels, sparse shape (z, y, x) "
          f"{tuple(int(v) for v in grid_size[::-1] + [1, 0, 0])}")

    model = VoxelBackBone8x(sparsecore.torch, features.shape[1], grid_size)
    start = time.perf_counter()
    bev = model(features, coords, args.clouds)
    forward_s = time.perf_counter() - start
    start = time.perf_counter()
    bev.square().mean().backward()
    backward_s = time.perf_counter() - start
    print(f"sparsecore: BEV map {tuple(bev.shape)}, forward {forward_s * 1e3:.0f} ms, "
          f"backward {backward_s * 1e3:.0f} ms")

    if args.no_spconv:
        return
    try:
        import spconv.pytorch as real_spconv
    except ImportError:
        print("spconv is not installed: skipped the comparison (pip install spconv to run it)")
        return
    # The same architecture built with spconv, with sparsecore's weights (the state_dict keys are the same).
    reference = VoxelBackBone8x(real_spconv, features.shape[1], grid_size)
    reference.load_state_dict(model.state_dict())
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # spconv's CPU scatter-add is wrong with more than one thread
    try:
        # Training mode: BatchNorm normalises with the batch statistics, so outputs are of order 1.
        with torch.no_grad():
            expected = reference(features, coords, args.clouds)
            got = model(features, coords, args.clouds)
    finally:
        torch.set_num_threads(threads)
    error = float((got - expected).abs().max())
    scale = float(expected.abs().max())
    version = getattr(sys.modules.get("spconv"), "__version__", "?")
    print(f"spconv {version} vs sparsecore (same state_dict): max |difference| {error:.2e}, "
          f"values up to {scale:.2e}")
    assert scale > 0 and error <= 1e-4 * scale, "outputs differ from spconv's"
    print("same outputs as spconv")

    torch.set_num_threads(1)
    try:
        error, scale = spconv_checkpoint_loads_unchanged(real_spconv, features, coords, grid_size, args.clouds)
    finally:
        torch.set_num_threads(threads)
    print(f"1x1 head built with spconv, its state_dict loaded unchanged: max |difference| {error:.2e}, "
          f"values up to {scale:.2e}")
    assert scale > 0 and error <= 1e-4 * scale, "the spconv checkpoint computes something else"


if __name__ == "__main__":
    main()
