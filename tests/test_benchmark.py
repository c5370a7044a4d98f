"""The CPU benchmark runs end to end on a small synthetic scene and agrees with spconv.

No timing is asserted: only that every row is there, carries a sparsecore
time, and (where spconv is importable) a spconv time and a passing check.
The same run draws its ``--plot`` PNG (where matplotlib is installed), and
its ``--json`` is plotted again with ``plots.plot_rows``.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from sparsecore.benchmark import cases, report, scenes
from sparsecore.benchmark.cli import build_parser, thread_limit


def _spconv_importable() -> bool:
    return importlib.util.find_spec("spconv") is not None and importlib.util.find_spec("torch") is not None


@pytest.mark.slow
def test_cpu_benchmark_on_small_synthetic_scene(tmp_path: Path) -> None:
    json_path = tmp_path / "rows.json"
    plot_path = tmp_path / "figures" / "cpu.png"  # a missing directory is created
    plotting = importlib.util.find_spec("matplotlib") is not None
    completed = subprocess.run(
        [sys.executable, "-m", "sparsecore.benchmark", "cpu", "--synthetic", "--scale", "small",
         "--repeat", "1", "--json", str(json_path), *(["--plot", str(plot_path)] if plotting else [])],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert completed.returncode == 0, completed.stdout + completed.stderr
    document = json.loads(json_path.read_text())
    rows = document["rows"]
    assert [(row["case"], row["stage"]) for row in rows] == cases.expected_row_keys()
    for row in rows:
        assert row["sparsecore_ms"] is not None and row["sparsecore_ms"] >= 0, row
        assert row["case"] in completed.stdout
    header = document["header"]
    for label in ("date", "cpu", "cores", "numpy", "blas threads", "scene", "spconv"):
        assert label in header and label in completed.stdout
    if _spconv_importable():
        assert "compared" in header["spconv"], header["spconv"]
        for row in rows:
            assert row["spconv_ms"] is not None, row
            assert row["agreement"].startswith("ok"), row
            assert row["ratio_spconv_over_sparsecore"] is not None
    else:
        assert all(row["spconv_ms"] is None for row in rows)
    if plotting:
        from sparsecore.benchmark.plots import load_rows, plot_rows

        _assert_png(plot_path)
        header, loaded = load_rows(json_path)
        _assert_png(plot_rows("cpu", header, loaded, tmp_path / "replot.png"))


def _assert_png(path: Path) -> None:
    assert path.is_file() and path.stat().st_size > 1000
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_synthetic_scene_is_a_valid_sparse_input() -> None:
    scene = scenes.synthetic_voxel_scene(scenes.SYNTHETIC_SCALES["small"], seed=3)
    assert scene.indices.dtype == np.int32 and scene.indices.shape[1] == 4
    assert scene.features.dtype == np.float32 and len(scene.features) == len(scene.indices)
    assert len(np.unique(scene.indices, axis=0)) == len(scene.indices)
    assert np.all(scene.indices[:, 1:] >= 0)
    assert np.all(scene.indices[:, 1:] < np.asarray(scene.spatial_shape))
    assert len(scene.indices) > 1000
    points = scenes.synthetic_points(scenes.SYNTHETIC_SCALES["small"], seed=3)
    low, high = np.asarray(scenes.COORDINATE_RANGE[:3]), np.asarray(scenes.COORDINATE_RANGE[3:])
    assert np.all((points >= low) & (points < high))


def test_missing_explicit_data_file_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        scenes.find_data_file(str(tmp_path / "absent.npz"), scenes.VOXELS_FILE_NAME)


def test_real_scans_are_in_the_repository() -> None:
    voxels = scenes.load_voxel_scene(scenes.require_data_file(None, scenes.VOXELS_FILE_NAME))
    assert len(voxels.indices) == 125_562 and voxels.spatial_shape == (80, 1600, 1600)
    assert len(np.unique(voxels.indices, axis=0)) == len(voxels.indices)
    points = scenes.load_points(scenes.require_data_file(None, scenes.POINTS_FILE_NAME))
    assert points.shape == (198_130, 3)
    repository_data = Path(scenes.__file__).resolve().parents[2] / "data"
    assert scenes.default_data_directories()[-1] == repository_data


def test_missing_data_file_names_the_file_and_the_folders(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(scenes.DATA_DIRECTORY_VARIABLE, str(tmp_path))
    with pytest.raises(FileNotFoundError, match="absent.npz is in none of: .*" + tmp_path.name + ".*SPARSECORE_DATA_DIR"):
        scenes.require_data_file(None, "absent.npz")


def test_demo_with_a_missing_points_file_exits_with_a_message(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from sparsecore import demo

    assert demo.main(["--points", str(tmp_path / "absent.npz")]) == 2
    error = capsys.readouterr().err
    assert "absent.npz" in error and "does not exist" in error and "Traceback" not in error


def test_table_lists_every_row_with_ratio() -> None:
    rows = [cases.Row(case, stage, 2.0, 3.0, "ok") for case, stage in cases.expected_row_keys()]
    text = report.format_table({"cpu": "test"}, rows)
    assert "1.50x" in text
    for case, stage in cases.expected_row_keys():
        assert case in text and stage in text


def test_parser_and_thread_limit_defaults() -> None:
    arguments = build_parser().parse_args(["cpu"])
    assert arguments.repeat >= 1 and arguments.threads == 1 and not arguments.synthetic
    with thread_limit(None, [], allow_reexec=False) as applied:
        assert applied == "as configured"
