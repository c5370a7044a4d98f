"""Smoke tests: every example and the demo run to completion (shortened) in a subprocess."""

from __future__ import annotations

import functools
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from sparsecore.scene import CLASS_NAMES, SceneConfig, lidar_scene

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"


def _environment(**variables: str) -> dict[str, str]:
    """This process's environment with the repository first on the import path (and ``variables``)."""
    path = os.pathsep.join(part for part in (str(ROOT), os.environ.get("PYTHONPATH", "")) if part)
    return dict(os.environ, PYTHONPATH=path, **variables)


def _run(args: list[str], cwd: Path, timeout: float = 300) -> str:
    env = _environment(OMP_NUM_THREADS="2", MPLBACKEND="Agg")
    result = subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True,
                            timeout=timeout)
    assert result.returncode == 0, f"{args} failed ({result.returncode}):\n{result.stdout}\n{result.stderr}"
    return result.stdout


def _needs(*modules: str) -> None:
    for module in modules:
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"needs {module}")


def test_scene_is_seeded_and_labelled() -> None:
    config = SceneConfig(beams=16, azimuth_steps=128)
    first, again, other = lidar_scene(3, config), lidar_scene(3, config), lidar_scene(4, config)
    np.testing.assert_array_equal(first.points, again.points)
    assert first.points.shape[1] == 4 and first.points.dtype == np.float32
    assert first.labels.shape == (first.num_points,)
    assert set(np.unique(first.labels)) <= set(range(len(CLASS_NAMES)))
    assert not np.array_equal(first.points[:10], other.points[:10])
    # Ground points lie on the plane (up to the range noise); every point is within range.
    ground = first.points[first.labels == 0]
    assert np.abs(ground[:, 2] + config.sensor_height).max() < 0.1
    assert first.points[:, 3].max() <= config.max_range + 0.1


def test_demo_default_run(tmp_path: Path) -> None:
    _needs("torch")
    out = _run(["-m", "sparsecore.demo", "--threads", "2"], tmp_path)
    assert "check passed" in out and "yes" in out.split("check passed", 1)[1].splitlines()[0], out


def test_voxelize_numpy(tmp_path: Path) -> None:
    out = _run([str(EXAMPLES / "voxelize_numpy.py"), "--clouds", "2"], tmp_path)
    assert "every point lies in its voxel" in out


def test_spconv_drop_in(tmp_path: Path) -> None:
    _needs("torch")
    out = _run([str(EXAMPLES / "spconv_drop_in.py"), "--clouds", "1"], tmp_path)
    assert "BEV map" in out
    if importlib.util.find_spec("spconv") is not None:
        assert "same outputs as spconv" in out
        assert "1x1 head built with spconv, its state_dict loaded unchanged" in out


@pytest.mark.parametrize("framework, needs, checkpoint", [
    ("torch", ("torch",), "checkpoint.pt"),
    ("jax", ("jax", "optax"), "checkpoint.npz"),
])
def test_train_segmentation(framework: str, needs: tuple[str, ...], checkpoint: str, tmp_path: Path) -> None:
    _needs(*needs, "matplotlib", "tqdm")
    out = _run([str(EXAMPLES / f"train_segmentation_{framework}.py"), "--epochs", "1", "--scenes", "2",
                "--val-scenes", "1", "--points", "3000", "--out", str(tmp_path / "run")], tmp_path)
    assert "val mIoU" in out and "same outputs" in out
    assert (tmp_path / "run" / "training.png").stat().st_size > 0
    assert (tmp_path / "run" / checkpoint).is_file()


def test_quantize_int8(tmp_path: Path) -> None:
    _needs("torch", "tqdm")  # it imports train_segmentation_torch, which shows a tqdm progress bar
    out = _run([str(EXAMPLES / "quantize_int8.py"), "--epochs", "1", "--qat-epochs", "1", "--scenes", "1",
                "--calib-scenes", "1", "--val-scenes", "1", "--batch-size", "1", "--points", "1000",
                "--timing-voxels", "1000", "--timing-repeats", "1", "--out", str(tmp_path / "run")], tmp_path,
               timeout=600)
    assert "PTQ int8 val mIoU" in out and "QAT int8 val mIoU" in out and "reloaded: same logits" in out
    assert "int8 / float32" in out
    assert (tmp_path / "run" / "unet_int8.pt").is_file()


def test_demo_jax_frontend(tmp_path: Path) -> None:
    _needs("jax")
    out = _run(["-m", "sparsecore.demo", "--frontend", "jax"], tmp_path)
    assert "check passed" in out and "yes" in out.split("check passed", 1)[1].splitlines()[0], out
    assert "jax" in out.split("device", 1)[1].splitlines()[0], out


def test_deploy_onnx(tmp_path: Path) -> None:
    _needs("torch", "onnx")
    out = _run([str(EXAMPLES / "deploy_onnx.py"), "--crop", "48", "--repeat", "1"], tmp_path)
    assert "torch/jax: none" in out and "runtime outputs match the torch models" in out
    assert out.count("SparseConvolution") >= 18 and "ScatterDense" in out and "Transpose" in out


def _gpu_visible() -> bool:
    from sparsecore.backends import CudaUnavailableError, require_cuda

    try:
        require_cuda()
    except CudaUnavailableError:
        return False
    return True


# One process runs every command of a case in turn, as ``python <args>`` would (runpy, sys.argv set), with its
# own stderr: file descriptor 2 goes to a fresh file per case, so anything written there (Python or C) is seen.
# It prints one JSON line: {case: [exit status, stderr]}; an exception escaping a command is its traceback.
_RUN_EACH_COMMAND = """
import contextlib, io, json, os, runpy, sys, tempfile, traceback
results = {}
for case, args in json.loads(sys.argv[1]).items():
    sys.stdout.flush(); sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 2)
        status = 0
        try:
            sys.argv = list(args[1:]) if args[0] == "-m" else list(args)
            if args[0] == "-m":
                sys.argv[0] = args[1]
                runpy.run_module(args[1], run_name="__main__", alter_sys=True)
            else:
                sys.path.insert(0, os.path.dirname(os.path.abspath(args[0])))
                runpy.run_path(args[0], run_name="__main__")
        except SystemExit as stop:
            if isinstance(stop.code, int) or stop.code is None:
                status = stop.code or 0
            else:
                print(stop.code, file=sys.stderr)
                status = 1
        except BaseException:
            traceback.print_exc()
            status = 1
        sys.stdout.flush(); sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)
        captured.seek(0)
        results[case] = [status, captured.read().decode()]
print(json.dumps(results))
"""


def _run_each_command(commands: dict[str, list[str]], cwd: Path, **variables: str) -> dict[str, tuple[int, str]]:
    """``{case: (exit status, stderr)}`` of each command of ``commands`` (``python`` arguments), in one process."""
    import json

    result = subprocess.run([sys.executable, "-c", _RUN_EACH_COMMAND, json.dumps(commands)], cwd=cwd,
                            env=_environment(**variables), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    return {case: (status, stderr) for case, (status, stderr) in json.loads(result.stdout.splitlines()[-1]).items()}


GPU_REQUESTS = {
    "voxelize_numpy": [str(EXAMPLES / "voxelize_numpy.py"), "--device", "cuda"],
    "demo": ["-m", "sparsecore.demo", "--device", "cuda"],
    "benchmark-gpu": ["-m", "sparsecore.benchmark", "gpu"],
    "benchmark-network": ["-m", "sparsecore.benchmark", "network", "--device", "cuda"],
}


@functools.cache
def _gpu_request_results() -> dict[str, tuple[int, str]]:
    return _run_each_command(GPU_REQUESTS, ROOT, OMP_NUM_THREADS="2")


@pytest.mark.parametrize("case", GPU_REQUESTS)
def test_gpu_request_without_a_gpu_is_one_clear_message(case: str) -> None:
    """Without a usable GPU: no traceback, one message saying so and how to run on the CPU."""
    if _gpu_visible():
        pytest.skip("a CUDA device is visible here")
    status, stderr = _gpu_request_results()[case]
    assert status != 0
    assert "Traceback" not in stderr, stderr
    message = stderr.strip()
    assert message.startswith("error: ") and message.count("\n") == 0, message
    assert "no CUDA device is visible" in message and "CPU" in message and "--device" in message


EXAMPLE_SCRIPTS = ("voxelize_numpy", "spconv_drop_in", "deploy_onnx", "train_segmentation_torch",
                   "train_segmentation_jax", "quantize_int8")


def test_examples_readme_lists_every_example_and_the_readme_links_it() -> None:
    scripts = sorted(path.stem for path in EXAMPLES.glob("[a-z]*.py"))
    assert scripts == sorted(EXAMPLE_SCRIPTS)
    listing = (EXAMPLES / "README.md").read_text(encoding="utf-8")
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    for name in scripts:
        assert f"python examples/{name}.py" in listing, name
        assert f"examples/{name}.py" in readme, name
    assert "examples/README.md" in readme


EXAMPLE_NEEDS = {"spconv_drop_in": ("torch",), "deploy_onnx": ("torch",), "train_segmentation_torch": ("torch", "tqdm"),
                 "train_segmentation_jax": ("jax", "optax", "tqdm"), "quantize_int8": ("torch", "tqdm")}


@functools.cache
def _help_texts() -> dict[str, str]:
    """Each example's ``--help`` output (those whose frameworks are installed), all from one process."""
    import json

    code = ("import contextlib, io, json, os, runpy, sys\n"
            "texts = {}\n"
            "for path in sys.argv[1:]:\n"
            "    sys.argv, out = [path, '--help'], io.StringIO()\n"
            "    sys.path.insert(0, os.path.dirname(path))\n"
            "    with contextlib.redirect_stdout(out):\n"
            "        try:\n"
            "            runpy.run_path(path, run_name='__main__')\n"
            "        except SystemExit as stop:\n"
            "            assert stop.code in (0, None), (path, stop.code)\n"
            "    texts[os.path.basename(path)[:-3]] = out.getvalue()\n"
            "print(json.dumps(texts))\n")
    installed = [name for name in EXAMPLE_SCRIPTS
                 if all(importlib.util.find_spec(module) is not None for module in EXAMPLE_NEEDS.get(name, ()))]
    result = subprocess.run([sys.executable, "-c", code, *(str(EXAMPLES / f"{name}.py") for name in installed)],
                            cwd=ROOT, env=_environment(COLUMNS="200"), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.splitlines()[-1])


@pytest.mark.parametrize("name", EXAMPLE_SCRIPTS)
def test_every_option_of_an_example_shows_its_default(name: str) -> None:
    _needs(*EXAMPLE_NEEDS.get(name, ()))
    text = _help_texts()[name]
    options: list[str] = []  # one entry per option: its line and the help lines under it
    for line in text.split("options:", 1)[1].splitlines():
        if line.startswith("  -"):
            options.append(line.strip())
        elif line.startswith("   ") and options:
            options[-1] += " " + line.strip()
    assert options, text
    missing = [line for line in options if not line.startswith("-h,") and "(default:" not in line]
    assert not missing, missing


@pytest.mark.parametrize("name", ["spconv_drop_in", "deploy_onnx"])
def test_an_example_without_torch_says_what_to_install(name: str, tmp_path: Path) -> None:
    # torch blocked in the child (sys.modules['torch'] = None makes `import torch` fail as if it were absent)
    _needs("onnx") if name == "deploy_onnx" else None
    path = str(EXAMPLES / f"{name}.py")
    code = ("import runpy, sys\n"
            "sys.modules['torch'] = None\n"
            f"sys.argv = [{path!r}]\n"
            f"runpy.run_path({path!r}, run_name='__main__')\n")
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=_environment(), capture_output=True,
                            text=True, timeout=120)
    assert result.returncode != 0
    assert "Traceback" not in result.stderr and "ModuleNotFoundError" not in result.stderr, result.stderr
    message = result.stderr.strip()
    assert message.startswith("error: ") and "pip install 'sparsecore-conv[torch" in message, message
    assert "torch" not in result.stdout
