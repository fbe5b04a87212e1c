"""``noisecurve solve --strategy …`` and ``noisecurve inspect`` for every strategy kind.

Run in-process (``keras_noisecurve.apps.cli.main``) as in test_mixing_cli.py. The loss each
command prints is checked against an independent re-evaluation of the saved file:
``api.objective_value`` of the file read back with ``load_mixing``, and a dense numpy
``Tr(W (CᵀC)⁻¹)`` with W built here from its definition (docs/mixing.md §2).
"""

import contextlib
import io
import json
import re

import numpy as np
import pytest

from keras_noisecurve.apps.cli import main
from keras_noisecurve.mixing import api, load_mixing
from keras_noisecurve.mixing.matrix import MixingMatrix
from keras_noisecurve.spectrum.artifact import Spectrum

STEPS, BANDS, BUFFERS = 200, 8, 3
K, SEP = 3, 50  # participations, separation
ETA = 0.5

# name -> extra argv of `noisecurve solve` (objective bandmf)
SOLVES = {
    "banded": ["--strategy", "banded", "--bands", str(BANDS)],
    "toeplitz": ["--strategy", "toeplitz", "--bands", str(BANDS)],
    "blt": ["--strategy", "blt", "--buffers", str(BUFFERS)],
    "blt-k3": ["--strategy", "blt", "--buffers", str(BUFFERS), "--participations", str(K), "--separation", str(SEP)],
    "bisr": ["--strategy", "bisr", "--bands", str(BANDS)],
}
KIND = {"banded": "banded", "toeplitz": "toeplitz", "blt": "blt", "blt-k3": "blt", "bisr": "bisr"}

LOSS_LINE = re.compile(r"^objective '([^']+)': (?:sensitivity\^2 x )?Tr\(W X\^-1\) = (\S+)", re.MULTILINE)


# ------------------------------------------------------------------ references
def _prefix_workload(steps):
    a = np.tril(np.ones((steps, steps)))
    return a.T @ a


def _noisecurve_workload(eigenvalues, steps, eta):
    """W = VᵀMV, V[i, j] = (1 − ημ_i)^{T−j−1} (paper eq. 1)."""
    mu = np.asarray(eigenvalues, dtype=float)
    v = (1.0 - eta * mu)[:, None] ** (steps - 1 - np.arange(steps))[None, :]
    return v.T @ (mu[:, None] * v)


def _dense_trace(mixing, workload):
    c = mixing.to_dense()
    return float(np.trace(workload @ np.linalg.inv(c.T @ c)))


def _call(argv):
    """(exit code, stdout, stderr) of ``noisecurve argv``; argparse errors give their code."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as exc:
            code = exc.code
    return code, out.getvalue(), err.getvalue()


def _printed_loss(out):
    match = LOSS_LINE.search(out)
    assert match, out
    return match.group(1), float(match.group(2))


def _kind(mixing):
    return getattr(mixing, "kind", "banded")


# --------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("strategy_cli")


@pytest.fixture(scope="module")
def eigenvalues():
    return 1.0 / np.arange(1, 41)


@pytest.fixture(scope="module")
def spectrum_file(workdir, eigenvalues):
    path = workdir / "spectrum.npz"
    Spectrum(eigenvalues).save(path)
    return path


@pytest.fixture(scope="module")
def solved(workdir):
    """name -> (path, stdout) of a bandmf solve (solved once per name, on first use)."""
    cache = {}

    def get(name):
        if name not in cache:
            path = workdir / f"{name}.npz"
            code, out, err = _call(["solve", "--steps", str(STEPS), "--objective", "bandmf", *SOLVES[name],
                                    "--out", str(path)])
            assert code == 0, err
            cache[name] = (path, out)
        return cache[name]

    return get


# ------------------------------------------------------------------------ solve
@pytest.mark.parametrize("name", list(SOLVES))
def test_solve_saves_the_strategy_and_prints_its_loss(solved, name):
    path, out = solved(name)
    mixing = load_mixing(str(path))
    kind = KIND[name]
    assert _kind(mixing) == kind and mixing.steps == STEPS
    meta = mixing.metadata
    assert meta["strategy"] == kind

    # size, noise state, participation pattern
    if kind == "banded":
        assert f"steps T = {STEPS}, bands b = {BANDS}" in out
        assert mixing.buffers == BANDS - 1
    elif kind == "toeplitz":
        assert f"strategy 'toeplitz', steps T = {STEPS}, bands b = {BANDS}" in out
        assert mixing.bands == BANDS and mixing.buffers == BANDS - 1
    elif kind == "blt":
        assert f"strategy 'blt', steps T = {STEPS}, buffers d = {BUFFERS}" in out
        assert mixing.buffers == BUFFERS
        if name == "blt-k3":
            assert f"optimised for {K} participations {SEP} steps apart" in out
            assert (meta["participations"], meta["separation"]) == (K, SEP)
        else:
            assert "optimised for a single participation (one pass)" in out
    else:
        assert f"strategy 'bisr', steps T = {STEPS}, C^-1 bands p = {BANDS}" in out
        assert mixing.inverse_bands == BANDS and mixing.buffers == BANDS - 1
    assert f"noise state: {mixing.buffers} buffers x model size" in out

    # the printed loss is that of the saved file, re-evaluated independently
    objective, printed = _printed_loss(out)
    assert objective == "bandmf"
    trace = api.objective_value(mixing, objective="bandmf")
    assert trace == pytest.approx(_dense_trace(mixing, _prefix_workload(STEPS)), rel=1e-8)
    expected = trace * mixing.sensitivity(participations=K, separation=SEP) ** 2 if name == "blt-k3" else trace
    assert printed == pytest.approx(expected, rel=5e-6)
    assert meta["loss"] == pytest.approx(expected, rel=1e-9)
    if kind == "blt" and name == "blt-k3":
        assert f"sensitivity^2 x Tr(W X^-1) = {expected:.6g}" in out


@pytest.mark.parametrize("strategy, size", [("toeplitz", ["--bands", "8"]), ("blt", ["--buffers", "3"]),
                                            ("bisr", ["--bands", "8"])])
def test_solve_curvature_objective_loss_is_reevaluated(workdir, spectrum_file, eigenvalues, strategy, size):
    path = workdir / f"nc_{strategy}.npz"
    code, out, err = _call(["solve", "--steps", str(STEPS), "--objective", "noisecurve", "--strategy", strategy,
                            *size, "--spectrum", str(spectrum_file), "--learning-rate", str(ETA), "--out", str(path),
                            "--quiet"])
    assert code == 0, err
    assert out == ""
    mixing = load_mixing(str(path))
    meta = mixing.metadata
    assert meta["learning_rate"] == ETA and meta["spectrum_digest"] == Spectrum(eigenvalues).digest()
    value = api.objective_value(mixing, objective="noisecurve", spectrum=Spectrum(eigenvalues), learning_rate=ETA)
    assert value == pytest.approx(_dense_trace(mixing, _noisecurve_workload(eigenvalues, STEPS, ETA)), rel=1e-7)
    assert meta["loss"] == pytest.approx(value, rel=1e-9)

    # inspect recomputes it with the spectrum, and says it cannot without
    code, out, err = _call(["inspect", str(path), "--spectrum", str(spectrum_file)])
    assert code == 0, err
    assert "under objective 'noisecurve' (recomputed with objective_value)" in out
    assert f"this C (one participation)     {value:.6g}" in out
    code, out, err = _call(["inspect", str(path)])
    assert code == 0, err
    assert "not recomputed: needs --spectrum FILE" in out


def test_solve_passes_verbose_unless_quiet(workdir, monkeypatch):
    seen = []
    real = api.solve_mixing_matrix

    def spy(**kwargs):
        seen.append(kwargs)
        return real(**kwargs)

    monkeypatch.setattr(api, "solve_mixing_matrix", spy)
    for extra, verbose in (([], True), (["--quiet"], False)):
        code, out, err = _call(["solve", "--steps", "50", "--objective", "bandmf", "--strategy", "toeplitz",
                                "--bands", "4", "--out", str(workdir / "verbose.npz"), *extra])
        assert code == 0, err
        assert seen[-1]["strategy"] == "toeplitz" and seen[-1]["verbose"] is verbose


# ---------------------------------------------------------------------- inspect
@pytest.mark.parametrize("name", list(SOLVES))
def test_inspect_shows_every_kind(solved, name):
    path, _ = solved(name)
    mixing = load_mixing(str(path))
    kind = KIND[name]
    code, out, err = _call(["inspect", str(path), "--no-reference", "--participations", str(K),
                            "--separation", str(SEP)])
    assert code == 0, err
    assert "Traceback" not in err
    sens_k = mixing.sensitivity(participations=K, separation=SEP)
    assert f"one participation {mixing.sensitivity():.6g}" in out
    assert f"{K} participations {SEP} steps apart (fixed epoch order): {sens_k:.6g}" in out
    if kind == "banded":
        # the banded report, with the sensitivity lines appended
        assert out.startswith(f"{path}: mixing matrix, steps T = {STEPS}, bands b = {BANDS}")
        assert sens_k == pytest.approx(np.sqrt(K))
        return
    trace = api.objective_value(mixing, objective="bandmf")
    assert out.startswith(f"{path}: mixing strategy {kind!r}, steps T = {STEPS}, ")
    assert f"noise state: {mixing.buffers} buffers x model size" in out
    assert "metadata:" in out and "  objective: " in out and "  loss: " in out
    assert "under objective 'bandmf' (recomputed with objective_value)" in out
    assert f"this C (one participation)     {trace:.6g}" in out
    assert f"sensitivity^2 x Tr(W X^-1) = {sens_k ** 2 * trace:.6g}" in out
    if kind == "toeplitz":
        assert f"bands b = {BANDS}" in out
        assert f"coefficients c_0 … c_{{b-1}} (b = {BANDS}): {mixing.coefficients[0]:.6g}" in out
        assert "Toeplitz DP-BandMF (b = 8)" in out and "  solver: converged" in out
    elif kind == "blt":
        assert f"buffers d = {BUFFERS}" in out
        assert f"theta (d = {BUFFERS}): {mixing.theta[0]:.6g}" in out
        assert f"omega (d = {BUFFERS}): {mixing.omega[0]:.6g}" in out
        if name == "blt-k3":
            assert f"optimised for {K} participations {SEP} steps apart" in out
            assert f"stored loss                    {mixing.metadata['loss']:.6g}" in out
    else:
        assert f"C^-1 bands p = {BANDS}" in out and f"p = {BANDS}: C^-1 is p-banded Toeplitz" in out
        assert "  objective: bandmf" in out


@pytest.mark.parametrize("name", ["toeplitz", "blt-k3", "bisr"])
def test_inspect_json(solved, name):
    path, _ = solved(name)
    mixing = load_mixing(str(path))
    code, out, err = _call(["inspect", str(path), "--json", "--participations", "2", "--separation", "100"])
    assert code == 0, err
    doc = json.loads(out)
    assert doc["kind"] == KIND[name] and doc["steps"] == STEPS and doc["buffers"] == mixing.buffers
    assert doc["digest"] == mixing.digest() and doc["metadata"] == mixing.metadata
    trace = api.objective_value(mixing, objective="bandmf")
    assert doc["expected_error"]["trace"] == pytest.approx(trace, rel=1e-12)
    assert doc["sensitivity"]["value"] == pytest.approx(mixing.sensitivity(participations=2, separation=100))
    loaded = load_mixing({"kind": doc["kind"], "steps": doc["steps"], **doc["parameters"]})
    assert loaded == mixing


def test_inspect_objective_reevaluates_toeplitz_kinds(solved, spectrum_file, eigenvalues):
    path, _ = solved("toeplitz")
    mixing = load_mixing(str(path))
    code, out, err = _call(["inspect", str(path), "--objective", "noisecurve", "--spectrum", str(spectrum_file),
                            "--learning-rate", str(ETA)])
    assert code == 0, err
    value = api.objective_value(mixing, objective="noisecurve", spectrum=Spectrum(eigenvalues), learning_rate=ETA)
    assert value == pytest.approx(_dense_trace(mixing, _noisecurve_workload(eigenvalues, STEPS, ETA)), rel=1e-7)
    assert "under objective 'noisecurve' (recomputed with objective_value)" in out
    assert f"this C (one participation)     {value:.6g}" in out
    assert "stored loss" not in out  # the stored loss is under bandmf


@pytest.mark.parametrize("name", ["toeplitz", "blt", "bisr"])
@pytest.mark.parametrize("objective", ["dpsgd", "noisecurve-all-iterates"])
def test_inspect_refuses_objectives_the_toeplitz_kinds_lack(solved, spectrum_file, name, objective):
    path, _ = solved(name)
    code, out, err = _call(["inspect", str(path), "--objective", objective, "--spectrum", str(spectrum_file),
                            "--learning-rate", str(ETA)])
    assert code == 2 and out == ""
    assert (f"noisecurve inspect: error: --objective {objective!r} cannot be evaluated for a {KIND[name]!r} "
            "strategy: objective_value supports bandmf, noisecurve, noisecurve-blend") in err
    assert "Traceback" not in err


def test_inspect_refusals(solved, workdir):
    toeplitz, _ = solved("toeplitz")
    blt, _ = solved("blt")
    banded, _ = solved("banded")
    cases = [
        (["inspect", str(blt), "--plot", str(workdir / "x.png")], "--plot draws banded mixing-matrix files only"),
        (["inspect", str(toeplitz), "--reference", str(banded)], "--reference applies to banded mixing-matrix "
                                                                  "files only"),
        (["inspect", str(blt), "--participations", "3"], "--participations 3 needs --separation s"),
        (["inspect", str(banded), "--participations", "3", "--no-reference"], "--participations 3 needs --separation"),
        (["inspect", str(blt), "--separation", "5"], "--separation s is only used with --participations k"),
        (["inspect", str(blt), "--participations", "0"], "--participations must be >= 1"),
        # banded participations closer than b overlap: MixingMatrix.sensitivity refuses
        (["inspect", str(banded), "--participations", "2", "--separation", "3", "--no-reference"],
         "must be at least b = 8"),
    ]
    for argv, message in cases:
        code, out, err = _call(argv)
        assert code == 2, (argv, err)
        assert "noisecurve inspect: error: " in err and message in err, (argv, err)
        assert "Traceback" not in err and out == ""
    assert not (workdir / "x.png").exists()


def test_inspect_rejects_a_tampered_strategy_file(solved, workdir):
    path, _ = solved("blt")
    with np.load(path, allow_pickle=False) as data:
        fields = {k: data[k] for k in data.files}
    fields["param_omega"] = fields["param_omega"] * 1.01
    bad = workdir / "tampered_blt.npz"
    with open(bad, "wb") as f:
        np.savez(f, **fields)
    code, out, err = _call(["inspect", str(bad)])
    assert code == 2 and out == ""
    assert "noisecurve inspect: error: invalid mixing-strategy file" in err and "digest" in err


# --------------------------------------------------------------- solve refusals
BASE = ["solve", "--steps", "100", "--objective", "bandmf"]


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--strategy", "toeplitz", "--bands", "8", "--momentum", "0.9"],
         "--momentum does not apply to --strategy toeplitz (the toeplitz, blt and bisr strategies are solved for "
         "plain SGD with a constant learning rate); it is used by --strategy banded only."),
        (["--strategy", "blt", "--buffers", "3", "--schedule", "cosine"],
         "--schedule does not apply to --strategy blt"),
        (["--strategy", "bisr", "--bands", "8", "--schedule", "linear-cooldown", "--cooldown-fraction", "0.2"],
         "--schedule does not apply to --strategy bisr"),
        (["--strategy", "toeplitz", "--bands", "8", "--momentum", "0"], "--momentum does not apply"),
        (["--strategy", "blt", "--buffers", "3", "--bands", "8"],
         "--bands does not apply to --strategy blt (a blt C is sized by --buffers d); it is used by "
         "--strategy banded/toeplitz/bisr only."),
        (["--bands", "8", "--buffers", "3"], "--buffers does not apply to --strategy banded"),
        (["--strategy", "toeplitz", "--bands", "8", "--buffers", "3"], "--buffers does not apply to --strategy "
                                                                       "toeplitz"),
        (["--strategy", "toeplitz", "--bands", "8", "--participations", "2", "--separation", "10"],
         "--participations does not apply to --strategy toeplitz"),
        (["--bands", "8", "--participations", "2"], "--participations does not apply to --strategy banded"),
        (["--strategy", "bisr", "--bands", "8", "--separation", "10"],
         "--separation does not apply to --strategy bisr"),
        (["--strategy", "bisr", "--bands", "8", "--tol", "1e-3"],
         "--tol does not apply to --strategy bisr (bisr is a closed form, nothing is optimised)"),
        (["--strategy", "bisr", "--bands", "8", "--max-iterations", "5"], "--max-iterations does not apply"),
        (["--strategy", "bisr"], "--strategy bisr needs --bands p (the bands of C^-1)"),
        (["--strategy", "toeplitz"], "--strategy toeplitz needs --bands b"),
        ([], "--strategy banded needs --bands b"),
        (["--strategy", "toeplitz", "--bands", "101"], "--bands must satisfy 1 <= b <= steps (100)"),
        (["--strategy", "blt"], "--strategy blt needs --buffers d"),
        (["--strategy", "blt", "--buffers", "0"], "--buffers must satisfy 1 <= d"),
        (["--strategy", "blt", "--buffers", "100"], "d < steps (100)"),
        (["--strategy", "blt", "--buffers", "3", "--participations", "3"],
         "--participations 3 needs --separation s"),
        (["--strategy", "blt", "--buffers", "3", "--participations", "3", "--separation", "50"],
         "needs (k - 1) * s < steps (100); got 100"),
        (["--strategy", "blt", "--buffers", "3", "--participations", "0"], "--participations must be >= 1"),
        (["--strategy", "blt", "--buffers", "3", "--separation", "10"],
         "--separation is only used with --participations k >= 2"),
        (["--strategy", "blt", "--buffers", "3", "--participations", "2", "--separation", "0"],
         "--separation must be >= 1"),
        (["--strategy", "toeplitz", "--bands", "8", "--tol", "0"], "--tol must be a finite number > 0"),
        (["--strategy", "blt", "--buffers", "3", "--learning-rate", "0.5"],
         "--learning-rate is only used by the curvature objectives"),
    ],
)
def test_solve_refuses_options_the_strategy_does_not_take(workdir, monkeypatch, extra, message):
    def no_solve(**kwargs):  # refusals come before any solve work
        raise AssertionError(f"solve_mixing_matrix was called with {kwargs}")

    monkeypatch.setattr(api, "solve_mixing_matrix", no_solve)
    out_path = workdir / "never.npz"
    code, out, err = _call(BASE + extra + ["--out", str(out_path)])
    assert code == 2, err
    assert "noisecurve solve: error: " in err and message in err, err
    assert "Traceback" not in err and out == ""
    assert not out_path.exists()


@pytest.mark.parametrize("strategy, size", [("toeplitz", ["--bands", "8"]), ("blt", ["--buffers", "3"]),
                                            ("bisr", ["--bands", "8"])])
def test_solve_refuses_objectives_and_auto_blend_for_toeplitz_kinds(workdir, spectrum_file, monkeypatch, strategy,
                                                                    size):
    monkeypatch.setattr(api, "solve_mixing_matrix", lambda **kw: pytest.fail("solved"))
    base = ["solve", "--steps", "100", "--strategy", strategy, *size, "--out", str(workdir / "never.npz")]
    cases = [
        (["--objective", "dpsgd"], f"--strategy {strategy} supports --objective bandmf, noisecurve, "
                                   "noisecurve-blend; got 'dpsgd'. Use --strategy banded for the others."),
        (["--objective", "noisecurve-all-iterates", "--spectrum", str(spectrum_file), "--learning-rate", "0.5"],
         "got 'noisecurve-all-iterates'"),
        (["--objective", "noisecurve-blend", "--blend-weight", "auto", "--spectrum", str(spectrum_file),
          "--learning-rate", "0.5"], "--blend-weight auto is only supported by --strategy banded"),
    ]
    for extra, message in cases:
        code, out, err = _call(base + extra)
        assert code == 2, (extra, err)
        assert "noisecurve solve: error: " in err and message in err, (extra, err)
        assert "Traceback" not in err
    assert not (workdir / "never.npz").exists()


def test_banded_default_is_unchanged(workdir):
    """No --strategy: the banded solve, its file format and its summary (plus the noise state)."""
    path = workdir / "default.npz"
    code, out, err = _call(["solve", "--steps", "12", "--bands", "3", "--objective", "bandmf", "--out", str(path)])
    assert code == 0, err
    mixing = MixingMatrix.load(path)
    assert (mixing.steps, mixing.bands) == (12, 3) and mixing.metadata["strategy"] == "banded"
    assert f"saved {path}: steps T = 12, bands b = 3\nnoise state: 2 buffers x model size" in out
    assert "update rule: SGD" in out and "running-sum std peak" in out
    assert mixing.metadata["solver"]["tolerance"] == 1e-6
