"""``noisecurve solve`` and ``noisecurve inspect``: round trips, tampering, bad input.

The expected errors printed by ``inspect --json`` are checked against dense numpy
computations of Tr(W (CᵀC)⁻¹) with W built here from its definition (docs/mixing.md §2),
not against the library's own ``objective_value``.
"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from keras_noisecurve.apps.cli import main
from keras_noisecurve.mixing import MixingMatrix
from keras_noisecurve.spectrum.artifact import Spectrum

STEPS, BANDS = 12, 3
ETA = 0.5


# ------------------------------------------------------------------ references
def _prefix_workload(steps):
    a = np.tril(np.ones((steps, steps)))
    return a.T @ a


def _noisecurve_workload(eigenvalues, steps, eta):
    """W = VᵀMV, V[i, j] = (1 − ημ_i)^{T−j−1} (paper eq. 1), dense, one row per eigenvalue."""
    mu = np.asarray(eigenvalues, dtype=float)
    v = (1.0 - eta * mu)[:, None] ** (steps - 1 - np.arange(steps))[None, :]
    return v.T @ (mu[:, None] * v)


def _trace_objective(dense_c, workload):
    return float(np.trace(workload @ np.linalg.inv(dense_c.T @ dense_c)))


def _run(capsys, argv):
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def _run_exit(capsys, argv):
    """Run argv; argparse errors raise SystemExit, user errors return 2: both give the code."""
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


# --------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("mixing_cli")


@pytest.fixture(scope="module")
def eigenvalues():
    return 1.0 / np.arange(1, 41)


@pytest.fixture(scope="module")
def spectrum_file(workdir, eigenvalues):
    path = workdir / "spectrum.npz"
    Spectrum(eigenvalues).save(path)
    return path


@pytest.fixture(scope="module")
def bandmf_file(workdir):
    path = workdir / "bandmf.npz"
    code = main(["solve", "--steps", str(STEPS), "--bands", str(BANDS), "--objective", "bandmf",
                 "--out", str(path), "--quiet"])
    assert code == 0
    return path


@pytest.fixture(scope="module")
def noisecurve_file(workdir, spectrum_file):
    path = workdir / "noisecurve.npz"
    code = main(["solve", "--steps", str(STEPS), "--bands", str(BANDS), "--objective", "noisecurve",
                 "--spectrum", str(spectrum_file), "--learning-rate", str(ETA), "--tol", "1e-4",
                 "--out", str(path), "--quiet"])
    assert code == 0
    return path


# ------------------------------------------------------------------ round trips
def test_solve_prints_summary_and_saves_valid_file(capsys, workdir):
    out_path = workdir / "summary.npz"
    code, out, err = _run(capsys, ["solve", "--steps", "12", "--bands", "3", "--objective", "bandmf",
                                   "--out", str(out_path)])
    assert code == 0, err
    mixing = MixingMatrix.load(out_path)
    assert (mixing.steps, mixing.bands) == (12, 3)
    meta = mixing.metadata
    assert meta["objective"] == "bandmf"
    # the loss it reports is Tr(AᵀA X⁻¹) of the saved C (dense reference)
    dense_loss = _trace_objective(mixing.to_dense(), _prefix_workload(12))
    assert meta["loss"] == pytest.approx(dense_loss, rel=1e-9)
    assert f"{meta['loss']:.6g}" in out
    assert "DP-SGD" in out and "DP-BandMF" in out
    ratio = meta["loss"] / meta["baseline_losses"]["dpsgd"]
    assert f"this C / baseline = {ratio:.4f}" in out
    assert "running-sum std peak" in out and "condition number" in out
    assert "solver: converged" in out and f"{meta['solver']['iterations']} iterations" in out
    assert str(out_path) in out


def test_solve_quiet_prints_nothing(capsys, workdir):
    code, out, err = _run(capsys, ["solve", "--steps", "6", "--bands", "2", "--objective", "bandmf",
                                   "--out", str(workdir / "quiet.npz"), "--quiet"])
    assert code == 0, err
    assert out == ""


def test_inspect_bandmf_recomputes_against_dense(capsys, bandmf_file, monkeypatch):
    from keras_noisecurve.apps import cli_inspect

    monkeypatch.setattr(cli_inspect, "_ANNOUNCE_REFERENCE_STEPS", STEPS)
    code, out, err = _run(capsys, ["inspect", str(bandmf_file), "--json"])
    assert code == 0, err
    assert "solving the DP-BandMF reference" in err  # progress note on stderr, JSON on stdout intact
    doc = json.loads(out)
    mixing = MixingMatrix.load(bandmf_file)
    dense = mixing.to_dense()
    workload = _prefix_workload(STEPS)
    expected = doc["expected_error"]
    assert expected["source"] == "recomputed" and expected["objective"] == "bandmf"
    assert expected["loss"] == pytest.approx(_trace_objective(dense, workload), rel=1e-9)
    assert expected["dpsgd"] == pytest.approx(STEPS * (STEPS + 1) / 2, rel=1e-12)  # Tr(AᵀA)
    # the reference is the DP-BandMF C solved again: the same problem, the same optimum
    assert expected["ratio_vs_bandmf"] == pytest.approx(1.0, abs=1e-5)
    assert doc["column_norms"]["all_within_tolerance"] is True
    np.testing.assert_allclose(doc["column_norms"]["max"], np.linalg.norm(dense, axis=0).max(), rtol=1e-12)
    inverse = np.linalg.inv(dense)
    np.testing.assert_allclose(doc["diagnostics"]["step_std"], np.linalg.norm(inverse, axis=1), rtol=1e-9)
    prefix = np.linalg.norm(np.tril(np.ones((STEPS, STEPS))) @ inverse, axis=1)
    np.testing.assert_allclose(doc["diagnostics"]["prefix_std"], prefix, rtol=1e-9)
    assert doc["diagnostics"]["condition_number"] == pytest.approx(np.linalg.cond(dense), rel=1e-8)
    assert doc["metadata"]["objective"] == "bandmf"


def test_inspect_noisecurve_stored_then_recomputed(capsys, noisecurve_file, spectrum_file, eigenvalues):
    mixing = MixingMatrix.load(noisecurve_file)
    meta = mixing.metadata
    assert meta["objective"] == "noisecurve" and meta["learning_rate"] == pytest.approx(ETA)

    # without the spectrum: the stored values, and the report says so
    code, out, err = _run(capsys, ["inspect", str(noisecurve_file), "--json", "--no-reference"])
    assert code == 0, err
    stored = json.loads(out)["expected_error"]
    assert stored["source"] == "stored"
    assert "--spectrum" in stored["note"]
    assert stored["loss"] == meta["loss"]
    assert stored["bandmf"] == meta["baseline_losses"]["bandmf"]

    code, out, err = _run(capsys, ["inspect", str(noisecurve_file)])
    assert code == 0, err
    assert "(stored)" in out and "--spectrum FILE" in out

    # with the spectrum: recomputed, equal to the dense eq.-1 objective
    code, out, err = _run(capsys, ["inspect", str(noisecurve_file), "--json", "--spectrum", str(spectrum_file)])
    assert code == 0, err
    doc = json.loads(out)
    rec = doc["expected_error"]
    assert rec["source"] == "recomputed"
    workload = _noisecurve_workload(eigenvalues, STEPS, ETA)
    assert rec["loss"] == pytest.approx(_trace_objective(mixing.to_dense(), workload), rel=1e-8)
    assert rec["dpsgd"] == pytest.approx(np.trace(workload), rel=1e-10)
    assert rec["loss"] == pytest.approx(meta["loss"], rel=1e-8)
    # both are the DP-BandMF C, solved to different tolerances (1e-4 there, 1e-6 here)
    assert rec["bandmf"] == pytest.approx(meta["baseline_losses"]["bandmf"], rel=1e-3)
    # the curvature-aware C beats both baselines under its own objective
    assert rec["ratio_vs_dpsgd"] < 1.0 and rec["ratio_vs_bandmf"] < 1.0
    ref_prefix = doc["reference_diagnostics"]["prefix_std_max"]
    assert doc["diagnostics"]["excursion_vs_bandmf"] == pytest.approx(
        doc["diagnostics"]["prefix_std_max"] / ref_prefix, rel=1e-12
    )


def test_inspect_evaluates_under_another_objective(capsys, noisecurve_file, bandmf_file):
    code, out, err = _run(capsys, ["inspect", str(noisecurve_file), "--json", "--objective", "bandmf",
                                   "--reference", str(bandmf_file)])
    assert code == 0, err
    rec = json.loads(out)["expected_error"]
    dense = MixingMatrix.load(noisecurve_file).to_dense()
    assert rec["objective"] == "bandmf" and rec["source"] == "recomputed"
    assert rec["loss"] == pytest.approx(_trace_objective(dense, _prefix_workload(STEPS)), rel=1e-9)
    ref_dense = MixingMatrix.load(bandmf_file).to_dense()
    assert rec["bandmf"] == pytest.approx(_trace_objective(ref_dense, _prefix_workload(STEPS)), rel=1e-9)
    # under the prefix-sum workload DP-BandMF is optimal
    assert rec["ratio_vs_bandmf"] >= 1.0 - 1e-6


def test_inspect_plot(capsys, noisecurve_file, bandmf_file, workdir):
    for extra, name in ((["--reference", str(bandmf_file)], "with_ref.png"), (["--no-reference"], "no_ref.png")):
        png = workdir / name
        code, out, err = _run(capsys, ["inspect", str(noisecurve_file), "--plot", str(png)] + extra)
        assert code == 0, err
        data = png.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
        assert f"plot written to {png}" in out


def test_block_image_of_large_c_is_the_block_maximum():
    from keras_noisecurve.apps.cli_inspect_plot import abs_image

    rng = np.random.default_rng(5)
    steps, bands = 23, 3
    raw = np.tril(rng.uniform(0.1, 1.0, (steps, steps))) * (np.subtract.outer(np.arange(steps), np.arange(steps)) < bands)
    dense = raw / np.linalg.norm(raw, axis=0)
    image, k = abs_image(MixingMatrix.from_dense(dense, bands=bands), max_pixels=5)
    assert k == 5 and image.shape == (5, 5)
    padded = np.zeros((25, 25))
    padded[:steps, :steps] = np.abs(dense)
    np.testing.assert_array_equal(image, padded.reshape(5, 5, 5, 5).max(axis=(1, 3)))


# --------------------------------------------------------------------- tampering
def _resave_with(path, new_path, edit):
    with np.load(path, allow_pickle=False) as data:
        fields = {k: data[k] for k in data.files}
    fields["band_values"] = edit(fields["band_values"].copy())
    with open(new_path, "wb") as f:
        np.savez(f, **fields)


@pytest.mark.parametrize(
    "edit, message",
    [
        # breaks the unit column norm of column 2 (C[3, 2] = band_values[3, 1])
        (lambda bv: (bv.__setitem__((3, 1), bv[3, 1] + 0.01), bv)[1], "norm"),
        # a sign flip keeps every column norm: only the digest catches it
        (lambda bv: (bv.__setitem__((3, 1), -bv[3, 1]), bv)[1], "digest"),
    ],
)
def test_inspect_rejects_tampered_file(capsys, bandmf_file, workdir, edit, message):
    bad = workdir / f"tampered_{message}.npz"
    _resave_with(bandmf_file, bad, edit)
    code, out, err = _run_exit(capsys, ["inspect", str(bad)])
    assert code == 2
    assert "noisecurve inspect: error: invalid mixing-matrix file" in err
    assert message in err
    assert "Traceback" not in err
    assert out == ""


# -------------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    "argv, message",
    [
        (["solve", "--bands", "2", "--objective", "bandmf"], "--steps"),
        (["solve", "--steps", "ten", "--bands", "2", "--objective", "bandmf"], "invalid int value"),
        (["solve", "--steps", "8", "--bands", "2", "--objective", "sgd"], "invalid choice"),
        (["solve", "--steps", "8", "--bands", "0", "--objective", "bandmf"], "--bands must satisfy"),
        (["solve", "--steps", "8", "--bands", "9", "--objective", "bandmf"], "--bands must satisfy"),
        (["solve", "--steps", "0", "--bands", "1", "--objective", "bandmf"], "--steps must be >= 1"),
        (["solve", "--steps", "8", "--bands", "2", "--objective", "noisecurve", "--learning-rate", "0.1"],
         "needs --spectrum"),
        (["solve", "--steps", "8", "--bands", "2", "--objective", "bandmf", "--tol", "0"], "--tol"),
        (["solve", "--steps", "8", "--bands", "2", "--objective", "noisecurve-blend", "--blend-weight", "1.5"],
         "expected a number in [0, 1] or 'auto'"),
        (["solve", "--steps", "8", "--bands", "2", "--objective", "bandmf", "--blend-weight", "0.5"],
         "only used by objective 'noisecurve-blend'"),
        (["solve", "--steps", "8", "--bands", "2", "--objective", "dpsgd"], "band"),
    ],
)
def test_solve_bad_arguments_exit_2(capsys, workdir, argv, message):
    code, out, err = _run_exit(capsys, argv + ["--out", str(workdir / "never.npz")])
    assert code == 2
    assert message in err
    assert "Traceback" not in err
    assert not (workdir / "never.npz").exists()


def test_solve_bad_files_exit_2(capsys, workdir, spectrum_file, bandmf_file):
    base = ["solve", "--steps", "8", "--bands", "2", "--objective", "noisecurve", "--learning-rate", "0.5"]
    cases = [
        (base + ["--spectrum", str(workdir / "missing.npz")], "does not exist"),
        (base + ["--spectrum", str(bandmf_file)], "cannot read spectrum file"),
        (["solve", "--steps", "8", "--bands", "2", "--objective", "noisecurve", "--learning-rate", "3.0",
          "--spectrum", str(spectrum_file)], "3"),  # eta * mu_max = 3 >= 2: GD diverges, refused
        (["solve", "--steps", "8", "--bands", "2", "--objective", "bandmf", "--out",
          str(workdir / "no_such_dir" / "c.npz")], "does not exist"),
    ]
    for argv, message in cases:
        if "--out" not in argv:
            argv = argv + ["--out", str(workdir / "never.npz")]
        code, out, err = _run_exit(capsys, argv)
        assert code == 2, (argv, err)
        assert "noisecurve solve: error:" in err and message in err
        assert "Traceback" not in err


def test_solve_reports_solver_warnings(capsys, workdir, spectrum_file):
    # eta * mu_max = 1.5: allowed (GD converges) but beyond Theorem 3.2's assumption -> warning
    code, out, err = _run(capsys, ["solve", "--steps", "8", "--bands", "2", "--objective", "noisecurve",
                                   "--spectrum", str(spectrum_file), "--learning-rate", "1.5",
                                   "--out", str(workdir / "warned.npz"), "--quiet"])
    assert code == 0, err
    assert "noisecurve solve: warning:" in err


def test_inspect_bad_input_exit_2(capsys, workdir, bandmf_file):
    other = workdir / "other_steps.npz"
    MixingMatrix.identity(STEPS + 1).save(other)
    not_npz = workdir / "text.npz"
    not_npz.write_text("hello")
    cases = [
        (["inspect", str(workdir / "missing.npz")], "does not exist"),
        (["inspect", str(not_npz)], "invalid mixing-matrix file"),
        (["inspect", str(bandmf_file), "--reference", str(other)], "must match"),
        (["inspect", str(bandmf_file), "--plot", str(workdir / "nodir" / "x.png")], "does not exist"),
        (["inspect", str(bandmf_file), "--learning-rate", "-1"], "--learning-rate"),
        (["inspect", str(bandmf_file), "--reference", str(other), "--no-reference"], "not allowed with"),
    ]
    for argv, message in cases:
        code, out, err = _run_exit(capsys, argv)
        assert code == 2, (argv, err)
        assert message in err, (argv, err)
        assert "Traceback" not in err


# ------------------------------------------------------------------- subprocess
def _script():
    script = Path(sys.executable).parent / "noisecurve"
    if not script.exists():  # pragma: no cover - the package is installed with its console script
        pytest.fail(f"the installed 'noisecurve' script is missing next to {sys.executable}")
    return str(script)


def test_installed_script_inspect(bandmf_file, workdir):
    env = dict(os.environ)
    proc = subprocess.run([_script(), "inspect", str(bandmf_file), "--json", "--no-reference"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["steps"] == STEPS and doc["bands"] == BANDS
    assert doc["diagnostics"]["prefix_std_max"] <= math.sqrt(STEPS)  # DP-BandMF beats DP-SGD's running sum

    bad = workdir / "tampered_script.npz"
    _resave_with(bandmf_file, bad, lambda bv: (bv.__setitem__((5, 2), bv[5, 2] * 1.5), bv)[1])
    proc = subprocess.run([_script(), "inspect", str(bad)], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 2
    assert "noisecurve inspect: error: invalid mixing-matrix file" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_cli_does_not_import_tensorflow(bandmf_file, workdir):
    code = (
        "import sys\n"
        "from keras_noisecurve.apps.cli import main\n"
        f"assert main(['solve', '--steps', '6', '--bands', '2', '--objective', 'bandmf', '--quiet', "
        f"'--out', {str(workdir / 'notf.npz')!r}]) == 0\n"
        f"assert main(['inspect', {str(bandmf_file)!r}, '--no-reference', '--plot', "
        f"{str(workdir / 'notf.png')!r}]) == 0\n"
        "assert 'tensorflow' not in sys.modules, 'TensorFlow was imported'\n"
        "assert 'keras' not in sys.modules, 'Keras was imported'\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_blend_auto_round_trip(capsys, workdir, spectrum_file, eigenvalues):
    path = workdir / "blend.npz"
    code, out, err = _run(capsys, ["solve", "--steps", str(STEPS), "--bands", str(BANDS), "--objective",
                                   "noisecurve-blend", "--blend-weight", "auto", "--spectrum", str(spectrum_file),
                                   "--learning-rate", str(ETA), "--tol", "1e-4", "--out", str(path)])
    assert code == 0, err
    meta = MixingMatrix.load(path).metadata
    lam = meta["blend_weight"]
    assert 0.0 <= lam <= 1.0
    assert f"blend weight: {lam:.6g}" in out

    code, out, err = _run(capsys, ["inspect", str(path), "--json", "--spectrum", str(spectrum_file),
                                   "--no-reference"])
    assert code == 0, err
    rec = json.loads(out)["expected_error"]
    assert rec["source"] == "recomputed" and rec["blend_weight"] == lam
    curvature = _noisecurve_workload(eigenvalues, STEPS, ETA)
    prefix = _prefix_workload(STEPS)
    workload = (1 - lam) * curvature / np.trace(curvature) + lam * prefix / np.trace(prefix)
    dense = MixingMatrix.load(path).to_dense()
    assert rec["loss"] == pytest.approx(_trace_objective(dense, workload), rel=1e-8)
    assert rec["dpsgd"] == pytest.approx(np.trace(workload), rel=1e-10)
    assert rec["bandmf"] == pytest.approx(meta["baseline_losses"]["bandmf"], rel=1e-12)
    assert rec["bandmf_source"] == "stored"


def test_inspect_identity_and_file_without_objective(capsys, workdir):
    ident = workdir / "identity.npz"
    MixingMatrix.identity(9).save(ident)
    code, out, err = _run(capsys, ["inspect", str(ident), "--json"])
    assert code == 0, err
    doc = json.loads(out)
    rec = doc["expected_error"]
    assert rec["objective"] == "dpsgd" and rec["source"] == "recomputed"
    assert rec["loss"] == pytest.approx(9.0, rel=1e-12)  # Tr(I · I⁻¹)
    assert rec["ratio_vs_dpsgd"] == pytest.approx(1.0, rel=1e-12)
    assert rec["ratio_vs_bandmf"] == pytest.approx(1.0, rel=1e-9)  # with b = 1, DP-BandMF is C = I
    np.testing.assert_allclose(doc["diagnostics"]["prefix_std"], np.sqrt(np.arange(1, 10)), rtol=1e-14)

    bare = workdir / "bare.npz"
    MixingMatrix.from_dense(np.array([[0.6, 0.0], [0.8, 1.0]])).save(bare)
    code, out, err = _run(capsys, ["inspect", str(bare), "--no-reference"])
    assert code == 0, err
    assert "no objective in its metadata" in out and "this C                 n/a" in out
    code, out, err = _run(capsys, ["inspect", str(bare), "--no-reference", "--objective", "bandmf", "--json"])
    assert code == 0, err
    rec = json.loads(out)["expected_error"]
    # C = [[.6, 0], [.8, 1]]: X⁻¹ = [[1, -.8], [-.8, 1]] / .36, AᵀA = [[2, 1], [1, 1]]
    assert rec["loss"] == pytest.approx((2 - 1.6 + 1) / 0.36, rel=1e-12)
    assert rec["dpsgd"] == pytest.approx(3.0, rel=1e-12)


def test_inspect_with_a_different_spectrum_says_so(capsys, workdir, noisecurve_file, eigenvalues):
    other = workdir / "other_spectrum.npz"
    Spectrum(0.5 * eigenvalues).save(other)
    code, out, err = _run(capsys, ["inspect", str(noisecurve_file), "--json", "--no-reference",
                                   "--spectrum", str(other)])
    assert code == 0, err
    rec = json.loads(out)["expected_error"]
    assert "differs from the one the file was solved with" in rec["note"]
    workload = _noisecurve_workload(0.5 * eigenvalues, STEPS, ETA)
    dense = MixingMatrix.load(noisecurve_file).to_dense()
    assert rec["loss"] == pytest.approx(_trace_objective(dense, workload), rel=1e-8)


# ------------------------------------------------------------------- update rules
MOMENTUM, COOLDOWN = 0.9, 0.5


def _rule_multipliers(steps):
    """linear-cooldown with f = 0.5 by hand: T_c = T − round(T/2), then 1 − (t − T_c)/(T − T_c)."""
    cool = max(1, round(COOLDOWN * steps))
    start = steps - cool
    return np.array([1.0 if t < start else 1.0 - (t - start) / cool for t in range(steps)])


def _rule_prefix_workload(steps):
    """A_ruleᵀA_rule, A_rule[t, j] = s_j Σ_{k=j}^{t} β^{k−j}: the Keras SGD loop on unit gradients."""
    s = _rule_multipliers(steps)
    m, w, rows = np.zeros(steps), np.zeros(steps), []
    for t in range(steps):
        m = MOMENTUM * m - s[t] * np.eye(steps)[t]
        w = w + m
        rows.append(-w)
    a = np.array(rows)
    return a.T @ a


def _rule_noisecurve_workload(eigenvalues, steps, eta):
    """Σ_i μ_i u_i u_iᵀ, u_i(j) = −e_T/η for a unit noise impulse at step j, simulated forward."""
    s = _rule_multipliers(steps)
    out = np.zeros((steps, steps))
    for mu in eigenvalues:
        e, d = np.zeros(steps), np.zeros(steps)
        for t in range(steps):
            d = MOMENTUM * d - eta * s[t] * (mu * e + (np.arange(steps) == t))
            e = e + d
        out += mu * np.outer(e / eta, e / eta)
    return out


RULE_ARGS = ["--momentum", str(MOMENTUM), "--schedule", "linear-cooldown", "--cooldown-fraction", str(COOLDOWN)]


@pytest.fixture(scope="module")
def rule_file(workdir, spectrum_file):
    path = workdir / "rule.npz"
    code = main(["solve", "--steps", str(STEPS), "--bands", str(BANDS), "--objective", "noisecurve",
                 "--spectrum", str(spectrum_file), "--learning-rate", str(ETA), "--tol", "1e-4",
                 "--out", str(path), "--quiet"] + RULE_ARGS)
    assert code == 0
    return path


def test_solve_for_an_update_rule_records_and_prints_it(capsys, workdir, spectrum_file, eigenvalues):
    from keras_noisecurve.mixing import UpdateRule

    path = workdir / "rule_summary.npz"
    code, out, err = _run(capsys, ["solve", "--steps", str(STEPS), "--bands", str(BANDS), "--objective", "bandmf",
                                   "--out", str(path)] + RULE_ARGS)
    assert code == 0, err
    meta = MixingMatrix.load(path).metadata
    rule = UpdateRule(momentum=MOMENTUM, schedule="linear-cooldown", cooldown_fraction=COOLDOWN)
    assert meta["update_rule"] == rule.to_metadata()
    assert f"update rule: {rule.describe()}" in out
    assert "momentum 0.9, linear cooldown over the last 0.5 of the steps" in out
    dense = MixingMatrix.load(path).to_dense()
    assert meta["loss"] == pytest.approx(_trace_objective(dense, _rule_prefix_workload(STEPS)), rel=1e-9)
    assert meta["baseline_losses"]["dpsgd"] == pytest.approx(np.trace(_rule_prefix_workload(STEPS)), rel=1e-12)

    # without the options: plain SGD, recorded as such
    code, out, err = _run(capsys, ["solve", "--steps", "6", "--bands", "2", "--objective", "bandmf",
                                   "--out", str(workdir / "plain_rule.npz")])
    assert code == 0, err
    assert MixingMatrix.load(workdir / "plain_rule.npz").metadata["update_rule"] == UpdateRule().to_metadata()
    assert "update rule: SGD, momentum 0, constant learning rate" in out


def test_inspect_evaluates_under_the_recorded_rule(capsys, rule_file, spectrum_file, eigenvalues):
    mixing = MixingMatrix.load(rule_file)
    dense = mixing.to_dense()
    code, out, err = _run(capsys, ["inspect", str(rule_file)])
    assert code == 0, err
    assert "update rule: SGD, momentum 0.9, linear cooldown over the last 0.5 of the steps" in out
    assert "solved here (objective 'bandmf'" in out and "for SGD, momentum 0.9" in out

    code, out, err = _run(capsys, ["inspect", str(rule_file), "--json", "--spectrum", str(spectrum_file)])
    assert code == 0, err
    doc = json.loads(out)
    rec = doc["expected_error"]
    assert rec["source"] == "recomputed" and "momentum 0.9" in rec["update_rule"]
    workload = _rule_noisecurve_workload(eigenvalues, STEPS, ETA)
    assert rec["loss"] == pytest.approx(_trace_objective(dense, workload), rel=1e-8)
    assert rec["loss"] == pytest.approx(mixing.metadata["loss"], rel=1e-8)
    assert rec["dpsgd"] == pytest.approx(np.trace(workload), rel=1e-10)
    # the reference is DP-BandMF for the same rule: the stored baseline (tolerances 1e-4 vs 1e-6)
    assert rec["bandmf"] == pytest.approx(mixing.metadata["baseline_losses"]["bandmf"], rel=1e-3)
    assert rec["ratio_vs_bandmf"] < 1.0

    # under the prefix workload the rule's DP-BandMF reference is optimal
    code, out, err = _run(capsys, ["inspect", str(rule_file), "--json", "--objective", "bandmf"])
    assert code == 0, err
    rec = json.loads(out)["expected_error"]
    assert rec["loss"] == pytest.approx(_trace_objective(dense, _rule_prefix_workload(STEPS)), rel=1e-9)
    assert rec["ratio_vs_bandmf"] >= 1.0 - 1e-6


def test_inspect_file_without_a_rule_record_is_plain(capsys, workdir):
    path = workdir / "no_rule.npz"
    MixingMatrix.identity(5).with_metadata(objective="dpsgd").save(path)
    code, out, err = _run(capsys, ["inspect", str(path), "--no-reference"])
    assert code == 0, err
    assert "update rule: SGD, momentum 0, constant learning rate (no record" in out


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--momentum", "1.0"], "--momentum must lie in [0, 1)"),
        (["--momentum", "-0.5"], "--momentum must lie in [0, 1)"),
        (["--momentum", "nan"], "--momentum must lie in [0, 1)"),
        (["--momentum", "high"], "invalid float value"),
        (["--schedule", "step"], "invalid choice"),
        (["--schedule", "cosine", "--cooldown-fraction", "0.2"], "only used by --schedule linear-cooldown"),
        (["--cooldown-fraction", "0.2"], "only used by --schedule linear-cooldown"),
        (["--schedule", "linear-cooldown", "--cooldown-fraction", "0"], "--cooldown-fraction must lie in (0, 1]"),
    ],
)
def test_solve_bad_update_rule_exit_2(capsys, workdir, extra, message):
    argv = ["solve", "--steps", "8", "--bands", "2", "--objective", "bandmf", "--out", str(workdir / "never.npz")]
    code, out, err = _run_exit(capsys, argv + extra)
    assert code == 2
    assert message in err
    assert "Traceback" not in err
    assert not (workdir / "never.npz").exists()


def test_solve_rule_refusals_exit_2(capsys, workdir, spectrum_file):
    base = ["solve", "--steps", "8", "--bands", "2", "--spectrum", str(spectrum_file), "--out",
            str(workdir / "never.npz")]
    cases = [
        (["--objective", "noisecurve-all-iterates", "--learning-rate", "0.5", "--momentum", "0.9"],
         "only derived for plain constant-rate SGD"),
        (["--objective", "noisecurve-convergence", "--learning-rate", "0.5", "--schedule", "cosine"],
         "only derived for plain constant-rate SGD"),
        # η·max(s)·μ_max = 3.2 × 1 × 1 >= 2(1 + 0.5) = 3: heavy ball diverges
        (["--objective", "noisecurve", "--learning-rate", "3.2", "--momentum", "0.5"], "= 3.2 >= 2(1 + momentum) = 3"),
    ]
    for extra, message in cases:
        code, out, err = _run_exit(capsys, base + extra)
        assert code == 2, (extra, err)
        assert "noisecurve solve: error:" in err and message in err, err
        assert "Traceback" not in err
    assert not (workdir / "never.npz").exists()
    # η·μ_max = 2.5 with momentum 0.5 is stable (plain SGD would refuse it)
    code, out, err = _run_exit(capsys, base[:-1] + [str(workdir / "stable.npz"), "--objective", "noisecurve",
                                                   "--learning-rate", "2.5", "--momentum", "0.5", "--quiet",
                                                   "--tol", "1e-3"])
    assert code == 0, err


def test_inspect_bad_update_rule_record_exit_2(capsys, workdir):
    path = workdir / "bad_rule.npz"
    MixingMatrix.identity(4).with_metadata(objective="dpsgd", update_rule={"optimizer": "adam"}).save(path)
    code, out, err = _run_exit(capsys, ["inspect", str(path), "--no-reference"])
    assert code == 2
    assert "noisecurve inspect: error: invalid update_rule record" in err and "adam" in err
    assert "Traceback" not in err


def test_inspect_refuses_an_objective_the_rule_has_no_workload_for(capsys, rule_file, spectrum_file):
    code, out, err = _run_exit(capsys, ["inspect", str(rule_file), "--no-reference", "--spectrum", str(spectrum_file),
                                        "--objective", "noisecurve-all-iterates"])
    assert code == 2
    assert "only derived for plain constant-rate SGD" in err and "Traceback" not in err
