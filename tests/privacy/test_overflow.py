"""The overflow rule of the padded batch size: (1 + e^ε)·p ≤ δ/10, refused at construction
otherwise; the default padding meets it; the total δ is reported beside ε."""

import json
import math
import re

import pytest
from scipy import stats

from keras_noisecurve.apps.cli import main
from keras_noisecurve.privacy import accounting, overflow
from keras_noisecurve.privacy.run import PrivateRun

N, B, T, DELTA = 1000, 20, 100, 1e-6  # b = 1: q = 0.02, m = n + 1 = 1001 for the neighbour


def _run(**kw):
    args = dict(num_examples=N, batch_size=B, steps=T, noise_multiplier=1.0, delta=DELTA)
    args.update(kw)
    return PrivateRun(**args)


def _p(padded, *, n=N, batch=B, steps=T, bands=1):
    """The overflow union bound, computed here: T · P[Binomial(⌈n/b⌉ + 1, B·b/n) > P]."""
    m = -(-n // bands) + 1
    return min(1.0, steps * stats.binom.sf(padded, m, batch * bands / n))


def _smallest(epsilon, delta, **plan):
    allowed = 0.1 * delta / (1 + math.exp(epsilon))
    padded = 0
    while _p(padded, **plan) > allowed:
        padded += 1
    return padded


def test_the_smallest_passing_size_is_accepted_and_one_less_is_refused():
    eps = _run().epsilon()
    smallest = _smallest(eps, DELTA)
    assert smallest == overflow.smallest_allowed_padded_size(spec=_run().spec, epsilon=eps, delta=DELTA) == 53
    run = _run(max_batch_size=smallest)
    assert run.padded_batch_size == smallest
    assert run.overflow_probability == pytest.approx(_p(smallest), rel=1e-9)
    assert run.total_delta() <= 1.1 * DELTA
    with pytest.raises(ValueError) as info:
        _run(max_batch_size=smallest - 1)
    message = " ".join(str(info.value).split())
    assert f"max_batch_size={smallest - 1} has an overflow probability p = {_p(smallest - 1):.3g}" in message
    assert f"delta = {DELTA:g}" in message and "at most delta/10" in message
    assert f"Use max_batch_size >= {smallest} " in message


def test_a_padded_size_with_overflow_probability_one_is_refused():
    with pytest.raises(ValueError, match=r"max_batch_size=20 has an overflow probability p = 1 .*-DP, not "
                                         r"\(epsilon, delta = 1e-06\)-DP.*Use max_batch_size >= 53 "):
        _run(max_batch_size=B)
    with pytest.raises(ValueError, match=r"overflow_probability=0.001 \(padded batch size P = 41\) has an overflow "
                                         r"probability p = 0.000951.*Use max_batch_size >= 53 "):
        _run(overflow_probability=1e-3)
    assert _run(overflow_probability=1e-9).overflow_probability <= 1e-9  # within the rule: accepted


def test_a_calibrated_run_is_checked_at_its_epsilon():
    calibrated = dict(noise_multiplier=None, epsilon=8.0, accountant="rdp")  # RDP: a fast calibration
    run = _run(max_batch_size=_smallest(8.0, DELTA), **calibrated)
    assert run.total_delta() <= 1.1 * DELTA
    with pytest.raises(ValueError, match=rf"Use max_batch_size >= {_smallest(run.epsilon(), DELTA)} "):
        _run(max_batch_size=_smallest(8.0, DELTA) - 1, **calibrated)


def test_the_default_padding_is_raised_where_the_rule_needs_it():
    # σ = 0.45 over 100 steps: ε ≈ 14, so p ≤ 1e-12 would add (1 + e^ε)·p ≈ δ/2
    run = _run(noise_multiplier=0.45)
    eps = run.epsilon()
    old = accounting.padded_batch_size(spec=run.spec)  # the 1e-12 default alone
    assert (1 + math.exp(eps)) * _p(old) > 0.1 * DELTA
    assert run.padded_batch_size == _smallest(eps, DELTA) > old
    assert run.total_delta() <= 1.1 * DELTA
    # a run whose largest partition must be covered whole: P = ⌈n/b⌉ + 1 never overflows
    full = PrivateRun(num_examples=100, batch_size=90, steps=10, noise_multiplier=3.0, delta=1e-9)
    assert (full.padded_batch_size, full.overflow_probability, full.total_delta()) == (101, 0.0, 1e-9)


def test_the_default_needs_no_epsilon_where_a_cheap_bound_settles_the_rule():
    run = _run()
    assert run._ledger is None  # nothing computed: the RDP bound showed the rule holds
    assert run._epsilon_bound() >= run.epsilon()
    assert run.padded_batch_size == accounting.padded_batch_size(spec=run.spec)
    fixed = _run(sampling="fixed_epochs")
    assert (fixed.overflow_probability, fixed._ledger) == (0.0, None)


def test_total_delta_beside_epsilon_in_the_repr_and_the_cli(capsys):
    run = _run(noise_multiplier=None, epsilon=8.0, accountant="rdp", max_batch_size=_smallest(8.0, DELTA))
    total = DELTA + overflow.overflow_delta(epsilon=8.0, overflow_probability=run.overflow_probability)
    assert f"epsilon=8, delta=1e-06, total_delta={total:g})" in repr(run)
    plain = _run(noise_multiplier=None, epsilon=1.0, accountant="rdp")  # overflow term below δ's digits
    assert "total_delta" not in repr(plain) and "epsilon=1, delta=1e-06)" in repr(plain)

    args = ["calibrate", "--epsilon", "13", "--delta", "1e-6", "--num-examples", str(N), "--batch-size", str(B),
            "--steps", str(T), "--accountant", "rdp"]
    assert main(args + ["--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    calibrated = _run(noise_multiplier=out["noise_multiplier"], accountant="rdp")
    assert out["padded_batch_size"] == calibrated.padded_batch_size == _smallest(out["epsilon"], DELTA)
    assert out["total_delta"] == pytest.approx(calibrated.total_delta(), rel=1e-9) and out["total_delta"] <= 1.1e-6
    assert main(args) == 0
    text = capsys.readouterr().out
    assert re.search(r"total delta\s+: 1\.\d+e-06 \(delta \+ \(1\+e\^eps\)\*overflow\)", text)
    assert main(args + ["--overflow-probability", "1e-3"]) == 2
    assert "has an overflow probability" in capsys.readouterr().err


def test_the_rule_helpers_validate():
    assert overflow.allowed_overflow_probability(epsilon=0.0, delta=1e-5) == pytest.approx(5e-7)
    with pytest.raises(ValueError, match="delta"):
        overflow.allowed_overflow_probability(epsilon=1.0, delta=0.0)
    with pytest.raises(ValueError, match="cyclic_poisson' only"):
        overflow.smallest_allowed_padded_size(spec=_run(sampling="fixed_epochs").spec, epsilon=1.0, delta=1e-5)


def test_a_run_whose_epsilon_the_accountant_cannot_represent_pads_so_that_nothing_overflows():
    # sigma ~ 0 (a near noise-free test run): PLD cannot build its loss distribution, epsilon is
    # unbounded and any overflow breaks the rule: the padding never overflows (ceil(n/b) + 1)
    run = PrivateRun(num_examples=24, batch_size=12, steps=2, noise_multiplier=1e-9, delta=1e-5, seed=0)
    assert run.overflow_probability == 0.0
    assert run.padded_batch_size == 24 + 1
