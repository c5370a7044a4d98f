"""What the CPU benchmark measures: the layers, the voxelization setting, the rows.

A row is one stage (rulebook build, forward, backward, voxelize) of one case,
timed for sparsecore and, where spconv is importable, for spconv on the same
inputs, with the outcome of the check that both agree.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = [
    "LayerSpec",
    "LAYERS",
    "CONV_STAGES",
    "VOXELIZE_STAGE",
    "VoxelizeSpec",
    "VOXELIZE",
    "Row",
    "expected_row_keys",
]


@dataclass(frozen=True)
class LayerSpec:
    """One convolution layer, in spconv's terms.

    Attributes:
        name: the label printed in the table.
        kind: ``"subm"`` (SubMConv3d) or ``"regular"`` (SparseConv3d).
        in_channels: input feature width.
        out_channels: output feature width.
        kernel_size: cubic kernel side.
        stride: stride on every axis.
        padding: padding on every axis.
    """

    name: str
    kind: str
    in_channels: int
    out_channels: int
    kernel_size: int = 3
    stride: int = 1
    padding: int = 0


LAYERS: tuple[LayerSpec, ...] = (
    LayerSpec("SubMConv3d 16->16 k3", "subm", 16, 16),
    LayerSpec("SubMConv3d 64->64 k3", "subm", 64, 64),
    LayerSpec("SparseConv3d 64->64 k3 s2 p1", "regular", 64, 64, stride=2, padding=1),
)

CONV_STAGES: tuple[str, ...] = ("rulebook", "forward", "backward")
VOXELIZE_STAGE = "voxelize"


@dataclass(frozen=True)
class VoxelizeSpec:
    """The voxelization case.

    Attributes:
        name: the label printed in the table.
        num_points: how many points of the scan are voxelized (its first ones).
        voxel_size: cell size (x, y, z) in metres.
        coordinate_range: (x_min, y_min, z_min, x_max, y_max, z_max) in metres.
        max_num_points_per_voxel: points kept per voxel.
        max_num_voxels: voxels kept at most.
    """

    name: str
    num_points: int
    voxel_size: tuple[float, float, float]
    coordinate_range: tuple[float, float, float, float, float, float]
    max_num_points_per_voxel: int
    max_num_voxels: int


VOXELIZE = VoxelizeSpec(
    name="voxelize (first 120k points) 0.1 m",
    num_points=120_000,
    voxel_size=(0.1, 0.1, 0.1),
    coordinate_range=(-80.0, -80.0, -2.0, 80.0, 80.0, 6.0),
    max_num_points_per_voxel=5,
    max_num_voxels=150_000,
)


@dataclass
class Row:
    """One line of the table.

    Attributes:
        case: the layer or voxelization label.
        stage: ``"rulebook"``, ``"forward"``, ``"backward"`` or ``"voxelize"``.
        sparsecore_ms: median sparsecore time in milliseconds (None when it could not run).
        spconv_ms: median spconv time in milliseconds (None without spconv).
        agreement: ``"ok"``, ``"MISMATCH: ..."``, or ``"-"`` when not checked.
        notes: anything else worth a reader's attention (sizes, errors).
    """

    case: str
    stage: str
    sparsecore_ms: float | None = None
    spconv_ms: float | None = None
    agreement: str = "-"
    notes: list[str] = field(default_factory=list)

    @property
    def ratio(self) -> float | None:
        """spconv time over sparsecore time (above 1: sparsecore is faster)."""
        if self.sparsecore_ms is None or self.spconv_ms is None or self.sparsecore_ms <= 0:
            return None
        return self.spconv_ms / self.sparsecore_ms

    def as_dict(self) -> dict[str, Any]:
        """The row as JSON-ready data, ratio included."""
        data = asdict(self)
        data["ratio_spconv_over_sparsecore"] = self.ratio
        return data


def expected_row_keys() -> list[tuple[str, str]]:
    """(case, stage) of every row the CPU benchmark prints, in order."""
    keys = [(layer.name, stage) for layer in LAYERS for stage in CONV_STAGES]
    keys.append((VOXELIZE.name, VOXELIZE_STAGE))
    return keys
