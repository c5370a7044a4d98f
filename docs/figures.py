"""Draw the pictures of docs/concepts.md with matplotlib (Agg) and sparsecore itself.

Usage: ``python docs/figures.py [OUTPUT_DIR]`` (default: ``docs/figures``). Writes

- ``voxelization.png``: the points of a small 2-D cloud, the voxel grid and the
  occupied voxels (computed by `sparsecore.voxelize`);
- ``rulebook.png``: a small 2-D submanifold example: the active sites, a 3x3
  kernel and the rulebook's pair lists per kernel offset (computed by
  `sparsecore.build_rulebook`).

Deterministic (fixed seeds); each PNG is well under 200 KB.
"""

from __future__ import annotations

import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.patches import Rectangle  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import sparsecore as sc  # noqa: E402

DPI = 100


def voxelization_figure(path: Path) -> None:
    """A 2-D cloud (two walls and a blob) on a 1 m grid: points, grid, occupied voxels."""
    generator = np.random.default_rng(3)
    wall = np.column_stack([generator.uniform(1, 9, 60), 2 + 0.25 * generator.standard_normal(60)])
    pole = np.column_stack([7 + 0.2 * generator.standard_normal(25), generator.uniform(3, 7.5, 25)])
    blob = np.array([2.7, 5.8]) + 0.55 * generator.standard_normal((40, 2))
    xy = np.concatenate([wall, pole, blob]).astype(np.float32)
    size, extent = 1.0, (0.0, 0.0, 10.0, 8.0)  # voxel size and (min_x, min_y, max_x, max_y)
    voxels = sc.voxelize(xy, voxel_size=(size, size), coordinate_range=extent,
                         max_num_points_per_voxel=64, max_num_voxels=1000)
    # indices are reversed (y, x), like zyx in 3-D
    counts = voxels.num_points_per_voxel

    fig, axes = plt.subplots(1, 2, figsize=(10, 4.8), dpi=DPI, sharey=True)
    inside = voxels.point_voxel_id >= 0
    for ax, title in zip(axes, ("points and the voxel grid", f"{len(counts)} occupied voxels = active sites")):
        ax.set_xlim(extent[0], extent[2])
        ax.set_ylim(extent[1], extent[3])
        ax.set_xticks(np.arange(extent[0], extent[2] + 1, size))
        ax.set_yticks(np.arange(extent[1], extent[3] + 1, size))
        ax.grid(True, color="0.75", linewidth=0.8)
        ax.set_aspect("equal")
        ax.set_title(title, fontsize=11)
        ax.set_xlabel("x (m)")
    axes[0].set_ylabel("y (m)")
    axes[0].scatter(xy[inside, 0], xy[inside, 1], s=7, color="tab:blue", zorder=3)
    axes[0].scatter(xy[~inside, 0], xy[~inside, 1], s=7, color="0.6", marker="x", zorder=3,
                    label="outside the range")
    if (~inside).any():
        axes[0].legend(loc="upper right", fontsize=8)
    peak = counts.max()
    for row, ((iy, ix), count) in enumerate(zip(voxels.indices, counts)):
        x0, y0 = extent[0] + ix * size, extent[1] + iy * size
        shade = plt.cm.Oranges(0.3 + 0.6 * count / peak)
        axes[1].add_patch(Rectangle((x0, y0), size, size, facecolor=shade, edgecolor="black", linewidth=0.8))
        axes[1].text(x0 + size / 2, y0 + size / 2, str(count), ha="center", va="center", fontsize=7)
    axes[1].scatter(xy[inside, 0], xy[inside, 1], s=2, color="tab:blue", alpha=0.5, zorder=3)
    fig.suptitle("sparsecore.voxelize: points -> voxels (number in a cell: its points; "
                 "each occupied cell is one row (batch, y, x) of indices)", fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    fig.savefig(path, dpi=DPI, bbox_inches="tight", pad_inches=0.15)
    plt.close(fig)


def rulebook_figure(path: Path) -> None:
    """Submanifold 3x3 on 6 active sites of a 5x6 grid: sites, kernel, pairs per offset."""
    coords = np.array([[1, 1], [1, 2], [2, 2], [3, 2], [3, 3], [1, 4]], dtype=np.int32)  # (y, x)
    indices = np.column_stack([np.zeros(len(coords), np.int32), coords])
    spatial_shape = (5, 6)
    geometry = sc.ConvGeometry.create(2, 3, padding=1, kind="subm")
    rulebook = sc.build_rulebook(indices, spatial_shape, 1, geometry)
    offsets = geometry.kernel_offsets()
    rows = rulebook.output_indices[:, 1:]

    fig = plt.figure(figsize=(11, 4.6), dpi=DPI)
    grid = fig.add_gridspec(1, 3, width_ratios=[1.25, 0.85, 1.6])
    ax_sites, ax_kernel, ax_pairs = (fig.add_subplot(grid[0, i]) for i in range(3))

    # active sites, labelled by their row number in indices
    ax_sites.set_xlim(-0.5, spatial_shape[1] - 0.5)
    ax_sites.set_ylim(spatial_shape[0] - 0.5, -0.5)
    ax_sites.set_xticks(range(spatial_shape[1]))
    ax_sites.set_yticks(range(spatial_shape[0]))
    ax_sites.set_xticks(np.arange(-0.5, spatial_shape[1]), minor=True)
    ax_sites.set_yticks(np.arange(-0.5, spatial_shape[0]), minor=True)
    ax_sites.grid(True, which="minor", color="0.7")
    ax_sites.tick_params(which="minor", length=0)
    ax_sites.set_aspect("equal")
    ax_sites.set_xlabel("x")
    ax_sites.set_ylabel("y")
    ax_sites.set_title("active sites (row of indices)", fontsize=11)
    for row, (y, x) in enumerate(rows):
        ax_sites.add_patch(Rectangle((x - 0.5, y - 0.5), 1, 1, facecolor="tab:orange", edgecolor="black"))
        ax_sites.text(x, y, str(row), ha="center", va="center", fontsize=12, weight="bold")
    # the window of one output site, e.g. row 2
    y, x = rows[2]
    ax_sites.add_patch(Rectangle((x - 1.5, y - 1.5), 3, 3, fill=False, edgecolor="tab:blue", linewidth=2.5,
                                 linestyle="--"))
    ax_sites.text(x - 1.4, y + 1.9, "dashed: the 3x3 window of row 2", color="tab:blue", fontsize=8, va="center")

    # the kernel: offset number k and the displacement input - output it stands for
    displacement = {}
    for k in range(rulebook.kernel_volume):
        inputs, outputs = rulebook.pairs(k)
        if len(inputs):
            displacement[k] = tuple(int(v) for v in rows[int(inputs[0])] - rows[int(outputs[0])])
        else:
            displacement[k] = tuple(int(v) for v in offsets[k] - 1)
    ax_kernel.set_xlim(-0.5, 2.5)
    ax_kernel.set_ylim(2.5, -0.5)
    ax_kernel.set_xticks([])
    ax_kernel.set_yticks([])
    ax_kernel.set_aspect("equal")
    ax_kernel.set_title("3x3 kernel: offset k\n(dy, dx) = input - output", fontsize=11)
    for k, (ky, kx) in enumerate(offsets):
        centre = k == rulebook.identity_offset
        ax_kernel.add_patch(Rectangle((kx - 0.5, ky - 0.5), 1, 1, facecolor="tab:green" if centre else "0.92",
                                      edgecolor="black"))
        dy, dx = displacement[k]
        ax_kernel.text(kx, ky - 0.12, f"k={k}", ha="center", va="center", fontsize=11, weight="bold")
        ax_kernel.text(kx, ky + 0.22, f"({dy:+d}, {dx:+d})", ha="center", va="center", fontsize=8)

    # the pair lists
    ax_pairs.axis("off")
    ax_pairs.set_title(f"rulebook: {rulebook.num_pairs} pairs (input row -> output row)", fontsize=11)
    lines = []
    for k in range(rulebook.kernel_volume):
        inputs, outputs = rulebook.pairs(k)
        pairs = ", ".join(f"{int(i)}->{int(o)}" for i, o in zip(inputs, outputs)) or "(none)"
        note = "  identity: every row" if k == rulebook.identity_offset else ""
        lines.append(f"k={k} ({displacement[k][0]:+d},{displacement[k][1]:+d}): {pairs}{note}")
    ax_pairs.text(0.0, 0.97, "\n".join(lines), family="monospace", fontsize=9, va="top", transform=ax_pairs.transAxes)
    ax_pairs.text(0.0, 0.03, "pair (i, o) at offset k:  output[o] += features[i] @ W[k].T\n"
                             "each offset pairs every row at most once (injective)",
                  fontsize=9, va="bottom", transform=ax_pairs.transAxes, color="0.25")
    fig.suptitle("submanifold 3x3 convolution: output sites = input sites", fontsize=11)
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    fig.savefig(path, dpi=DPI, bbox_inches="tight", pad_inches=0.15)
    plt.close(fig)


def main(argv: list[str]) -> int:
    out_dir = Path(argv[1]) if len(argv) > 1 else Path(__file__).resolve().parent / "figures"
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, draw in (("voxelization.png", voxelization_figure), ("rulebook.png", rulebook_figure)):
        draw(out_dir / name)
        print(f"wrote {out_dir / name} ({(out_dir / name).stat().st_size // 1024} KB)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
