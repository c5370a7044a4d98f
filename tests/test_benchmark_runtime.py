"""``python -m sparsecore.benchmark runtime`` on a small window of the real scan: it runs, and the runtime's
outputs agree with the torch model's (the table's last column)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("onnx")

from sparsecore.benchmark import cli, scenes  # noqa: E402


def test_runtime_suite_on_a_window_of_the_scan(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    scene = scenes.load_voxel_scene(scenes.require_data_file(None, scenes.VOXELS_FILE_NAME))
    keep = (np.abs(scene.indices[:, 2] - 800) < 48) & (np.abs(scene.indices[:, 3] - 800) < 48)
    indices = scene.indices[keep].copy()
    indices[:, 2:] -= 800 - 48
    path = tmp_path / "window.npz"
    np.savez(path, features=scene.features[keep], indices=indices, spatial_shape=np.array([80, 96, 96]))
    arguments = ["runtime", "--voxels", str(path), "--repeat", "1", "--threads", "1", "--json", str(tmp_path / "rows.json")]
    assert cli.main(arguments) == 0
    out = capsys.readouterr().out
    variants = [" ".join(line.split()[:2]) for line in out.splitlines() if line.startswith("sparsecore.")]
    assert variants == ["sparsecore.torch float32", "sparsecore.runtime float32", "sparsecore.runtime float16"]
    differences = [float(line.split()[-1]) for line in out.splitlines() if line.startswith("sparsecore.runtime")]
    assert len(differences) == 2 and differences[0] < 1e-3 and differences[1] < 2e-2
    assert (tmp_path / "rows.json").stat().st_size > 0
