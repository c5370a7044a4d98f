"""``python -m sparsecore.demo``: from a LiDAR scan to a sparse U-Net's gradients, checked.

With no arguments it needs no download: it ray-casts a synthetic 64-beam scan
(`sparsecore.scene`), voxelizes it at 0.1 m with
``sparsecore.torch.utils.PointToVoxel``, runs a small sparse U-Net
(``SubMConv3d``, strided ``SparseConv3d``, ``SparseInverseConv3d`` with
``indice_key``s, skip concatenation, ``BatchNorm1d``, ``ReLU``) forward and
backward, and checks two of its layers against dense ``torch.nn.functional.conv3d``
on a 32-voxel crop of the scan in float64: the first submanifold layer at the
active sites of the crop's interior, and the first strided layer on every
output cell of the crop's interior (zero where the sparse output has no site).

Options: ``--points FILE.npz`` (an array ``points [P, 3+]``, x y z first, in
metres) runs on a real scan; ``--device cuda`` on a GPU; ``--frontend jax`` hands the
same arguments to ``sparsecore.jax.demo.main(argv)`` where the JAX frontend
provides it, and otherwise says that it is not available (exit status 2).
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from .benchmark.scenes import COORDINATE_RANGE, POINTS_FILE_NAME, VOXEL_SIZE, load_points, require_data_file
from .scene import lidar_scene

if TYPE_CHECKING:
    import torch

__all__ = ["DemoResult", "CropCheck", "build_unet", "check_against_dense", "run_demo", "main"]

CROP = 32
TOLERANCE = 1e-9


@dataclass(frozen=True)
class CropCheck:
    """Outcome of the dense comparison.

    Attributes:
        origin: zyx voxel corner of the crop.
        sites_compared: sparse outputs compared (both layers).
        max_error: largest absolute difference from dense conv3d.
        scale: largest absolute dense value (for a relative reading).
        passed: ``max_error <= TOLERANCE * max(1, scale)`` and something was compared.
    """

    origin: tuple[int, int, int]
    sites_compared: int
    max_error: float
    scale: float
    passed: bool


@dataclass(frozen=True)
class DemoResult:
    """What the demo measured.

    Attributes:
        source: where the points came from.
        num_points: points read.
        num_voxels: active voxels at full resolution.
        rulebook_s: time spent building the network's rulebooks for this scan.
        forward_s: forward wall time (including the rulebooks).
        backward_s: backward wall time.
        check: the dense comparison.
        rulebook_label: what ``rulebook_s`` measures, as the table's row name.
        extra_rows: further ``(name, value)`` rows printed after the rulebooks.
    """

    source: str
    num_points: int
    num_voxels: int
    rulebook_s: float
    forward_s: float
    backward_s: float
    check: CropCheck
    rulebook_label: str = "rulebooks (core builds, timed inside the forward)"
    extra_rows: tuple[tuple[str, str], ...] = ()


def build_unet(in_channels: int, num_classes: int = 3) -> "torch.nn.Module":
    """A small two-level sparse U-Net (needs torch).

    Args:
        in_channels: point features per voxel.
        num_classes: output channels per voxel.

    Returns:
        A ``torch.nn.Module`` mapping a ``SparseConvTensor`` to ``[N, num_classes]`` logits.
    """
    from torch import nn

    import sparsecore.torch as spconv

    def block(cin: int, cout: int, key: str):
        return spconv.SparseSequential(
            spconv.SubMConv3d(cin, cout, 3, padding=1, bias=False, indice_key=key),
            nn.BatchNorm1d(cout), nn.ReLU())

    def down(cin: int, cout: int, key: str):
        return spconv.SparseSequential(
            spconv.SparseConv3d(cin, cout, 3, stride=2, padding=1, bias=False, indice_key=key),
            nn.BatchNorm1d(cout), nn.ReLU())

    def up(cin: int, cout: int, key: str):
        return spconv.SparseSequential(
            spconv.SparseInverseConv3d(cin, cout, 3, bias=False, indice_key=key),
            nn.BatchNorm1d(cout), nn.ReLU())

    class UNet(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.stem = block(in_channels, 16, "subm1")
            self.enc1 = block(16, 16, "subm1")
            self.down1 = down(16, 32, "down1")
            self.enc2 = block(32, 32, "subm2")
            self.down2 = down(32, 64, "down2")
            self.bottom = block(64, 64, "subm3")
            self.up2 = up(64, 32, "down2")
            self.dec2 = block(64, 32, "subm2")
            self.up1 = up(32, 16, "down1")
            self.dec1 = block(32, 16, "subm1")
            self.head = nn.Linear(16, num_classes)
            self.join = spconv.JoinTable()  # skip concatenation: the channels of tensors on the same sites

        def forward(self, x):
            skip1 = self.enc1(self.stem(x))
            skip2 = self.enc2(self.down1(skip1))
            y = self.up2(self.bottom(self.down2(skip2)))
            # Inverse convs restore the paired layer's input sites in order: join the skip's channels.
            y = self.dec2(self.join([y, skip2]))
            y = self.up1(y)
            y = self.dec1(self.join([y, skip1]))
            return self.head(y.features)

    return UNet()


def _densify(features: "torch.Tensor", indices: np.ndarray, origin: np.ndarray,
             size: int) -> tuple["torch.Tensor", np.ndarray, np.ndarray]:
    """Scatters the sites inside ``[origin, origin + size)^3`` into ``[1, C, size, size, size]``."""
    import torch

    local = indices[:, 1:] - origin
    inside = np.all((local >= 0) & (local < size), axis=1)
    dense = torch.zeros((1, features.shape[1], size, size, size), dtype=torch.float64)
    rows = torch.from_numpy(np.nonzero(inside)[0])
    z, y, x = (torch.from_numpy(local[inside, axis]) for axis in range(3))
    dense[0, :, z, y, x] = features[rows].double().T
    return dense, inside, local


def _pick_crop(indices: np.ndarray, size: int, generator: np.random.Generator) -> np.ndarray:
    """An even zyx corner of a crop holding many active sites (best of 64 random centres)."""
    coords = indices[:, 1:]
    candidates = coords[generator.integers(0, len(coords), min(64, len(coords)))]
    counts = [np.count_nonzero(np.all(np.abs(coords - c) < size // 2, axis=1)) for c in candidates]
    corner = candidates[int(np.argmax(counts))] - size // 2
    return (np.maximum(corner, 0) // 2) * 2


def check_against_dense(model: "torch.nn.Module", x: Any, seed: int = 0) -> CropCheck:
    """Compares the model's first submanifold and first strided layers with dense conv3d.

    Both layers run on the whole sparse input in float64 (copies of the model's
    weights); the dense reference convolves the densified crop.

    Args:
        model: a network from `build_unet`.
        x: its full-resolution ``SparseConvTensor`` input (on the CPU).
        seed: picks the crop.

    Returns:
        The comparison.
    """
    import copy

    import torch
    import torch.nn.functional as F

    subm = copy.deepcopy(model.stem[0]).double()
    strided = copy.deepcopy(model.down1[0]).double()
    indices = x.indices.cpu().numpy()
    origin = _pick_crop(indices, CROP, np.random.default_rng(seed))
    with torch.no_grad():
        x64 = x.replace_feature(x.features.double())
        subm_out = subm(x64)
        # Input of the strided layer: any sparse tensor with the same sites, here relu(subm_out).
        h = subm_out.replace_feature(torch.relu(subm_out.features))
        out = strided(h)
        dense_x, _, _ = _densify(x64.features, indices, origin, CROP)
        w = subm.weight.permute(0, 4, 1, 2, 3)  # [out, kz, ky, kx, in] -> torch's [out, in, kz, ky, kx]
        dense_subm = F.conv3d(dense_x, w, padding=1)
        # Submanifold outputs at active sites one cell or more inside the crop (full neighbourhood seen).
        _, inside, local = _densify(subm_out.features, subm_out.indices.cpu().numpy(), origin, CROP)
        interior = inside & np.all((local >= 1) & (local < CROP - 1), axis=1)
        l_int = local[interior]
        expected = dense_subm[0, :, l_int[:, 0], l_int[:, 1], l_int[:, 2]].T
        got = subm_out.features[torch.from_numpy(np.nonzero(interior)[0])]
        errors = [float((got - expected).abs().max()) if len(l_int) else 0.0]
        scales = [float(expected.abs().max()) if len(l_int) else 0.0]
        compared = int(interior.sum())
        # Strided layer: output cell o reads inputs 2o-1 .. 2o+1; compare all interior output cells.
        dense_h, _, _ = _densify(h.features, h.indices.cpu().numpy(), origin, CROP)
        dense_strided = F.conv3d(dense_h, strided.weight.permute(0, 4, 1, 2, 3), stride=2, padding=1)
        sparse_strided, _, _ = _densify(out.features, out.indices.cpu().numpy(), origin // 2, CROP // 2)
        keep = slice(1, CROP // 2 - 1)
        a = dense_strided[..., keep, keep, keep]
        b = sparse_strided[..., keep, keep, keep]
        errors.append(float((a - b).abs().max()))
        scales.append(float(a.abs().max()))
        compared += int((b.abs().sum(dim=1) > 0).sum())
    max_error, scale = max(errors), max(scales)
    passed = compared > 0 and max_error <= TOLERANCE * max(1.0, scale)
    return CropCheck(tuple(int(v) for v in origin), compared, max_error, scale, passed)  # type: ignore[arg-type]


def _load(points_file: str | None, seed: int) -> tuple[np.ndarray, str]:
    if points_file is None:
        scene = lidar_scene(seed)
        return scene.points, f"synthetic 64-beam scan (seed {seed})"
    return load_points(require_data_file(points_file, POINTS_FILE_NAME)), points_file


def run_demo(points_file: str | None = None, device: str = "cpu", seed: int = 0) -> DemoResult:
    """Voxelizes a scan, runs the U-Net forward and backward, and checks it.

    Args:
        points_file: an ``.npz`` with ``points [P, 3+]``, or None for the synthetic scan.
        device: ``"cpu"`` or ``"cuda"``.
        seed: scene, weights and crop.

    Returns:
        The measurements.
    """
    import torch

    import sparsecore.torch as spconv
    from sparsecore.torch.utils import PointToVoxel

    torch.manual_seed(seed)
    points_np, source = _load(points_file, seed)
    target = torch.device(device)
    points = torch.from_numpy(points_np).to(target)
    voxelizer = PointToVoxel(VOXEL_SIZE, COORDINATE_RANGE, points.shape[1], max_num_voxels=500_000,
                             max_num_points_per_voxel=5, device=target)
    voxels, coords, counts = voxelizer(points)
    features = voxels.sum(dim=1) / counts.clamp(min=1).unsqueeze(1).to(voxels.dtype)  # mean point per voxel
    indices = torch.cat([torch.zeros_like(coords[:, :1]), coords], dim=1)
    model = build_unet(features.shape[1]).to(target)
    for name, module in model.named_modules():  # benchmark mode records layers by name
        if isinstance(module, spconv.SparseConvolution):
            module.name = name

    def sync() -> None:
        if target.type == "cuda":
            torch.cuda.synchronize(target)

    def make_input(benchmark: bool):
        return spconv.SparseConvTensor(features, indices, voxelizer.grid_size, 1, benchmark=benchmark)

    # One untimed pass warms up allocators, kernels and the op registry.
    model(make_input(False)).sum().backward()
    model.zero_grad()
    x = make_input(True)
    sync()
    start = time.perf_counter()
    logits = model(x)
    sync()
    forward_s = time.perf_counter() - start
    loss = logits.square().mean()
    start = time.perf_counter()
    loss.backward()
    sync()
    backward_s = time.perf_counter() - start
    rulebook_s = sum(sum(entry["indice_gen_time"]) for entry in x.benchmark_record.values())
    cpu_input = spconv.SparseConvTensor(features.cpu(), indices.cpu(), voxelizer.grid_size, 1)
    check = check_against_dense(model.cpu(), cpu_input, seed)
    return DemoResult(source, int(points.shape[0]), int(features.shape[0]), rulebook_s, forward_s,
                      backward_s, check)


def format_table(result: DemoResult, device: str) -> str:
    """The demo's printed table."""
    check = result.check
    rows = [
        ("scan", result.source),
        ("device", device),
        ("points", f"{result.num_points:,}"),
        ("voxels (0.1 m)", f"{result.num_voxels:,}"),
        (result.rulebook_label, f"{result.rulebook_s * 1e3:.1f} ms"),
        *result.extra_rows,
        ("forward (with rulebooks)", f"{result.forward_s * 1e3:.1f} ms"),
        ("backward", f"{result.backward_s * 1e3:.1f} ms"),
        ("dense check", f"{check.sites_compared:,} outputs of a {CROP}^3 crop at zyx {check.origin}, "
                        f"max |error| {check.max_error:.1e} (values up to {check.scale:.1e})"),
        ("check passed", "yes" if check.passed else "NO"),
    ]
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)


def _jax_demo(argv: Sequence[str] | None) -> int:
    """Hands over to ``sparsecore.jax.demo.main`` when the JAX frontend provides one."""
    import importlib

    try:
        module = importlib.import_module("sparsecore.jax.demo")
    except ModuleNotFoundError as error:
        if error.name != "jax":
            raise
        print(f"error: {error}", file=sys.stderr)
        return 2
    except ImportError as error:
        print(f"The JAX path of the demo is not available in this build ({error}). Run it with "
              "--frontend torch (the default).", file=sys.stderr)
        return 2
    return int(module.main(argv))


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point; returns the exit status (0 when the check passed)."""
    parser = argparse.ArgumentParser(prog="python -m sparsecore.demo", description=__doc__.split("\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter, add_help=False)
    parser.add_argument("-h", "--help", action="store_true", default=argparse.SUPPRESS,
                        help="show this help and exit (with --frontend jax: the JAX demo's help)")
    parser.add_argument("--points", metavar="FILE.npz",
                        help="a real scan: .npz with points [P, 3+] (x y z first, metres); None: a synthetic "
                        "64-beam scan, no download")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda (a GPU; needs CuPy and a CUDA torch)")
    parser.add_argument("--frontend", default="torch", choices=("torch", "jax"),
                        help="torch: sparsecore.torch; jax: the same demo through sparsecore.jax (its own "
                        "options, e.g. --impl, are passed on: python -m sparsecore.demo --frontend jax --help)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the synthetic scan and the weights")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads (torch.set_num_threads); None: torch's default")
    args, unknown = parser.parse_known_args(argv)
    if args.frontend == "jax":  # the JAX demo's own options (e.g. --impl, --help) go to its parser
        return _jax_demo(argv)
    if getattr(args, "help", False):
        parser.print_help()
        return 0
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    try:
        import torch
    except ModuleNotFoundError as error:
        if error.name != "torch":
            raise
        print("error: the demo runs the PyTorch frontend, and PyTorch is not installed here; install it with "
              "pip install 'sparsecore-conv[torch]' (the core alone runs examples/voxelize_numpy.py)", file=sys.stderr)
        return 2

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device.startswith("cuda"):
        from sparsecore.backends import CudaUnavailableError, require_cuda

        cpu_advice = "Run without --device to use the CPU, the default."
        try:
            require_cuda(f"--device {args.device}", cpu_advice)
        except CudaUnavailableError as error:
            print(f"error: {error}", file=sys.stderr)
            return 2
        if not torch.cuda.is_available():
            print(f"error: --device {args.device} needs a CUDA GPU, but torch sees no CUDA device (a CPU-only "
                  f"torch build?). {cpu_advice}", file=sys.stderr)
            return 2
    try:
        result = run_demo(args.points, args.device, args.seed)
    except FileNotFoundError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(format_table(result, args.device))
    return 0 if result.check.passed else 1


if __name__ == "__main__":
    sys.exit(main())
