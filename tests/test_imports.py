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
