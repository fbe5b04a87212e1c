"""``noisecurve audit``: the report's lines, the exit status, one-line errors."""

from __future__ import annotations

import json

import pytest

from keras_noisecurve.apps.cli import main


def test_audit_prints_claim_bound_interval_and_verdict(tmp_path, capsys):
    out = tmp_path / "audit.json"
    rc = main(["audit", "--strategy", "dpsgd", "--canaries", "2000", "--epsilon", "4", "--json", str(out)])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "claimed epsilon:        4.0000" in text
    assert "95 % confidence interval for the achieved epsilon: [" in text
    assert "verdict: consistent" in text and "cannot certify privacy" in text
    assert "noise check: the C-whitened noise of 1000 probe coordinates is white" in text
    data = json.loads(out.read_text())
    assert 0 < data["epsilon_lower"] <= data["claimed_epsilon"]
    assert data["verdict"] == "consistent" and data["info"]["strategy"] == "dpsgd"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--delta", "2"], "--delta must lie in (0, 1), got 2.0"),
        (["--confidence", "1.5"], "--confidence must lie in (0, 1), got 1.5"),
        (["--canaries", "1"], "--canaries must be >= 2, got 1"),
        (["--strategy", "blt", "--sampling", "cyclic_poisson"], "--strategy blt needs --sampling fixed_epochs"),
        (["--bands", "64", "--canaries", "100"], "bands must be <= steps (16); got bands=64"),
    ],
)
def test_bad_configurations_give_one_line_errors(argv, message, capsys):
    rc = main(["audit", *argv])
    captured = capsys.readouterr()
    assert rc == 2
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("noisecurve audit: error: ") and message in lines[0], captured.err
    assert "Traceback" not in captured.err and captured.out == ""


def test_malformed_numbers_are_refused_by_the_parser(capsys):
    with pytest.raises(SystemExit) as info:
        main(["audit", "--canaries", "many"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "expected a positive integer, got 'many'" in err and "Traceback" not in err
