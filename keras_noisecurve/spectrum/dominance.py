"""``DominanceCertificate``: log ρ(H_t, Ĥ) (paper Theorem 4.1) during ``model.fit``.

Every ``every_n_steps`` training steps the callback computes the dense Hessian H_t of
the training loss on a fixed probe set (x, y) at the current weights (small models only:
p ≤ ``max_parameters``), then ρ(H_t, Ĥ) with ``dominance_ratio`` (generalised eigenvalue
problem on the range of Ĥ, 0/0 = 0, +∞ when H_t has curvature outside that range).
ρ ≤ 1 certifies H_t ⪯ Ĥ; ρ > 1 says by how much Ĥ must be scaled to dominate.

Ĥ is given as a dense (p, p) matrix (e.g. from ``upper_bound_hessian`` after random-label
pre-training) or computed once when training begins from ``public_x`` (random labels if
``public_y`` is None) at the weights the model starts from, with its negative eigenvalues
clamped to 0 (paper §4.1).
"""

from __future__ import annotations

import keras
import numpy as np

from keras_noisecurve._validation import check_int
from keras_noisecurve.spectrum.certificate import dominance_ratio


class DominanceCertificate(keras.callbacks.Callback):
    """Keras callback logging ``logs["dominance_rho"]`` every N training steps.

    Args:
      x, y: probe set of the training data on which H_t is measured (n, ...).
      upper: Ĥ, (p, p) array; or None to compute it from ``public_x`` at train begin.
      public_x, public_y: public data for Ĥ when ``upper`` is None.
      every_n_steps: N ≥ 1 (a step is one training batch; step counting spans epochs).
      loss: as in ``estimate_spectrum`` (default: the model's compiled loss).
      batch_size: HVP batch size.
      rcond: range threshold of Ĥ for ``dominance_ratio``.
      max_parameters: refuse models with more parameters (dense p × p Hessians).
      seed: random-label seed for Ĥ.
      verbose: print ρ when computed.

    Attributes:
      history: list of {"step": int, "epoch": int, "rho": float}.
      upper: the Ĥ in use.
    """

    def __init__(
        self,
        x,
        y,
        *,
        upper=None,
        public_x=None,
        public_y=None,
        every_n_steps: int = 100,
        loss=None,
        batch_size: int = 256,
        rcond: float = 1e-10,
        max_parameters: int = 3000,
        seed=None,
        verbose: bool = False,
    ):
        super().__init__()
        if y is None:
            raise ValueError("y (the training labels of the probe set) is required: H_t is the training-loss Hessian.")
        if upper is None and public_x is None:
            raise ValueError("give either upper (a dense Ĥ) or public_x (to compute Ĥ at train begin).")
        self.x = np.asarray(x)
        self.y = np.asarray(y)
        self.upper = None if upper is None else np.asarray(upper, dtype=np.float64)
        self.public_x = public_x
        self.public_y = public_y
        self.every_n_steps = check_int("every_n_steps", every_n_steps, minimum=1)
        self.loss = loss
        self.batch_size = check_int("batch_size", batch_size, minimum=1)
        self.rcond = rcond
        self.max_parameters = check_int("max_parameters", max_parameters, minimum=1)
        self.seed = seed
        self.verbose = verbose
        self.history = []
        self._step = 0
        self._epoch = 0
        self._probe_op = None

    def _operator(self, x, y):
        from keras_noisecurve.spectrum.hvp import HessianOperator

        return HessianOperator(self.model, x, y, loss=self.loss, batch_size=self.batch_size)

    def _dense(self, x, y):
        from keras_noisecurve.spectrum.dense import dense_hessian

        op = self._operator(x, y)
        if op.dimension > self.max_parameters:
            raise ValueError(
                f"DominanceCertificate needs dense Hessians; the model has {op.dimension} parameters, "
                f"more than max_parameters={self.max_parameters}."
            )
        return dense_hessian(op)

    def compute_rho(self) -> float:
        """ρ(H_t, Ĥ) at the model's current weights."""
        from keras_noisecurve.spectrum.dense import dense_hessian

        if self._probe_op is None or self._probe_op.model is not self.model:
            self._probe_op = self._operator(self.x, self.y)  # traced once, reads current weights
            if self._probe_op.dimension > self.max_parameters:
                raise ValueError(
                    f"DominanceCertificate needs dense Hessians; the model has {self._probe_op.dimension} "
                    f"parameters, more than max_parameters={self.max_parameters}."
                )
        H = dense_hessian(self._probe_op)
        if self.upper.shape != H.shape:
            raise ValueError(f"upper has shape {self.upper.shape}, the model's Hessian {H.shape}.")
        return dominance_ratio(H, self.upper, rcond=self.rcond)

    def on_train_begin(self, logs=None):
        if self.upper is None:
            y = self.public_y
            if y is None:
                from keras_noisecurve.spectrum.losses import output_width, random_labels, resolve_loss

                k = output_width(self.model, np.asarray(self.public_x))
                kind = resolve_loss(self.model, self.loss, num_outputs=k).label_kind
                y = random_labels(np.asarray(self.public_x).shape[0], num_outputs=k, label_kind=kind, seed=self.seed)
            H = self._dense(np.asarray(self.public_x), np.asarray(y))
            # Negative curvature is clamped to 0, as for the spectrum (paper §4.1): Ĥ = U max(Λ, 0) Uᵀ.
            lam, vec = np.linalg.eigh(H)
            self.upper = (vec * np.maximum(lam, 0.0)) @ vec.T

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        self._step += 1
        if self._step % self.every_n_steps:
            return
        rho = self.compute_rho()
        self.history.append({"step": self._step, "epoch": self._epoch, "rho": rho})
        if logs is not None:
            logs["dominance_rho"] = rho
        if self.verbose:
            print(f"\nstep {self._step}: dominance rho = {rho:.4g}")
