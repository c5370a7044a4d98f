"""tools/gpu_kernel_report.py without a GPU: NVRTC's compile of the registered kernels and ptxas' report of them.

The report's offline pass compiles each kernel file through NVRTC for sm_90
with ``--ptxas-options=-v``: these tests check that the log's resource lines
are read right (a log in ptxas' format with known values), and that a real
compile reports every registered instantiation of a file with the lowered
name NVRTC gives it and its registers, and writes its JSON.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import pytest

from sparsecore.backends import kernel_registry

ROOT = Path(__file__).resolve().parents[1]

try:
    from cupy_backends.cuda.libs import nvrtc
except ImportError:  # pragma: no cover - depends on the environment
    nvrtc = None


def _load() -> Any:
    name = "gpu_kernel_report"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


report_tool = _load()
needs_nvrtc = pytest.mark.skipif(nvrtc is None or kernel_registry.cuda_include_dir() is None,
                                 reason="needs NVRTC (cupy) and the CUDA headers")

_LOG = """\
ptxas info    : 20 bytes gmem
ptxas info    : Compiling entry function '_Z3oneIfEvPf' for 'sm_90'
ptxas info    : Function properties for _Z3oneIfEvPf
ptxas         .     8 bytes stack frame, 16 bytes spill stores, 12 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers, 4096 bytes smem, 400 bytes cmem[0]
ptxas info    : Compile time = 133.807 ms
ptxas info    : Function properties for _Z6helperv
ptxas         .     32 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Compiling entry function '_Z3twov' for 'sm_90'
ptxas info    : Function properties for _Z3twov
ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 18 registers, used 0 barriers, 360 bytes cmem[0]
"""


def test_ptxas_log_is_read_per_entry_function() -> None:
    assert report_tool.parse_ptxas_log(_LOG) == {
        "_Z3oneIfEvPf": {"stack_bytes": 8, "spill_store_bytes": 16, "spill_load_bytes": 12, "registers": 255,
                         "barriers": 1, "shared_bytes": 4096},
        "_Z3twov": {"stack_bytes": 0, "spill_store_bytes": 0, "spill_load_bytes": 0, "registers": 18,
                    "barriers": 0, "shared_bytes": 0},
    }
    assert report_tool.parse_ptxas_log("") == {}


@needs_nvrtc
def test_every_instantiation_of_a_file_gets_its_resources() -> None:
    file = "rulebook.cu"
    report = report_tool.nvrtc_report(file, "sm_90")
    assert report.error is None, report.error
    assert [item.expression for item in report.instantiations] == list(kernel_registry.kernel_file(file)
                                                                       .name_expressions)
    assert report.nvrtc_seconds > 0 and report.binary_bytes > 0
    for item in report.instantiations:
        assert item.lowered and item.expression.split("<")[0] in item.lowered
        assert 1 <= item.registers <= 255, item
        assert item.spill_store_bytes is not None and item.spill_store_bytes >= 0
        assert item.shared_bytes is not None and item.stack_bytes is not None


@needs_nvrtc
def test_ptx_architecture_reports_size_only() -> None:
    report = report_tool.nvrtc_report("rulebook.cu", "compute_90")
    assert report.error is None and report.binary_bytes > 0
    assert all(item.lowered and item.registers is None for item in report.instantiations)


@needs_nvrtc
def test_command_writes_json_and_text(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    json_path, text_path = tmp_path / "kernels.json", tmp_path / "kernels.txt"
    assert report_tool.main(["--files", "rulebook.cu", "--device", "none", "--json", str(json_path),
                             "--output", str(text_path)]) == 0
    document = json.loads(json_path.read_text())
    assert [entry["file"] for entry in document["files"]] == ["rulebook.cu"]
    assert "GPU pass off" in document["header"]
    text = text_path.read_text()
    assert "sc_compact_count" in text and "instantiations with spills or local memory" in text
    assert "rulebook.cu" in capsys.readouterr().out
    assert report_tool.main(["--files", "no_such.cu", "--device", "none"]) == 1


# --- the --sass part (tools/gpu_sass_report.py) ---

sass_tool = sys.modules.get("gpu_sass_report") or importlib.import_module("gpu_sass_report")
gpu_sass = sys.modules["gpu_sass"]
needs_cuobjdump = pytest.mark.skipif(nvrtc is None or kernel_registry.cuda_include_dir() is None
                                     or gpu_sass.find_cuobjdump() is None,
                                     reason="needs NVRTC and cuobjdump (pip install nvidia-cuda-cuobjdump "
                                            "nvidia-cuda-nvdisasm)")

_ELF = """\
.nv.info._Z3onev
\t<0x1>
\tAttribute:\tEIATTR_CUDA_API_VERSION
\tFormat:\tEIFMT_SVAL
\tValue:\t0x82 
\t<0x2>
\tAttribute:\tEIATTR_MAX_THREADS
\tFormat:\tEIFMT_SVAL
\tValue:\t0x80 0x1 0x1 

.nv.info._Z3twov
\t<0x1>
\tAttribute:\tEIATTR_REQNTID
\tFormat:\tEIFMT_SVAL
\tValue:\t0x20 0x2 0x1 

.nv.info._Z5threev
\t<0x1>
\tAttribute:\tEIATTR_MAXREG_COUNT
\tFormat:\tEIFMT_HVAL
\tValue:\t0xff
"""


def test_launch_bounds_are_read_from_the_elf_and_take_precedence() -> None:
    bounds = sass_tool.parse_elf_threads(_ELF)
    assert bounds == {"_Z3onev": 128, "_Z3twov": 64}
    assert sass_tool.threads_of("sc_one<float, sc::Simt>", bounds, "_Z3onev") == (128, "__launch_bounds__")
    assert sass_tool.threads_of("sc_one", bounds, "_Z3onev", default=96) == (96, "--threads")
    assert sass_tool.threads_of("sc_three<float, sc::Simt>", bounds, "_Z5threev")[1].startswith("the backend's")
    assert sass_tool.threads_of("sc_pack_keys", bounds, "_Z5threev") == (256, "the kernel backend's default block")


@needs_cuobjdump
def test_sass_summary_of_a_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    json_path = tmp_path / "sass.json"
    assert report_tool.main(["--sass", "sm_80", "--files", "rulebook.cu", "--device", "none", "--json",
                             str(json_path), "--match", "sc_compact"]) == 0
    table = capsys.readouterr().out.split("SASS for sm_80", 1)[1]  # --match selects the table's rows
    assert "sc_compact_count" in table and "sc_regular_conv_candidates" not in table
    (file,) = json.loads(json_path.read_text())["files"]
    for item in file["instantiations"]:
        sass, held = item["sass"], item["occupancy"]
        assert sass["instructions"] > 0 and sass["global_stores"] + sass["shared_stores"] > 0, item
        assert sass["local_accesses"] == 0 and item["threads"] == 256
        assert held["blocks_per_sm"] >= 1 and 0 < held["fraction"] <= 1
        assert held["by_registers"] == 65536 // (-(-item["registers"] * 32 // 256) * 256) // 4 * 4 // 8


def test_sass_without_cuobjdump_says_how_to_install(monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(report_tool, "find_cuobjdump", lambda: None)
    assert report_tool.main(["--sass", "sm_90", "--files", "rulebook.cu", "--device", "none"]) == 2
    assert "pip install" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        report_tool.main(["--sass", "sm_50", "--device", "none"])
    assert "--sass takes an architecture sm_75 .. sm_90" in capsys.readouterr().err


@needs_nvrtc
def test_another_kernels_folder_compiles_with_its_headers(tmp_path: Path) -> None:
    folder = tmp_path / "kernels_cu"
    folder.mkdir()
    for source in (ROOT / "kernels_cu").glob("*.cu*"):
        (folder / source.name).write_text(source.read_text())
    text = (folder / "rulebook.cu").read_text()
    (folder / "rulebook.cu").write_text(text + "\n// edited\n")
    assert report_tool.kernel_source("rulebook.cu", folder).endswith("// edited\n")
    assert "#include \"" not in report_tool.kernel_source("rulebook.cu", folder)
    report = report_tool.nvrtc_report("rulebook.cu", "sm_90", folder)
    installed = report_tool.nvrtc_report("rulebook.cu", "sm_90")
    assert report.error is None
    assert [(item.lowered, item.registers) for item in report.instantiations] == [
        (item.lowered, item.registers) for item in installed.instantiations]
