"""b = 1 agrees with TensorFlow Privacy's compute_dp_sgd_privacy_lib."""

import re

import pytest

pytest.importorskip("keras_noisecurve.integrations.tf_privacy",
                    reason="needs tensorflow-privacy: the tf-privacy extra (Python <= 3.11)")

from keras_noisecurve.backend.tensorflow.tf_privacy_import import import_tf_privacy  # noqa: E402
from keras_noisecurve.privacy import accounting as acc  # noqa: E402

LIB = "privacy.analysis.compute_dp_sgd_privacy_lib"
# q = 100/25600 = 2**-8 exactly, so TF Privacy's ceil(epochs / q) is exactly T.
N, B, DELTA = 25_600, 100, 1e-5


def _statement_epsilons(text):
    once = float(re.search(r"once per epoch:\s+([0-9.]+)", text).group(1))
    poisson = float(re.search(r"Poisson sampling \(\*\):\s+([0-9.]+)", text).group(1))
    return once, poisson


@pytest.mark.parametrize("accountant,sigma,epochs", [("rdp", 0.8, 3), ("pld", 0.75, 2)])
def test_bands_1_matches_tf_privacy(accountant, sigma, epochs):
    lib = import_tf_privacy(LIB)
    kind = lib.AccountantType.RDP if accountant == "rdp" else lib.AccountantType.PLD
    steps = epochs * N // B
    ours = acc.compute_epsilon(noise_multiplier=sigma, delta=DELTA, num_examples=N, batch_size=B,
                               steps=steps, bands=1, accountant=accountant)
    # the public statement prints 3 decimals
    text = lib.compute_dp_sgd_privacy_statement(
        number_of_examples=N, batch_size=B, num_epochs=float(epochs), noise_multiplier=sigma, delta=DELTA,
        used_microbatching=False, accountant_type=kind,
    )
    once, poisson = _statement_epsilons(text)
    assert ours >= 1.0  # so that 3 printed decimals resolve 1e-3 relative
    assert abs(ours - poisson) / poisson < 1e-3
    if accountant == "rdp":  # the lower-level function behind the statement, at full precision
        tfp_eps = lib._compute_dp_sgd_example_privacy(
            float(epochs), sigma, DELTA, used_microbatching=False, poisson_subsampling_probability=B / N,
            accountant_type=kind,
        )
        assert ours == pytest.approx(tfp_eps, rel=1e-9)
    # fixed epochs with b = 1 is TF Privacy's "each example once per epoch" bound
    fixed = acc.compute_epsilon(noise_multiplier=sigma, delta=DELTA, num_examples=N, batch_size=B, steps=steps,
                                bands=1, sampling="fixed_epochs", epochs=epochs, accountant=accountant)
    assert abs(fixed - once) / once < 1e-3
