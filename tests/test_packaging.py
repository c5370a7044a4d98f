"""The wheel ships the right files under the right names, with NumPy as its only runtime dependency.

The wheel is built once per module, from a copy of the source tree (so the
build's ``build/`` and ``*.egg-info`` never land in the checkout), without
build isolation (no network; setuptools and wheel come from the dev extra).
"""

from __future__ import annotations

import email.parser
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPOSITORY = Path(__file__).resolve().parents[1]
KERNEL_SUFFIXES = (".cu", ".cuh", ".h")
# Source directory -> the package directory it is installed as.
MAPPED_DIRECTORIES = {
    "sparsecore": "sparsecore",
    "frontends/torch": "sparsecore/torch",
    "frontends/jax": "sparsecore/jax",
    "kernels_cu": "sparsecore/kernels_cu",
}
COPY_IGNORED = shutil.ignore_patterns(
    ".git", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache", ".hypothesis", ".venv", ".peer"
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def wheel_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Builds the wheel from a copy of the tree and returns its path."""
    pytest.importorskip("build", reason="the 'build' package (dev extra) builds the wheel")
    work = tmp_path_factory.mktemp("wheel")
    source = work / "source"
    shutil.copytree(REPOSITORY, source, ignore=COPY_IGNORED)
    output = work / "dist"
    completed = subprocess.run(
        [sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(output), str(source)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert completed.returncode == 0, f"wheel build failed:\n{completed.stdout}\n{completed.stderr}"
    wheels = sorted(output.glob("sparsecore_conv-*.whl"))
    assert len(wheels) == 1, f"expected one wheel, found {wheels}"
    return wheels[0]


@pytest.fixture(scope="module")
def wheel_names(wheel_path: Path) -> set[str]:
    with zipfile.ZipFile(wheel_path) as archive:
        return set(archive.namelist())


@pytest.fixture(scope="module")
def wheel_metadata(wheel_path: Path) -> email.message.Message:
    with zipfile.ZipFile(wheel_path) as archive:
        (metadata_name,) = [name for name in archive.namelist() if name.endswith(".dist-info/METADATA")]
        text = archive.read(metadata_name).decode("utf-8")
    return email.parser.Parser().parsestr(text)


def _source_files(relative_directory: str, suffixes: tuple[str, ...]) -> list[Path]:
    directory = REPOSITORY / relative_directory
    return sorted(
        path
        for path in directory.rglob("*")
        if path.is_file() and path.suffix in suffixes and "__pycache__" not in path.parts
    )


def test_kernel_sources_are_package_data(wheel_names: set[str]) -> None:
    sources = _source_files("kernels_cu", KERNEL_SUFFIXES)
    expected = {f"sparsecore/kernels_cu/{path.relative_to(REPOSITORY / 'kernels_cu').as_posix()}" for path in sources}
    missing = expected - wheel_names
    assert not missing, f"kernel sources missing from the wheel: {sorted(missing)}"
    shipped = {name for name in wheel_names if name.startswith("sparsecore/kernels_cu/") and name.endswith(KERNEL_SUFFIXES)}
    assert shipped == expected


def test_frontends_are_installed_under_sparsecore(wheel_names: set[str]) -> None:
    for name in ("sparsecore/__init__.py", "sparsecore/torch/__init__.py", "sparsecore/jax/__init__.py",
                 "sparsecore/kernels_cu/__init__.py"):
        assert name in wheel_names, f"{name} is not in the wheel"


def test_every_python_module_is_shipped(wheel_names: set[str]) -> None:
    # Catches a new subpackage that setup.cfg's explicit package list forgot.
    missing = []
    for source_directory, installed_directory in MAPPED_DIRECTORIES.items():
        for path in _source_files(source_directory, (".py",)):
            relative = path.relative_to(REPOSITORY / source_directory).as_posix()
            if source_directory == "sparsecore" and not (path.parent / "__init__.py").is_file():
                continue  # not inside a package: not meant to be installed
            installed = f"{installed_directory}/{relative}"
            if installed not in wheel_names:
                missing.append(installed)
    assert not missing, f"modules missing from the wheel (add their packages to setup.cfg): {missing}"


def test_nothing_else_at_the_top_level(wheel_names: set[str]) -> None:
    top_level = {name.split("/", 1)[0] for name in wheel_names}
    dist_info = {entry for entry in top_level if entry.endswith(".dist-info")}
    assert top_level - dist_info == {"sparsecore"}, f"unexpected top-level entries: {sorted(top_level)}"
    assert "frontends" not in top_level and "kernels_cu" not in top_level


def test_top_level_txt_names_only_sparsecore(wheel_path: Path) -> None:
    with zipfile.ZipFile(wheel_path) as archive:
        names = [name for name in archive.namelist() if name.endswith(".dist-info/top_level.txt")]
        if not names:
            pytest.skip("this setuptools writes no top_level.txt")
        assert archive.read(names[0]).decode().split() == ["sparsecore"]


def _requirement_name(requirement: str) -> str:
    return re.split(r"[\s\[<>=!~;(]", requirement.strip(), maxsplit=1)[0].lower()


def test_runtime_dependencies_are_numpy_numba_scipy_threadpoolctl(wheel_metadata: email.message.Message) -> None:
    # numpy for the arrays, numba for the compiled CPU passes, scipy for the BLAS numba calls from the
    # tiled passes, threadpoolctl to hold BLAS's threads; no framework, no CuPy (extras), nothing else
    # (each new one is a decision for docs/performance.md)
    requirements = wheel_metadata.get_all("Requires-Dist") or []
    unconditional = [requirement for requirement in requirements if "extra ==" not in requirement]
    names = [_requirement_name(requirement) for requirement in unconditional]
    assert names == ["numpy", "numba", "scipy", "threadpoolctl"], unconditional


def test_extras(wheel_metadata: email.message.Message) -> None:
    extras = set(wheel_metadata.get_all("Provides-Extra") or [])
    assert {"cuda12", "cuda13", "torch", "jax", "dev"} <= extras
    requirements = wheel_metadata.get_all("Requires-Dist") or []
    dev = [requirement for requirement in requirements if re.search(r"extra\s*==\s*['\"]dev['\"]", requirement)]
    dev_names = {_requirement_name(requirement) for requirement in dev}
    assert {"torch", "jax", "pytest", "pytest-xdist", "build", "wheel", "cupy-cuda13x",
            "nvidia-cuda-nvrtc", "nvidia-cuda-runtime", "spconv"} <= dev_names
    assert not [requirement for requirement in dev if "[ctk]" in requirement], (
        "the dev extra must not pull CuPy's [ctk] toolkit (1.5 GB, useless without a GPU)"
    )
    (torch_requirement,) = [requirement for requirement in dev if _requirement_name(requirement) == "torch"]
    assert "==2.13.0" in torch_requirement.replace(" ", ""), "dev pins torch==2.13.0 (the local CPU build)"


def test_installed_wheel_imports_from_its_own_files(wheel_path: Path, tmp_path: Path) -> None:
    target = tmp_path / "site"
    install = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "--quiet", "--target", str(target),
         str(wheel_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert install.returncode == 0, install.stdout + install.stderr
    assert sorted(path.name for path in target.iterdir() if not path.name.endswith(".dist-info")) == ["sparsecore"]
    script = (
        "import sparsecore, sparsecore.torch, sparsecore.jax, sparsecore.kernels_cu as kernels\n"
        "for module in (sparsecore, sparsecore.torch, sparsecore.jax, kernels):\n"
        "    print(module.__file__)\n"
        "import pathlib\n"
        "print(sum(1 for path in pathlib.Path(kernels.__file__).parent.iterdir()"
        " if path.suffix in ('.cu', '.cuh', '.h')))\n"
    )
    completed = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"},
        timeout=120,
    )
    assert completed.returncode == 0, completed.stderr
    *files, kernel_count = completed.stdout.split()
    assert all(Path(file).resolve().is_relative_to(target.resolve()) for file in files), files
    assert int(kernel_count) == len(_source_files("kernels_cu", KERNEL_SUFFIXES))


def test_installed_package_maps_the_subpackages(tmp_path: Path) -> None:
    # Run outside the checkout, so only the installation (editable or not) can resolve them.
    script = (
        "import sparsecore, sparsecore.torch, sparsecore.jax, sparsecore.kernels_cu\n"
        "for module in (sparsecore.torch, sparsecore.jax, sparsecore.kernels_cu):\n"
        "    print(module.__name__, module.__file__)\n"
    )
    completed = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path,
                               timeout=120)
    assert completed.returncode == 0, (
        "sparsecore's subpackages do not import from the installed package (install it with "
        f"python -m pip install -e \".[dev]\"):\n{completed.stderr}"
    )
    locations = dict(line.split(" ", 1) for line in completed.stdout.splitlines())
    allowed = {
        "sparsecore.torch": ("frontends/torch/__init__.py", "sparsecore/torch/__init__.py"),
        "sparsecore.jax": ("frontends/jax/__init__.py", "sparsecore/jax/__init__.py"),
        "sparsecore.kernels_cu": ("kernels_cu/__init__.py",),
    }
    for name, endings in allowed.items():
        assert Path(locations[name]).as_posix().endswith(endings), (name, locations[name])


def test_ci_runs_the_readme_commands() -> None:
    readme = (REPOSITORY / "README.md").read_text(encoding="utf-8")
    setup_section = readme.split("## Set up", 1)[1].split("\n## ", 1)[0]
    commands = [block.strip() for block in re.findall(r"```bash\n(.*?)```", setup_section, re.S)]
    assert len(commands) == 2, f"README's 'Set up' should hold two commands (install, test), got {commands}"
    ci_lines = [
        line.strip()
        for line in (REPOSITORY / ".ci" / "run").read_text(encoding="utf-8").splitlines()
        if line.strip() and not line.strip().startswith("#")
    ]
    assert ci_lines[-2:] == commands, f".ci/run should end with README's commands {commands}, got {ci_lines}"
