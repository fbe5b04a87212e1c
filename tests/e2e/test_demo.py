"""`noisecurve demo`: bad flags exit 2 fast; `--quick` runs the whole pipeline end to end
with DP-BandMF's b from the auto choice and predicted beside measured; `--seeds N` reports
mean ± std over paired seeds; `--bands` overrides the auto choice; the per-method configs
are validated."""

import copy
import json
import os
import statistics
import time

import pytest

from keras_noisecurve.apps import cli, demo_configs


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--epsilon", "0"], "--epsilon"),
        (["--delta", "1.5"], "--delta"),
        (["--epochs", "0"], "--epochs"),
        (["--bands", "1"], "--bands"),
        (["--clip", "-1"], "--clip"),
        (["--learning-rate", "0"], "--learning-rate"),
        (["--momentum", "1.0"], "--momentum"),
        (["--public-size", "5000"], "--public-size"),
        (["--batch-size", "2000", "--bands", "4"], "exceeds"),
        (["--batch-size", "2000"], "no b >= 2"),  # the auto choice has no banded candidate
        # an objective derived only for plain SGD, with momentum: refused before any work
        (["--momentum", "0.5", "--objective", "noisecurve-all-iterates"], "only derived for plain"),
    ],
)
def test_bad_flags_exit_2_with_a_message(flags, message, tmp_path, capsys):
    rc = cli.main(["demo", "--out", str(tmp_path / "o"), *flags])
    assert rc == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("seeds", ["0", "-3"])
def test_bad_seeds_fails_in_seconds_with_status_2(seeds, tmp_path, capsys):
    started = time.perf_counter()
    rc = cli.main(["demo", "--seeds", seeds, "--out", str(tmp_path / "o")])
    assert rc == 2
    assert "--seeds must be >= 1" in capsys.readouterr().err
    assert time.perf_counter() - started < 30
    assert not (tmp_path / "o").exists()  # stopped before any work


def test_unknown_choice_is_an_argparse_error(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["demo", "--objective", "nonsense"])
    assert exc.value.code == 2


def test_demo_objective_comes_from_one_constant():
    from keras_noisecurve.apps import demo, demo_report
    from keras_noisecurve.mixing import CURVATURE_OBJECTIVES

    assert demo.NOISECURVE_OBJECTIVE in CURVATURE_OBJECTIVES
    assert demo.NOISECURVE_OBJECTIVE == demo_configs.CONFIGS["NoiseCurve"]["objective"]


def test_shipped_configs_are_valid_and_say_where_they_come_from():
    demo_configs.validate_configs(demo_configs.CONFIGS, demo_configs.PROVENANCE)
    assert set(demo_configs.CONFIGS) == set(demo_configs.METHODS)
    assert demo_configs.CONFIGS["DP-SGD"]["bands"] == 1
    # the correlated methods' b is the auto choice (choose_mixing) by default
    assert demo_configs.is_auto(demo_configs.CONFIGS["DP-BandMF"]["bands"])
    assert demo_configs.is_auto(demo_configs.CONFIGS["NoiseCurve"]["bands"])
    assert demo_configs.PROVENANCE.strip()


def _broken(method, field, value):
    configs = copy.deepcopy(demo_configs.CONFIGS)
    if value is _DELETE:
        del configs[method][field]
    else:
        configs[method][field] = value
    return configs


_DELETE = object()


@pytest.mark.parametrize(
    "method,field,value,message",
    [
        ("DP-SGD", "learning_rate", 0.0, "learning_rate"),
        ("DP-BandMF", "learning_rate", float("nan"), "learning_rate"),
        ("NoiseCurve", "clip", -1.0, "clip"),
        ("DP-BandMF", "momentum", 1.0, "momentum"),
        ("DP-SGD", "schedule", "exponential", "schedule"),
        ("DP-SGD", "bands", 4, "bands"),
        ("NoiseCurve", "bands", 1, "bands"),
        ("DP-BandMF", "bands", 2.5, "bands"),
        ("DP-BandMF", "bands", "automatic", "bands"),
        ("DP-SGD", "bands", demo_configs.AUTO, "bands"),
        ("NoiseCurve", "objective", "bandmf", "objective"),
        ("DP-SGD", "objective", "noisecurve", "unknown"),
        ("DP-BandMF", "clip", _DELETE, "missing"),
    ],
)
def test_config_validation_rejects_a_bad_value(method, field, value, message):
    with pytest.raises(ValueError, match=message) as exc:
        demo_configs.validate_configs(_broken(method, field, value))
    assert method in str(exc.value)


def test_config_validation_rejects_unknown_methods_and_empty_provenance():
    configs = copy.deepcopy(demo_configs.CONFIGS)
    configs["DP-FTRL"] = configs.pop("DP-SGD")
    with pytest.raises(ValueError, match="DP-FTRL"):
        demo_configs.validate_configs(configs)
    with pytest.raises(ValueError, match="PROVENANCE"):
        demo_configs.validate_configs(demo_configs.CONFIGS, "  ")


def test_quick_demo_end_to_end(tmp_path, capsys):
    out = tmp_path / "demo"
    rc = cli.main(["demo", "--quick", "--deterministic", "--out", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "NoiseCurve objective" in printed
    # one seed: the table as before --seeds, no ± column
    assert "| method | test accuracy | epsilon | sigma | b | wall time |" in printed
    assert "±" not in printed.split("| method |")[1]
    summary = json.loads((out / "results.json").read_text())
    assert set(summary["results"]) == {"DP-SGD", "DP-BandMF", "NoiseCurve"}
    assert summary["seeds"] == [0] and summary["provenance"] == demo_configs.PROVENANCE
    eps = summary["epsilon"]
    # the auto choice: DP-BandMF's b (capped under --quick) and NoiseCurve at the same b
    from keras_noisecurve.apps import demo_predict

    choice = summary["mixing_choice"]
    assert summary["bands_from"] == "auto" and choice["plan"]["epsilon"] == eps
    bands = summary["results"]["DP-BandMF"]["bands"]
    assert 2 <= bands <= demo_predict.QUICK_MAX_BANDS and choice["trained"] == f"banded b={bands}"
    assert summary["results"]["NoiseCurve"]["bands"] == bands
    assert "mixing='auto'" in printed and "Predicted against measured" in printed
    chosen = next(c for c in choice["candidates"] if c["label"] == choice["trained"])
    predicted = summary["results"]["DP-BandMF"]["predicted"]
    # the prediction printed for DP-BandMF is the chooser's (same sigma, same workload)
    assert predicted["variance_ratio"] == pytest.approx(chosen["relative_error"], rel=1e-6)
    assert summary["results"]["DP-BandMF"]["sigma"] == pytest.approx(chosen["noise_multiplier"], rel=1e-12)
    assert summary["results"]["DP-SGD"]["predicted"]["variance_ratio"] == pytest.approx(1.0)
    for row in summary["comparison"]:
        r = summary["results"][row["method"]]
        assert row["predicted_variance_ratio"] == r["predicted"]["variance_ratio"] > 0
        assert row["measured_accuracy"] == r["test_accuracy"]
        if row["method"] != "DP-SGD":  # one seed: the difference, no sd
            assert row["measured_difference"] == pytest.approx(
                r["test_accuracy"] - summary["results"]["DP-SGD"]["test_accuracy"])
            assert row["measured_difference_std"] is None
    for name, r in summary["results"].items():
        assert 0.0 <= r["test_accuracy"] <= 1.0
        assert r["n"] == 1 and r["test_accuracy_std"] is None
        assert r["runs"][0]["test_accuracy"] == r["test_accuracy"]
        assert r["config"] == summary["configs"][name]
        # the calibrated sigma meets the target epsilon (and is not wastefully large)
        assert r["epsilon"] <= eps + 1e-6 and r["epsilon"] > 0.95 * eps
        assert len(r["accuracy_per_epoch"]) == 2
    assert summary["results"]["DP-SGD"]["bands"] == 1
    # the demo learned something: better than chance (10 %) for DP-SGD after 2 epochs
    assert summary["results"]["DP-SGD"]["test_accuracy"] > 0.2
    from keras_noisecurve.apps import demo, demo_report

    assert "mixing_bands.png" in demo_report.PLOT_FILES
    for name in (*demo_report.PLOT_FILES, "spectrum.npz", "mixing_dpbandmf.npz", "mixing_noisecurve.npz"):
        assert os.path.getsize(out / name) > 0


def test_two_seeds_report_mean_and_std_of_the_runs(tmp_path, capsys):
    out = tmp_path / "demo2"
    # a small, rough spectrum (fast): its mu_max needs a smaller learning rate than 1;
    # --bands overrides the auto choice (no choose_mixing)
    rc = cli.main(["demo", "--quick", "--deterministic", "--seeds", "2", "--epochs", "1", "--public-size", "32",
                   "--top-k", "4", "--learning-rate", "0.25", "--bands", "3", "--no-plots", "--out", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "| method | test accuracy (mean ± std, N = 2) |" in printed
    summary = json.loads((out / "results.json").read_text())
    assert summary["seeds"] == [0, 1]
    assert summary["bands_from"] == "--bands" and summary["mixing_choice"] is None
    assert "mixing='auto': choose_mixing" not in printed
    assert [summary["results"][m]["bands"] for m in demo_configs.METHODS] == [1, 3, 3]
    for row in summary["comparison"][1:]:  # predicted beside the paired difference and its sd
        d = summary["paired_differences"][f"{row['method']} - DP-SGD"]
        assert row["measured_difference"] == d["mean"] and row["measured_difference_std"] == d["std"]
        assert 0 < row["predicted_variance_ratio"] and row["predicted_noise_std_reduction"] < 1
        line = f"| {row['method']} | 3 | {row['sigma']:.3f} |"
        assert line in printed and f"{100 * d['mean']:+.2f} ± {100 * d['std']:.2f} pp |" in printed
    # the flag overrides every method, and says so
    for name in demo_configs.METHODS:
        assert summary["configs"][name]["learning_rate"] == 0.25
        assert "--learning-rate" in summary["overridden"][name]
    table = (out / "results.md").read_text()
    for name, r in summary["results"].items():
        runs = r["runs"]
        assert [run["seed"] for run in runs] == [0, 1] and r["n"] == 2
        accs = [run["test_accuracy"] for run in runs]
        assert all(0.0 <= a <= 1.0 and len(run["accuracy_per_epoch"]) == 1 for a, run in zip(accs, runs))
        assert r["test_accuracy"] == pytest.approx(statistics.mean(accs), abs=1e-12)
        assert r["test_accuracy_std"] == pytest.approx(statistics.stdev(accs), abs=1e-12)
        row = f"| {name} | {100 * statistics.mean(accs):.2f} ± {100 * statistics.stdev(accs):.2f} % |"
        assert row in table and row in printed
    sgd = {run["seed"]: run["test_accuracy"] for run in summary["results"]["DP-SGD"]["runs"]}
    for name in ("DP-BandMF", "NoiseCurve"):
        diffs = [run["test_accuracy"] - sgd[run["seed"]] for run in summary["results"][name]["runs"]]
        d = summary["paired_differences"][f"{name} - DP-SGD"]
        assert d["mean"] == pytest.approx(statistics.mean(diffs), abs=1e-12)
        assert d["std"] == pytest.approx(statistics.stdev(diffs), abs=1e-12)


def test_band_plot_draws_each_diagonal_of_each_correlated_c(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    import keras_noisecurve as knc
    from keras_noisecurve.apps import demo, demo_report

    mixings = {"DP-BandMF": knc.solve_mixing_matrix(steps=20, bands=3, objective="bandmf"),
               "NoiseCurve": knc.solve_mixing_matrix(steps=20, bands=4, objective="bandmf")}
    drawn = []
    real_subplots = plt.subplots

    def spy(*args, **kwargs):
        fig, axes = real_subplots(*args, **kwargs)
        drawn.append(axes)
        return fig, axes

    path = tmp_path / "mixing_bands.png"
    plt.subplots = spy
    try:
        demo_report.plot_bands(plt, np, str(path), mixings)
    finally:
        plt.subplots = real_subplots
    assert os.path.getsize(path) > 0
    panels = drawn[0][0]
    assert len(panels) == 2
    for ax, (name, mixing) in zip(panels, mixings.items()):
        assert name in ax.get_title()
        curves = [line for line in ax.get_lines() if line.get_label().startswith("j = ")]
        assert len(curves) == mixing.bands
        for j, line in enumerate(curves):
            np.testing.assert_array_equal(line.get_xdata(), np.arange(j, mixing.steps))
            np.testing.assert_allclose(line.get_ydata(), mixing.to_dense()[np.arange(j, 20), np.arange(0, 20 - j)])


def test_predictions_score_every_c_under_the_running_sums_of_its_rule():
    import numpy as np

    import keras_noisecurve as knc
    from keras_noisecurve.apps import demo_predict

    rule = knc.UpdateRule(momentum=0.9)
    choice = knc.choose_mixing(num_examples=3500, batch_size=250, steps=28, epsilon=8.0, delta=1e-5,
                               update_rule=rule, max_bands=3)
    b = choice.chosen.size
    methods = {name: dict(cfg, bands=1 if name == "DP-SGD" else b) for name, cfg in demo_configs.CONFIGS.items()}
    other = knc.solve_mixing_matrix(steps=28, bands=b, objective="bandmf")  # solved for plain SGD
    mixings = {"DP-SGD": knc.MixingMatrix.identity(28), "DP-BandMF": choice.mixing, "NoiseCurve": other}
    sigmas = {"DP-SGD": choice.dpsgd.noise_multiplier, "DP-BandMF": choice.chosen.noise_multiplier,
              "NoiseCurve": choice.chosen.noise_multiplier}
    predicted = demo_predict.predictions(mixings, sigmas, methods)
    assert predicted["DP-SGD"]["variance_ratio"] == pytest.approx(1.0)
    assert predicted["DP-BandMF"]["variance_ratio"] == pytest.approx(choice.chosen.relative_error, rel=1e-9)
    # a C solved for another rule is scored under this rule's workload: no better than the one solved for it
    assert predicted["NoiseCurve"]["variance_ratio"] >= predicted["DP-BandMF"]["variance_ratio"] * (1 - 1e-9)
    assert predicted["DP-BandMF"]["noise_std_reduction"] == pytest.approx(choice.chosen.noise_reduction)

    # the noise figure's curves, in model units: DP-SGD's per-step std is clip*sigma; the
    # weights' noise is clip*sigma*||(A_rule C^-1)[t, :]|| with momentum's prefix map
    curves = demo_predict.noise_curves(mixings, sigmas, methods)
    np.testing.assert_allclose(curves["DP-SGD"]["step_std"], sigmas["DP-SGD"])
    a = np.tril(np.ones((28, 28)))
    m_beta = np.tril(0.9 ** np.subtract.outer(np.arange(28), np.arange(28)).clip(0))
    np.testing.assert_allclose(curves["DP-SGD"]["sum_std"],
                               sigmas["DP-SGD"] * np.linalg.norm(a @ m_beta, axis=1), rtol=1e-9)
    c_inv = np.linalg.inv(choice.mixing.to_dense())
    np.testing.assert_allclose(curves["DP-BandMF"]["sum_std"],
                               sigmas["DP-BandMF"] * np.linalg.norm(a @ m_beta @ c_inv, axis=1), rtol=1e-9)
