"""sparsecore.demo's command line: the JAX demo's own options reach its parser; unknown options are refused."""

from __future__ import annotations

import pytest

from sparsecore import demo


def test_the_jax_demo_options_go_to_the_jax_parser(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = []
    monkeypatch.setattr(demo, "_jax_demo", lambda argv: seen.append(list(argv)) or 0)
    assert demo.main(["--frontend", "jax", "--impl", "callback", "--seed", "3"]) == 0
    assert seen == [["--frontend", "jax", "--impl", "callback", "--seed", "3"]]


def test_an_unknown_option_of_the_torch_demo_is_a_usage_error(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as raised:
        demo.main(["--impl", "callback"])
    assert raised.value.code == 2
    assert "unrecognized arguments: --impl callback" in capsys.readouterr().err


def _options(text: str) -> list[str]:
    """One entry per option of an argparse help text: its line and the help lines under it."""
    options: list[str] = []
    for line in text.split("options:", 1)[1].splitlines():
        if line.startswith("  -"):
            options.append(line.strip())
        elif line.startswith("   ") and options:
            options[-1] += " " + line.strip()
    return options


def test_help_explains_every_option_with_its_default(capsys: pytest.CaptureFixture,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "200")
    assert demo.main(["--help"]) == 0
    options = _options(capsys.readouterr().out)
    names = {option.split()[0].rstrip(",") for option in options}
    assert {"-h", "--points", "--device", "--frontend", "--seed", "--threads"} <= names, options
    for option in options:
        if option.startswith("-h"):
            continue
        flag, _, rest = option.partition(" ")
        assert "(default:" in option, option
        assert len(rest.split("(default:")[0].split()) >= 3, f"{flag} has no help text: {option}"


def test_help_with_the_jax_frontend_is_the_jax_demo_help(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = []
    monkeypatch.setattr(demo, "_jax_demo", lambda argv: seen.append(list(argv)) or 0)
    assert demo.main(["--frontend", "jax", "--help"]) == 0
    assert seen == [["--frontend", "jax", "--help"]]
