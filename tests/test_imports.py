"""Importing sparsecore and convolving on the CPU pulls in no array framework."""

from __future__ import annotations

import subprocess
import sys
import textwrap

FRAMEWORKS = ("torch", "jax", "jaxlib", "cupy", "cupy_backends")

CPU_CONVOLUTION = textwrap.dedent(
    """
    import sys
    import numpy as np
    import sparsecore as sc

    generator = np.random.default_rng(0)
    spatial_shape = (8, 16, 16)
    flat = generator.choice(int(np.prod(spatial_shape)), size=200, replace=False)
    indices = np.column_stack([np.zeros(200, dtype=np.int64), *np.unravel_index(flat, spatial_shape)]).astype(np.int32)
    features = generator.standard_normal((200, 4)).astype(np.float32)
    x = sc.SparseTensor(features, indices, spatial_shape, 1)
    y = sc.sparse_conv(x, generator.standard_normal((8, 3, 3, 3, 4)).astype(np.float32), kind="subm", indice_key="s1")
    z = sc.sparse_conv(y, generator.standard_normal((8, 3, 3, 3, 8)).astype(np.float32), stride=2, padding=1)
    assert y.num_active == 200 and z.spatial_shape == (4, 8, 8), (y.num_active, z.spatial_shape)
    dense = z.dense()
    assert dense.shape == (1, 8, 4, 8, 8), dense.shape
    frameworks = {FRAMEWORKS!r}
    loaded = sorted(name for name in sys.modules if name.split(".", 1)[0] in frameworks)
    print("LOADED:" + ",".join(loaded))
    """
).replace("{FRAMEWORKS!r}", repr(FRAMEWORKS))


def _run(script: str) -> str:
    completed = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert completed.returncode == 0, completed.stderr
    (line,) = [line for line in completed.stdout.splitlines() if line.startswith("LOADED:")]
    return line.removeprefix("LOADED:")


def test_cpu_convolution_imports_no_framework() -> None:
    loaded = _run(CPU_CONVOLUTION)
    assert loaded == "", f"importing sparsecore and convolving on the CPU imported: {loaded}"


def test_kernel_sources_and_benchmark_packages_import_no_framework() -> None:
    script = textwrap.dedent(
        f"""
        import sys
        import sparsecore.kernels_cu, sparsecore.benchmark, sparsecore._dispatch
        frameworks = {FRAMEWORKS!r}
        print("LOADED:" + ",".join(sorted(n for n in sys.modules if n.split(".", 1)[0] in frameworks)))
        """
    )
    loaded = _run(script)
    assert loaded == "", f"imported: {loaded}"


# A process where a framework is not installed: a meta-path finder answers "no such module" for it first.
_WITHOUT = textwrap.dedent(
    """
    import sys

    class Missing:
        def find_spec(self, name, path=None, target=None):
            if name == MISSING or name.startswith(MISSING + "."):
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None

    sys.meta_path.insert(0, Missing())
    """
)


def _without(framework: str, code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", f"MISSING = {framework!r}\n" + _WITHOUT + textwrap.dedent(code)],
                          capture_output=True, text=True, timeout=120)


def _without_torch(code: str) -> subprocess.CompletedProcess:
    return _without("torch", code)


def test_import_sparsecore_torch_without_torch_names_the_extra() -> None:
    completed = _without_torch(
        """
        try:
            import sparsecore.torch
        except ModuleNotFoundError as error:
            assert error.name == "torch", error.name
            print("MESSAGE:" + str(error))
        """
    )
    assert completed.returncode == 0, completed.stderr
    message = completed.stdout.split("MESSAGE:", 1)[1]
    assert "pip install 'sparsecore-conv[torch]'" in message and "PyTorch" in message, message


def test_the_demo_without_torch_names_the_extra_in_one_line() -> None:
    completed = _without_torch(
        """
        import runpy
        runpy.run_module("sparsecore.demo", run_name="__main__")
        """
    )
    assert completed.returncode == 2, completed.stderr
    message = completed.stderr.strip()
    assert "Traceback" not in message and message.count("\n") == 0, message
    assert message.startswith("error: ") and "pip install 'sparsecore-conv[torch]'" in message, message


def test_import_sparsecore_jax_without_jax_names_the_extra() -> None:
    completed = _without(
        "jax",
        """
        try:
            import sparsecore.jax
        except ModuleNotFoundError as error:
            assert error.name == "jax", error.name
            print("MESSAGE:" + str(error))
        """
    )
    assert completed.returncode == 0, completed.stderr
    message = completed.stdout.split("MESSAGE:", 1)[1]
    assert "pip install 'sparsecore-conv[jax]'" in message and "JAX" in message, message


def test_the_jax_demo_without_jax_names_the_extra_in_one_line() -> None:
    completed = _without(
        "jax",
        """
        import sys
        import runpy
        sys.argv = ["demo", "--frontend", "jax"]
        runpy.run_module("sparsecore.demo", run_name="__main__")
        """
    )
    assert completed.returncode == 2, completed.stderr
    message = completed.stderr.strip()
    assert "Traceback" not in message and message.count("\n") == 0, message
    assert message.startswith("error: ") and "pip install 'sparsecore-conv[jax]'" in message, message


def test_without_torch_the_core_still_convolves() -> None:
    completed = _without_torch(CPU_CONVOLUTION)
    assert completed.returncode == 0, completed.stderr
    assert "LOADED:" in completed.stdout
