"""Deploy sparse backbones without PyTorch: export to libspconv's ONNX, run with sparsecore.runtime.

Two backbones run on the real LiDAR scan in data/ (125,562 voxels, grid
80 x 1600 x 1600): a SECOND-style one (SubM + strided convs + BatchNorm + ReLU,
``.dense()`` and the BEV reshape) and a residual one (SubM basic blocks with
explicit adds, strided convs, ``.dense()`` and a channels-last permute). Each
is exported with `sparsecore.torch.export_onnx` (BatchNorm folded, ReLU fused,
FP16 weights: the file NVIDIA's libspconv reads), then a child process that
never imports torch loads the files with `sparsecore.runtime`, runs them on
the scan, prints the node table and its time per run; this process compares
the outputs with the torch models'.

    python examples/deploy_onnx.py               # the whole scan
    python examples/deploy_onnx.py --crop 160    # a 160 x 160 cell window around the sensor (fast)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
SCAN = ROOT / "data" / "lidar_voxels_125k.npz"
MODELS = ("second", "residual")


# ----------------------------------------------------------------------------- the runtime side (no torch)


def run_runtime(directory: Path, repeat: int) -> None:
    """Runs every exported file in ``directory`` with sparsecore.runtime; never imports torch."""
    import sparsecore.runtime as runtime

    scan = np.load(directory / "input.npz")
    features, indices = scan["features"], scan["indices"]
    batch_size, spatial_shape = int(scan["batch_size"]), tuple(int(s) for s in scan["spatial_shape"])
    timings = {}
    for name in MODELS:
        session = runtime.load(directory / f"{name}.onnx")
        print(f"\n{name}.onnx, as sparsecore.runtime reads it:\n{session.describe()}")
        output = session.run(features, indices, batch_size, spatial_shape)  # warm-up (and the result)
        times = []
        for _ in range(repeat):
            start = time.perf_counter()
            session.run(features, indices, batch_size, spatial_shape)
            times.append(time.perf_counter() - start)
        np.save(directory / f"{name}.runtime.npy", output.dense)
        timings[name] = float(np.median(times))
    (directory / "timings.json").write_text(json.dumps(timings))
    loaded = sorted(module for module in ("torch", "jax") if module in sys.modules)
    print(f"\nruntime process imported: numpy, onnx, sparsecore; torch/jax: {loaded if loaded else 'none'}")
    if loaded:
        raise SystemExit(f"the runtime process imported {loaded}")


# ----------------------------------------------------------------------------- the torch side


def build_models(in_channels: int):
    """The two backbones, with random BatchNorm statistics so that folding is exercised."""
    import torch
    from torch import nn

    import sparsecore.torch as spconv

    def block(cin, cout, kind, **kwargs):
        layer = {"subm": spconv.SubMConv3d, "conv": spconv.SparseConv3d}[kind]
        return [layer(cin, cout, bias=False, **kwargs), nn.BatchNorm1d(cout, eps=1e-3, momentum=0.01), nn.ReLU()]

    class Second(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = spconv.SparseSequential(
                *block(in_channels, 16, "subm", kernel_size=3, indice_key="subm1"),
                *block(16, 16, "subm", kernel_size=3, indice_key="subm1"),
                *block(16, 32, "conv", kernel_size=3, stride=2, padding=1, indice_key="spconv2"),
                *block(32, 32, "subm", kernel_size=3, indice_key="subm2"),
                *block(32, 64, "conv", kernel_size=3, stride=2, padding=1, indice_key="spconv3"),
                *block(64, 64, "subm", kernel_size=3, indice_key="subm3"),
                *block(64, 64, "conv", kernel_size=3, stride=2, padding=(0, 1, 1), indice_key="spconv4"),
                *block(64, 64, "conv", kernel_size=(3, 1, 1), stride=(2, 1, 1), indice_key="spconv_down2"),
            )

        def forward(self, x):
            dense = self.net(x).dense()
            batch, channels, depth, height, width = dense.shape
            return dense.view(batch, channels * depth, height, width)

    class BasicBlock(spconv.SparseModule):
        def __init__(self, channels: int, key: str) -> None:
            super().__init__()
            self.conv1 = spconv.SubMConv3d(channels, channels, 3, bias=False, indice_key=key)
            self.bn1 = nn.BatchNorm1d(channels, eps=1e-3, momentum=0.01)
            self.conv2 = spconv.SubMConv3d(channels, channels, 3, bias=False, indice_key=key)
            self.bn2 = nn.BatchNorm1d(channels, eps=1e-3, momentum=0.01)
            self.relu = nn.ReLU()

        def forward(self, x):
            out = self.conv1(x)
            out = out.replace_feature(self.relu(self.bn1(out.features)))
            out = self.conv2(out)
            out = out.replace_feature(self.bn2(out.features) + x.features)
            return out.replace_feature(self.relu(out.features))

    class Residual(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = spconv.SparseSequential(
                *block(in_channels, 16, "subm", kernel_size=3, indice_key="stem"), BasicBlock(16, "res1"),
                *block(16, 32, "conv", kernel_size=3, stride=2, padding=1, indice_key="down1"), BasicBlock(32, "res2"),
                *block(32, 32, "conv", kernel_size=3, stride=2, padding=1, indice_key="down2"), BasicBlock(32, "res3"),
                *block(32, 32, "conv", kernel_size=(5, 1, 1), stride=(4, 1, 1), indice_key="zdown"),
            )

        def forward(self, x):
            return self.net(x).dense().permute(0, 2, 3, 4, 1)

    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(0)
    models = {"second": Second(), "residual": Residual()}
    for model in models.values():
        for module in model.modules():
            if isinstance(module, nn.BatchNorm1d):
                size = module.num_features
                module.running_mean.copy_((torch.rand(size, generator=generator) - 0.5) * 0.2)
                module.running_var.copy_(torch.rand(size, generator=generator) + 0.5)
                module.weight.data.copy_(torch.rand(size, generator=generator) + 0.5)
                module.bias.data.copy_((torch.rand(size, generator=generator) - 0.5) * 0.2)
        model.eval()
    return models


def load_scan(crop: int | None) -> tuple[np.ndarray, np.ndarray, tuple[int, ...]]:
    """The scan's features, indices and grid; with ``crop``, a crop x crop window of (y, x) cells at the centre."""
    if not SCAN.is_file():
        raise SystemExit(f"the scan {SCAN} is missing (the repository's data/ folder holds it; see data/README.md)")
    with np.load(SCAN) as archive:
        features, indices = archive["features"], archive["indices"]
        spatial_shape = tuple(int(s) for s in archive["spatial_shape"])
    if crop:
        low = [spatial_shape[1] // 2 - crop // 2, spatial_shape[2] // 2 - crop // 2]
        keep = ((indices[:, 2] >= low[0]) & (indices[:, 2] < low[0] + crop)
                & (indices[:, 3] >= low[1]) & (indices[:, 3] < low[1] + crop))
        features, indices = features[keep], indices[keep].copy()
        indices[:, 2] -= low[0]
        indices[:, 3] -= low[1]
        spatial_shape = (spatial_shape[0], crop, crop)
    return np.ascontiguousarray(features), np.ascontiguousarray(indices), spatial_shape


def require(module: str, why: str) -> None:
    """Stops with what to install when ``module`` does not import (instead of a bare ModuleNotFoundError)."""
    try:
        __import__(module)
    except ModuleNotFoundError as missing:
        if missing.name != module:
            raise
        raise SystemExit(f"error: examples/deploy_onnx.py {why} and needs {module}, which is not installed here: "
                         "pip install 'sparsecore-conv[torch,onnx]' (the runtime side alone needs only "
                         "'sparsecore-conv[onnx]')") from None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--crop", type=int, default=None,
                        help="use a CROP x CROP window of the scan (cells; None: the whole scan)")
    parser.add_argument("--repeat", type=int, default=3, help="timed runtime runs per model (median)")
    parser.add_argument("--output-dir", help="keep the ONNX files here (None: a temporary folder)")
    parser.add_argument("--runtime-worker", metavar="DIR", help=argparse.SUPPRESS)
    args = parser.parse_args()
    require("onnx", "reads and writes ONNX files")
    if args.runtime_worker:
        run_runtime(Path(args.runtime_worker), args.repeat)
        return

    require("torch", "builds the models it exports with sparsecore.torch")
    import torch

    import sparsecore.torch as spconv

    features, indices, spatial_shape = load_scan(args.crop)
    print(f"scan: {len(features):,} voxels, {features.shape[1]} features, grid {spatial_shape}")
    models = build_models(features.shape[1])
    x = spconv.SparseConvTensor(torch.from_numpy(features), torch.from_numpy(indices), list(spatial_shape), 1)
    with tempfile.TemporaryDirectory() as temporary:
        directory = Path(args.output_dir or temporary)
        directory.mkdir(parents=True, exist_ok=True)
        np.savez(directory / "input.npz", features=features, indices=indices, batch_size=1,
                 spatial_shape=np.array(spatial_shape))
        expected, torch_times = {}, {}
        for name, model in models.items():
            spconv.export_onnx(model, x, directory / f"{name}.onnx")
            with torch.no_grad():
                start = time.perf_counter()
                expected[name] = model(x).numpy()
                torch_times[name] = time.perf_counter() - start
            size = (directory / f"{name}.onnx").stat().st_size
            print(f"exported {name}.onnx ({size / 1e6:.2f} MB), torch output {tuple(expected[name].shape)}")
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
        subprocess.run([sys.executable, __file__, "--runtime-worker", str(directory), "--repeat", str(args.repeat)],
                       check=True, env=env)
        timings = json.loads((directory / "timings.json").read_text())
        print("\nmodel     output shape            max |runtime - torch|  max |torch|  runtime s/run  torch s/run")
        failed = []
        for name in MODELS:
            got = np.load(directory / f"{name}.runtime.npy")
            scale = float(np.abs(expected[name]).max())
            error = float(np.abs(got - expected[name]).max()) if got.shape == expected[name].shape else np.inf
            print(f"{name:9} {str(tuple(got.shape)):23} {error:21.2e}  {scale:11.3f}  {timings[name]:13.3f}  "
                  f"{torch_times[name]:11.3f}")
            if not error <= 2e-2 * max(scale, 1.0):  # FP16 weights in the file, float32 arithmetic
                failed.append(name)
    if failed:
        raise SystemExit(f"runtime and torch outputs differ beyond FP16 tolerance for {failed}")
    print("\nruntime outputs match the torch models (FP16 weights, float32 arithmetic)")


if __name__ == "__main__":
    main()
