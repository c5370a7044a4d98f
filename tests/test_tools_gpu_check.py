"""tools/gpu_check.sh dry-run on the CPU: every step runs in order, failures do not stop it, results come back.

Without a GPU the device step fails, the kernel report compiles through
NVRTC offline, the GPU tests skip, the host-operation count runs on the
emulation on both sides (so the comparison of two counts is exercised for
real) and the benchmark stops at "needs a CUDA GPU": the script must go on
after each failure, keep its summary in step order, judge the targets as not
measured, and leave at most the 8 files the device tool brings back, with
names it accepts. Small settings keep it to seconds (one kernel file, three
layers, one test file).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
STEPS = ("peer", "device", "install", "imports", "kernels", "correctness", "hostops-emulation", "hostops",
         "layers-estimate", "layers", "import-spconv", "benchmark", "targets", "capture")


def _gpu_visible() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # no CuPy, no driver, no device
        return False


@pytest.mark.skipif(shutil.which("timeout") is None or shutil.which(os.environ.get("CXX", "g++")) is None,
                    reason="needs coreutils' timeout and g++ (the emulation)")
def test_dry_run_keeps_going_and_reports_every_step(tmp_path: Path) -> None:
    if _gpu_visible():
        pytest.skip("a GPU is visible: the dry run is for machines without one")
    out = tmp_path / "out"
    environment = dict(os.environ, OUT=str(out), PYTHON=sys.executable, GPU_CHECK_SKIP_INSTALL="1",
                       GPU_CHECK_SKIP_PEER="1", GPU_CHECK_HOSTOPS_SCENE="synthetic",
                       GPU_CHECK_HOSTOPS_DEVICE="emulation", GPU_CHECK_HOSTOPS_ARGS="--layers 3",
                       GPU_CHECK_CORRECTNESS="tests/test_neighbour_map.py", GPU_CHECK_KERNEL_FILES="rulebook.cu",
                       GPU_CHECK_BUDGET_S="400")
    completed = subprocess.run(["bash", str(ROOT / "tools" / "gpu_check.sh")], cwd=ROOT, env=environment,
                               capture_output=True, text=True, timeout=600)
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    summary = (out / "gpu_check.md").read_text()
    table = re.findall(r"^\| ([\w-]+) \| ([^|]*) \|", summary, re.MULTILINE)
    assert [name for name, _ in table if name not in ("step", "---")] == list(STEPS), table
    exits = dict(table)
    assert exits["device"].strip() != "0"  # no GPU here
    for step in ("imports", "kernels", "hostops-emulation", "hostops", "layers-estimate"):
        assert exits[step].strip() == "0", (step, summary[:3000])
    assert exits["benchmark"].strip() == "1" and exits["targets"].strip() == "1"
    assert exits["layers"].strip() == "1"  # needs a GPU; the estimate's totals and targets are there still
    assert exits["capture"].strip() == "0"  # says there is no GPU and measures nothing
    # the sections, in the order the run tells them
    titles = ["## device and versions", "## imports and CUDA headers", "## kernels:", "## correctness per dtype",
              "## host operations per layer", "## host operations: GPU against the emulation",
              "## the estimate's totals and targets", "## device targets"]
    positions = [summary.find(title) for title in titles]
    assert all(position >= 0 for position in positions) and positions == sorted(positions), positions
    assert "crt/mma.h for wmma (kernel_registry.tensor_core_include_dir):" in summary
    assert re.search(r"^rulebook\.cu +\d+\.\d\d +\d", summary, re.MULTILINE), "no compile time for rulebook.cu"
    assert "sc_compact_count" in summary
    assert "every layer's counts are equal" in summary
    assert "L02 SparseMaxPool3d(2, 2) 64" in summary
    assert re.search(r"^float16 new: forward issued/useful \d+\.\d{3}x of ", summary, re.MULTILINE)
    assert re.search(r"^total weight gradient +\d", summary, re.MULTILINE)
    assert summary.count("\nNOT MEASURED ") == 14 and "device targets: 0 PASS, 0 FAIL, 14 NOT MEASURED" in summary
    # what comes back: at most 8 files, plain names, nothing deeper
    files = sorted(path.name for path in out.iterdir())
    assert len(files) <= 8 and all(re.fullmatch(r"[\w.-]+", name) for name in files), files
    assert {"gpu_check.md", "gpu_check.log", "gpu_kernels.json", "host_ops_gpu.json",
            "host_ops_emulation.json", "pytest_gpu.log"} <= set(files), files
    # the end of the printed output repeats the step table and the targets
    assert "| kernels | 0 |" in completed.stdout and "device targets: 0 PASS" in completed.stdout


def test_the_script_parses_and_every_command_it_calls_answers_help() -> None:
    script = ROOT / "tools" / "gpu_check.sh"
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True).returncode == 0
    text = script.read_text()
    tools = sorted(set(re.findall(r"tools/(\w+\.py)", text)))
    modules = sorted(set(re.findall(r"-m (sparsecore[\w.]*)(?: ([a-z]+)\b)?", text)))
    assert {"gpu_kernel_report.py", "gpu_layer_estimate.py", "gpu_layer_times.py", "host_operations.py",
            "capture_check.py"} <= set(tools)
    assert ("sparsecore.benchmark", "gpu") in modules and ("sparsecore.demo", "") in modules
    commands = [f"tools/{name}" for name in tools]
    commands += [f"-m {module}{' ' + verb if verb else ''}" for module, verb in modules]
    # one process: each command's --help through runpy, its exit code and first output line collected
    program = (
        "import contextlib, io, runpy, sys\n"
        "for command in sys.argv[1:]:\n"
        "    words = command.split()\n"
        "    sys.argv = (words[1:] if words[0] == '-m' else words) + ['--help']\n"
        "    out = io.StringIO()\n"
        "    try:\n"
        "        with contextlib.redirect_stdout(out):\n"
        "            runpy.run_path(words[0], run_name='__main__') if words[0] != '-m' else "
        "runpy.run_module(words[1], run_name='__main__', alter_sys=True)\n"
        "        code = 0\n"
        "    except SystemExit as exit:\n"
        "        code = exit.code or 0\n"
        "    print(repr(command), code, 'usage:' in out.getvalue().lower(), flush=True)\n")
    completed = subprocess.run([sys.executable, "-c", program, *commands], cwd=ROOT, capture_output=True,
                               text=True, timeout=300)
    answers = [line for line in completed.stdout.splitlines() if line.startswith("'")]
    assert len(answers) == len(commands), completed.stdout[-2000:] + completed.stderr[-3000:]
    for line in answers:
        assert line.endswith(" 0 True"), line
