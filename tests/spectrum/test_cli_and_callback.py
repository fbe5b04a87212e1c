"""``noisecurve spectrum`` CLI and the DominanceCertificate callback."""

import json

import keras
import numpy as np
import pytest
import scipy.linalg

from keras_noisecurve.apps import cli
from keras_noisecurve.callbacks import DominanceCertificate
from keras_noisecurve.spectrum.artifact import Spectrum

from .conftest import reference_hessian, tanh_mlp

SCCE = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def test_cli_spectrum_writes_file_and_plot(tmp_path, rng, capsys):
    model = tanh_mlp(inputs=5, hidden=(6,), outputs=3)
    model.compile(loss=SCCE)
    model.save(tmp_path / "m.keras")
    x = rng.normal(size=(30, 5))
    y = rng.integers(0, 3, size=30)
    np.savez(tmp_path / "pub.npz", x=x, y=y)
    out, png = tmp_path / "s.npz", tmp_path / "s.png"
    rc = cli.main(["spectrum", "--model", str(tmp_path / "m.keras"), "--public-x", str(tmp_path / "pub.npz"),
                   "--labels", "y", "--out", str(out), "--plot", str(png), "--pretrain-epochs", "0"])
    assert rc == 0
    summary = json.loads(capsys.readouterr().out)
    spec = Spectrum.load(out)
    assert summary["method"] == "exact" and summary["dimension"] == spec.dimension == 5 * 6 + 6 + 6 * 3 + 3
    ref = np.linalg.eigvalsh(reference_hessian(model, x, y, SCCE.call))[::-1]
    np.testing.assert_allclose(spec.expanded(), np.maximum(ref, 0), rtol=1e-5, atol=1e-8)  # float32 model
    assert png.stat().st_size > 1000
    # Errors are reported with exit status 2.
    rc = cli.main(["spectrum", "--model", str(tmp_path / "m.keras"), "--public-x", str(tmp_path / "pub.npz"),
                   "--labels", "nope", "--out", str(out)])
    assert rc == 2 and "nope" in capsys.readouterr().err


def test_dominance_certificate_logs_rho_during_fit(rng):
    model = tanh_mlp(inputs=4, hidden=(5,), outputs=3)
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss=SCCE)
    x, y = rng.normal(size=(48, 4)), rng.integers(0, 3, size=48)
    public = rng.normal(size=(40, 4))
    upper = 2.0 * reference_hessian(model, public, rng.integers(0, 3, size=40), SCCE.call)
    lam = np.linalg.eigvalsh(upper)
    upper = upper + (abs(lam[0]) + 0.1 * lam[-1]) * np.eye(upper.shape[0])  # positive definite
    seen = []

    class Grab(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if logs and "dominance_rho" in logs:
                seen.append(logs["dominance_rho"])

    cert = DominanceCertificate(x[:16], y[:16], upper=upper, every_n_steps=2, loss=SCCE)
    model.fit(x, y, batch_size=16, epochs=2, verbose=0, shuffle=False, callbacks=[cert, Grab()])
    assert [h["step"] for h in cert.history] == [2, 4, 6]
    assert seen == [h["rho"] for h in cert.history]
    # Last value recomputed independently at the final weights.
    H = reference_hessian(model, x[:16], y[:16], SCCE.call)
    ref = scipy.linalg.eigh(H, upper, eigvals_only=True)[-1]  # Ĥ full rank here
    assert cert.history[-1]["rho"] == pytest.approx(ref, rel=1e-4)
    # Ĥ computed once at train begin from public data.
    cert2 = DominanceCertificate(x[:16], y[:16], public_x=public, every_n_steps=3, loss=SCCE, seed=0)
    model.fit(x, y, batch_size=16, epochs=1, verbose=0, callbacks=[cert2])
    assert cert2.upper.shape == upper.shape and len(cert2.history) == 1
    with pytest.raises(ValueError, match="either upper"):
        DominanceCertificate(x, y)
