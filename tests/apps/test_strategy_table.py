"""keras_noisecurve.apps.strategy_table: one row per strategy kind, checked against the
strategy classes themselves (their ``kind``, size attributes and ``banded`` flag)."""

from __future__ import annotations

import argparse

import numpy as np
import pytest

from keras_noisecurve.apps import cli_solve
from keras_noisecurve.apps.strategy_table import AUDIT_KINDS, KINDS, SOLVE_KINDS, kind_of, options_for
from keras_noisecurve.mixing import STRATEGIES, solve_mixing_matrix

STEPS = 12


def _solved(kind):
    size = {"--bands": {"bands": 3}, "--buffers": {"buffers": 2}}[options_for(kind).size_option]
    return solve_mixing_matrix(steps=STEPS, strategy=kind, objective="bandmf", **size)


def test_solvable_kinds_are_the_library_strategies_in_order():
    assert SOLVE_KINDS == tuple(STRATEGIES)
    assert set(AUDIT_KINDS) - set(SOLVE_KINDS) == {"dpsgd"}


@pytest.mark.parametrize("kind", SOLVE_KINDS)
def test_row_reads_the_solved_strategy(kind):
    mixing = _solved(kind)
    row = kind_of(mixing)
    assert row is KINDS[kind] and mixing.kind == kind
    expected = {"--bands": 3, "--buffers": 2}[row.size_option]
    assert row.size(mixing) == expected
    assert row.size_text(mixing).endswith(f" = {expected}")
    # a banded C is amplified by cyclic Poisson sampling; the others are not
    assert ("cyclic_poisson" in row.samplings) == bool(mixing.banded) or not row.audit
    if not row.matrix_file:
        lines = row.parameter_lines(mixing)
        assert lines and all(line.startswith("  ") for line in lines)


def test_blt_parameters_show_theta_and_omega():
    mixing = _solved("blt")
    text = "\n".join(options_for("blt").parameter_lines(mixing))
    assert f"{mixing.theta[0]:.6g}" in text and f"{mixing.omega[-1]:.6g}" in text


def test_every_kind_only_option_is_taken_by_some_kind_and_passed_through():
    taken = set().union(*(KINDS[k].options for k in SOLVE_KINDS))
    assert taken == set(cli_solve._ONLY_FOR.values())
    update_rule_options = {"momentum", "schedule", "cooldown_fraction"}
    for kind in SOLVE_KINDS:
        row = KINDS[kind]
        passed = set(row.solve_arguments) | set(row.optional_solve_arguments)
        # every option a kind takes reaches the solver, directly or through the update rule
        assert row.options <= passed | (update_rule_options if row.update_rule else set()), kind
        assert passed <= row.options, kind  # and nothing it refuses is passed


def test_solve_kwargs_fill_defaults_and_leave_out_absent_optionals():
    args = argparse.Namespace(bands=4, buffers=None, participations=None, separation=None, tol=None,
                              max_iterations=None)
    assert options_for("banded").solve_kwargs(args) == {"bands": 4, "tol": 1e-6, "max_iterations": 10_000}
    assert options_for("toeplitz").solve_kwargs(args) == {"bands": 4, "max_iterations": None}
    args.tol = 1e-3
    assert options_for("toeplitz").solve_kwargs(args) == {"bands": 4, "max_iterations": None, "tol": 1e-3}
    assert options_for("bisr").solve_kwargs(args) == {"bands": 4}


def test_unknown_kind_is_one_line():
    with pytest.raises(ValueError, match=r"unknown strategy kind 'fir'; known: dpsgd, banded"):
        options_for("fir")
    assert np.isfinite(_solved("bisr").sensitivity())
