"""sparsecore._compile_notice: one line on stderr at the first compile of a sparsecore kernel in a process.

Oracle: fresh processes with an empty numba cache (``NUMBA_CACHE_DIR``), whose stderr is read whole:
the first compile logs one line naming the cache folder, a second compile nothing, a process that loads
every kernel from the cache nothing, and a silenced ``sparsecore`` logger nothing.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# two compiles of one cheap kernel (two signatures), then a kernel of another module
_COMPILE_TWICE = """
import logging, sys
import numpy as np
if sys.argv[1] == "silenced":
    logging.getLogger("sparsecore").setLevel(logging.ERROR)
from sparsecore.backends import _rulebook_kernels
kernels = _rulebook_kernels._sources()
for dtype in (np.int64, np.int32):
    keys = np.array([3, 1, 3, 2], dtype=dtype)
    order = np.argsort(keys, kind="stable")
    unique, inverse = kernels.unique_inverse_sorted(keys[order], order)
    assert unique.tolist() == [1, 2, 3] and inverse.tolist() == [2, 0, 2, 1]
print("done")
"""


def _run(cache: Path, mode: str = "plain") -> subprocess.CompletedProcess:
    environment = dict(os.environ, NUMBA_CACHE_DIR=str(cache), PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-c", _COMPILE_TWICE, mode], capture_output=True, text=True,
                          timeout=300, env=environment, cwd=ROOT)


@pytest.mark.slow
def test_the_first_compile_says_so_once_and_a_cached_run_says_nothing(tmp_path: Path) -> None:
    first = _run(tmp_path)
    assert first.returncode == 0 and first.stdout == "done\n", first.stderr
    lines = first.stderr.splitlines()
    assert len(lines) == 1, first.stderr
    assert lines[0].startswith("sparsecore: compiling CPU kernels on first use") and str(tmp_path) in lines[0]
    assert any(tmp_path.rglob("*.nbi")), "numba wrote no cache index there"
    again = _run(tmp_path)  # both signatures load from the cache: nothing compiles, nothing is said
    assert again.returncode == 0 and again.stdout == "done\n" and again.stderr == "", again.stderr


@pytest.mark.slow
def test_the_notice_goes_through_the_sparsecore_logger(tmp_path: Path) -> None:
    silenced = _run(tmp_path, "silenced")
    assert silenced.returncode == 0 and silenced.stdout == "done\n" and silenced.stderr == "", silenced.stderr
    assert any(tmp_path.rglob("*.nbi")), "it compiled (and cached) all the same"


def test_the_notice_names_the_cache_folder_or_says_there_is_none() -> None:
    from sparsecore._compile_notice import cache_folder, notice

    class Cached:
        class _cache:  # noqa: N801 - numba's attribute name
            _cache_path = "/some/folder"

    assert notice(cache_folder(Cached())).endswith("cached in /some/folder)")
    # the measured first compile, not a bare "seconds"
    from sparsecore._compile_notice import FIRST_COMPILE_CPU_SECONDS

    assert f"about {FIRST_COMPILE_CPU_SECONDS} s of CPU time" in notice("/x") and 5 <= FIRST_COMPILE_CPU_SECONDS <= 120
    assert "\n" not in notice(cache_folder(object()))
    assert "nowhere" in cache_folder(object())
