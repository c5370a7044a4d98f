"""The docs stay true: complete API reference, runnable code blocks, generated files up to date."""

from __future__ import annotations

import importlib
import importlib.util
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PACKAGES = ("sparsecore", "sparsecore.torch", "sparsecore.jax")
REFERENCE_FILES = ("api.md", "reference_core.md", "reference_torch.md", "reference_jax.md")
GENERATED = ("reference_core.md", "reference_torch.md", "reference_jax.md")
RUNNABLE = (ROOT / "README.md", *sorted(DOCS.glob("*.md")))
FENCE = re.compile(r"^```python[ \t]*\n(.*?)^```", re.MULTILINE | re.DOTALL)
ANY_PYTHON_FENCE = re.compile(r"^```(?:py|python)\b.*$", re.MULTILINE)


def _env() -> dict[str, str]:
    path = os.pathsep.join(part for part in (str(ROOT), os.environ.get("PYTHONPATH", "")) if part)
    return dict(os.environ, PYTHONPATH=path, MPLBACKEND="Agg", JAX_PLATFORMS="cpu",
                OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")


def _page_scripts() -> list[tuple[str, str]]:
    """``(page, script)``: each page's ```python blocks joined in order, for pages that have any."""
    pages = []
    for path in RUNNABLE:
        blocks = [match.group(1) for match in FENCE.finditer(path.read_text(encoding="utf-8"))]
        if blocks:
            pages.append((str(path.relative_to(ROOT)), "\n".join(blocks)))
    return pages


def _needs(code: str) -> list[str]:
    wanted = {"torch": "import torch" in code or "sparsecore.torch" in code,
              "jax": "import jax" in code or "sparsecore.jax" in code,
              "onnx": "sparsecore.runtime" in code or "export_onnx" in code}
    return [name for name, used in wanted.items() if used]


def _run_page(code: str) -> subprocess.CompletedProcess:
    """The page's blocks, verbatim, top to bottom, in a fresh process started in the repository root."""
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=_env(), capture_output=True, text=True,
                          timeout=600)


@pytest.mark.parametrize("package", PACKAGES)
def test_every_public_name_is_in_the_reference(package: str) -> None:
    if package != "sparsecore":
        pytest.importorskip(package.split(".")[1])
    module = importlib.import_module(package)
    text = "\n".join((DOCS / name).read_text(encoding="utf-8") for name in REFERENCE_FILES)
    # as code (`name`, `pkg.name(...)`) or as a section title, not merely as a word in prose
    missing = [name for name in module.__all__
               if not re.search(rf"(?:`|^#+ )(?:[\w.]+\.)?{re.escape(name)}(?!\w)", text, re.MULTILINE)]
    assert not missing, f"public names of {package} missing from docs/{{{','.join(REFERENCE_FILES)}}}: {missing}"


def test_hand_written_core_api_covers_every_core_name() -> None:
    import sparsecore

    text = (DOCS / "api.md").read_text(encoding="utf-8")
    missing = [name for name in sparsecore.__all__
               if not re.search(rf"`(?:[\w.]+\.)?{re.escape(name)}(?!\w)", text)]
    assert not missing, f"docs/api.md does not mention: {missing}"


def test_every_python_block_of_the_docs_runs_page_by_page() -> None:
    pages = _page_scripts()
    names = [page for page, _ in pages]
    for page in ("README.md", "docs/getting_started.md", "docs/api.md", "docs/jax.md", "docs/deployment.md",
                 "docs/quantization.md"):
        assert page in names, f"{page} has no ```python block (names: {names})"
    runnable, skipped = [], []
    for page, code in pages:
        absent = [name for name in _needs(code) if importlib.util.find_spec(name) is None]
        (skipped if absent else runnable).append((page, code))
    # In parallel: the pages are independent processes (each writes only under runs/docs/, git-ignored).
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(lambda item: _run_page(item[1]), runnable))
    failures = [f"{page} failed ({result.returncode}):\n--- stdout\n{result.stdout}\n--- stderr\n{result.stderr}"
                for (page, _), result in zip(runnable, results) if result.returncode != 0]
    assert not failures, "\n\n".join(failures)
    if skipped:
        pytest.skip(f"ran {len(runnable)} pages; skipped (framework not installed): {[p for p, _ in skipped]}")


def test_only_runnable_code_is_fenced_as_python() -> None:
    """Signature listings and pseudo-code use other fences (```text), so every ```python block is run above."""
    odd = [f"{path.relative_to(ROOT)}: {line!r}" for path in RUNNABLE
           for line in ANY_PYTHON_FENCE.findall(path.read_text(encoding="utf-8")) if line.strip() != "```python"]
    assert not odd, odd
    generated = [name for name in GENERATED if "```python" in (DOCS / name).read_text(encoding="utf-8")]
    assert not generated, f"docs/{generated} fence signatures as python: run python docs/generate_reference.py"


def test_generated_reference_is_up_to_date(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    pytest.importorskip("jax")
    result = subprocess.run([sys.executable, str(DOCS / "generate_reference.py"), str(tmp_path)], cwd=tmp_path,
                            env=_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    # Compare the stable lines (headings and the name / kind / summary index, all from our
    # own code and docstrings); signature lines hold library reprs (e.g. of jax dtypes) that
    # another torch or JAX release may print differently.
    def stable(text: str) -> list[str]:
        return [line for line in text.splitlines() if line.startswith(("#", "| [`"))]

    stale = [name for name in GENERATED
             if stable((tmp_path / name).read_text(encoding="utf-8"))
             != stable((DOCS / name).read_text(encoding="utf-8"))]
    assert not stale, f"docs/{stale} are stale: run `python docs/generate_reference.py`"


LINKED_PAGES = (ROOT / "README.md", *sorted(DOCS.glob("*.md")), ROOT / "examples" / "README.md",
                ROOT / "tools" / "README.md", ROOT / "data" / "README.md")


def _anchors(page: Path) -> set[str]:
    """The anchors GitHub gives ``page``'s headings (code blocks left out): lower case, punctuation
    dropped, spaces to hyphens, ``-1``, ``-2``, ... on repeats."""
    text = re.sub(r"^```.*?^```", "", page.read_text(encoding="utf-8"), flags=re.MULTILINE | re.DOTALL)
    anchors: set[str] = set()
    for heading in re.findall(r"^#{1,6}[ \t]+(.+?)[ \t#]*$", text, re.MULTILINE):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        candidate, repeat = slug, 0
        while candidate in anchors:
            repeat += 1
            candidate = f"{slug}-{repeat}"
        anchors.add(candidate)
    return anchors


def test_doc_links_point_to_existing_files_and_headings() -> None:
    """Every relative link between the pages resolves: the file exists and, for ``page.md#anchor``,
    the page has that heading (pages get split and sections move; a link must move with them)."""
    link = re.compile(r"\]\(([^)\s]*)\)")
    broken = []
    for page in [path for path in LINKED_PAGES if path.exists()]:
        text = re.sub(r"^```.*?^```", "", page.read_text(encoding="utf-8"), flags=re.MULTILINE | re.DOTALL)
        for target in link.findall(text):
            if "://" in target or target.startswith("mailto:"):
                continue
            path_part, _, anchor = target.partition("#")
            resolved = (page.parent / path_part) if path_part else page
            if not resolved.exists():
                broken.append(f"{page.relative_to(ROOT)} -> {target} (no such file)")
            elif anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved):
                broken.append(f"{page.relative_to(ROOT)} -> {target} (no such heading)")
    assert not broken, broken


def test_readme_is_read_in_five_minutes() -> None:
    """The front door stays short (issue 40: about 1,200 words at most, counted as ``wc -w`` does)."""
    words = len((ROOT / "README.md").read_text(encoding="utf-8").split())
    assert words <= 1200, f"README.md has {words} words; move detail to docs/ (at most 1,200)"


def test_readme_speed_table_numbers_come_from_the_benchmarks_page() -> None:
    """Every number in the README's speed table appears in docs/benchmarks.md (copied, never retyped)."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = readme.split("## Speed", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("|") and not line.startswith("| ---")][1:]
    assert rows, "README.md's Speed section has no table"
    benchmarks = (DOCS / "benchmarks.md").read_text(encoding="utf-8")
    for row in rows:
        for cell in row.strip("|").split("|")[1:]:
            for number in re.findall(r"\d[\d.,]*x?", cell):
                assert number in benchmarks, f"README speed table: {number!r} ({row.strip()}) is not in docs/benchmarks.md"
