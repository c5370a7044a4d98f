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
