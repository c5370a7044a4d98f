"""Every install hint the package prints or documents names the distribution setup.cfg declares.

"sparsecore" on the package index is an unrelated placeholder, so a hint such as
``pip install 'sparsecore[torch]'`` would install the wrong package (issue 40). The oracle is
setup.cfg itself, parsed with configparser: its ``name`` and its ``extras_require`` keys.
"""

from __future__ import annotations

import configparser
import re
from pathlib import Path

REPOSITORY = Path(__file__).resolve().parents[1]
SCANNED_DIRECTORIES = ("sparsecore", "frontends", "examples", "tools", "docs")
SCANNED_SUFFIXES = (".py", ".md", ".sh", ".cfg", ".toml")
# A requirement that names this project, with its extras: sparsecore[...] or sparsecore-anything[...];
# or a quoted local or bare extra ('.[dev]', '[cuda12]', as in "pip install '.[torch]'").
PROJECT_REQUIREMENT = re.compile(
    r"(?<![\w./-])(?P<name>sparsecore(?:[-_][\w-]+)?)\[(?P<extras>[\w\s,-]+)\]"
    r"|(?<=['\"])\.?\[(?P<local_extras>[a-z][a-z0-9_,\s-]*)\](?=['\"])"  # lowercase: not '[N, C]'
)
PIP_INSTALL = re.compile(r"pip install ([^`\n)]*)")


def _declared() -> tuple[str, set[str]]:
    parser = configparser.ConfigParser()
    parser.read(REPOSITORY / "setup.cfg", encoding="utf-8")
    return parser["metadata"]["name"], set(parser["options.extras_require"].keys())


def _scanned_files() -> list[Path]:
    files = [REPOSITORY / "README.md"]
    for directory in SCANNED_DIRECTORIES:
        files.extend(
            path for path in sorted((REPOSITORY / directory).rglob("*"))
            if path.is_file() and path.suffix in SCANNED_SUFFIXES and "__pycache__" not in path.parts
        )
    return files


def _hints(text: str) -> list[tuple[str | None, list[str]]]:
    """(distribution, or None for a local/bare extra, and its extras) of every project requirement in ``text``."""
    found = []
    for match in PROJECT_REQUIREMENT.finditer(text):
        extras = match.group("extras") or match.group("local_extras")
        found.append((match.group("name"), [extra.strip() for extra in extras.split(",")]))
    return found


def test_the_parser_sees_a_wrong_hint() -> None:
    # the scanner itself: a wrong name and an undeclared extra are found
    assert _hints("pip install 'sparsecore[torch]'") == [("sparsecore", ["torch"])]
    assert _hints("pip install '.[dev]' or '[cuda12]'") == [(None, ["dev"]), (None, ["cuda12"])]
    assert _hints("x = values[index]; a[0]") == []


def test_every_install_hint_names_the_declared_distribution() -> None:
    distribution, extras = _declared()
    assert distribution == "sparsecore-conv", distribution
    wrong = []
    for path in _scanned_files():
        text = path.read_text(encoding="utf-8", errors="replace")
        for name, hint_extras in _hints(text):
            if name is not None and name != distribution:
                wrong.append(f"{path.relative_to(REPOSITORY)}: names {name!r}, not {distribution!r}")
            undeclared = sorted(set(hint_extras) - extras)
            if undeclared:
                wrong.append(f"{path.relative_to(REPOSITORY)}: extras {undeclared} not in setup.cfg {sorted(extras)}")
    assert not wrong, "\n".join(wrong)


def test_no_pip_install_of_the_placeholder() -> None:
    # a bare `pip install sparsecore` (no extras) installs the placeholder too
    wrong = []
    for path in _scanned_files():
        for command in PIP_INSTALL.findall(path.read_text(encoding="utf-8", errors="replace")):
            command = command.split(" #", 1)[0]  # a shell comment after the command names no package
            for token in command.replace("'", " ").replace('"', " ").split():
                base = re.split(r"[\[<>=!~]", token, maxsplit=1)[0]
                if base.startswith("sparsecore") and base != _declared()[0]:
                    wrong.append(f"{path.relative_to(REPOSITORY)}: pip install {command}")
    assert not wrong, "\n".join(wrong)

