"""``estimate_spectrum``: the Hessian-upper-bound spectrum from public data (paper §4).

Pipeline (paper §4.1 and §4.4):

1. Labels: ``y=None`` draws labels uniformly over the model's K output classes; a given
   ``y`` is used as is.
2. Pre-training: ``pretrain_epochs > 0`` trains a *clone* of the model (same weights) with
   plain SGD on (x, labels); the user's model is never modified. ``pretrain_epochs=0``
   measures at the model's current weights.
3. Hessian of the mean loss over (x, labels) at the resulting weights, in inference mode,
   with exact moments through GroupNormalization/LayerNormalization (``moments.py``).
4. ``method="exact"``: dense Hessian (p HVPs) and ``numpy.linalg.eigh``; ``"lanczos"``:
   top-k by Lanczos, p₊ = #{μ ≥ μ_min} by SLQ, power-law tail fit (paper eq. 3);
   ``"auto"``: exact when p ≤ ``exact_threshold`` (default 3,000: a 72 MB float64
   matrix and 3,000 HVPs), Lanczos otherwise.
5. Negative eigenvalues are clamped to 0 by ``Spectrum``.
"""

from __future__ import annotations

import time

import numpy as np

from keras_noisecurve._validation import check_choice, check_float, check_int
from keras_noisecurve.spectrum.artifact import Spectrum

DEFAULT_EXACT_THRESHOLD = 3000


def _prepare(model, x, y, *, loss, pretrain_epochs, pretrain_learning_rate, pretrain_batch_size, seed, verbose):
    """Labels + (optionally) a pre-trained clone. Returns (model_to_measure, labels, resolved, info)."""
    from keras_noisecurve.spectrum.losses import output_width, random_labels, resolve_loss
    from keras_noisecurve.spectrum.pretrain import clone_with_weights, pretrain

    x = np.asarray(x)
    if x.ndim < 1 or x.shape[0] < 1:
        raise ValueError(f"x must be an array of at least one example, got shape {x.shape}.")
    epochs = check_int("pretrain_epochs", pretrain_epochs, minimum=0)
    if not model.built:
        model(x[:1], training=False)
    k_out = output_width(model, x)
    resolved = resolve_loss(model, loss, num_outputs=k_out)
    info = {"loss": resolved.name, "num_outputs": k_out, "num_examples": int(x.shape[0])}
    if y is None:
        labels = random_labels(x.shape[0], num_outputs=k_out, label_kind=resolved.label_kind, seed=seed)
        info["labels"] = f"random ({resolved.label_kind}, uniform over {k_out} classes)"
    else:
        labels = np.asarray(y)
        if labels.shape[0] != x.shape[0]:
            raise ValueError(f"y must have one label per example of x ({x.shape[0]}), got {labels.shape[0]}.")
        info["labels"] = "given"
    target = model
    info["pretrain_epochs"] = epochs
    if epochs > 0:
        target = clone_with_weights(model)
        losses = pretrain(
            target,
            x,
            labels,
            loss_fn=resolved.fn,
            epochs=epochs,
            learning_rate=pretrain_learning_rate,
            batch_size=pretrain_batch_size,
            seed=seed,
            verbose=verbose,
        )
        info["pretrain_learning_rate"] = float(pretrain_learning_rate)
        info["pretrain_batch_size"] = int(pretrain_batch_size)
        info["pretrain_loss"] = [float(v) for v in losses]
    return target, x, labels, resolved, info


def upper_bound_hessian(
    model,
    x,
    y=None,
    *,
    loss=None,
    pretrain_epochs: int = 10,
    pretrain_learning_rate: float = 0.05,
    pretrain_batch_size: int = 64,
    batch_size: int = 256,
    seed=None,
    verbose: bool = False,
) -> np.ndarray:
    """Dense Hessian upper bound Ĥ (p, p) from public data (small models; paper §4.1).

    Same labels / pre-training as ``estimate_spectrum`` (random labels when ``y`` is None,
    a pre-trained clone when ``pretrain_epochs > 0``), then the dense Hessian of the mean
    loss. Useful as the ``upper`` of ``DominanceCertificate``.
    """
    from keras_noisecurve.spectrum.dense import dense_hessian
    from keras_noisecurve.spectrum.hvp import HessianOperator

    target, x, labels, resolved, _ = _prepare(
        model,
        x,
        y,
        loss=loss,
        pretrain_epochs=pretrain_epochs,
        pretrain_learning_rate=pretrain_learning_rate,
        pretrain_batch_size=pretrain_batch_size,
        seed=seed,
        verbose=verbose,
    )
    op = HessianOperator(target, x, labels, loss=resolved.fn, batch_size=batch_size)
    return dense_hessian(op, verbose=verbose)


def estimate_spectrum(
    model,
    x,
    y=None,
    *,
    loss=None,
    pretrain_epochs: int = 10,
    pretrain_learning_rate: float = 0.05,
    pretrain_batch_size: int = 64,
    method: str = "auto",
    top_k: int = 200,
    mu_min: float = 1e-6,
    slq_probes: int = 16,
    slq_steps: int = 80,
    lanczos_steps: int | None = None,
    lanczos_max_steps: int | None = None,
    lanczos_tol: float | None = None,
    tail_fit_from: float = 0.5,
    exact_threshold: int = DEFAULT_EXACT_THRESHOLD,
    tail_bins: int = 256,
    batch_size: int = 256,
    strategy=None,
    seed=None,
    verbose: bool = False,
) -> Spectrum:
    """Eigenvalues of a Hessian upper bound Ĥ measured on public data (paper §4).

    Args:
      model: a Keras 3 model (TensorFlow or JAX backend); never modified.
      x: (n, ...) public inputs.
      y: optional (n, ...) labels; ``None`` draws random labels uniform over the model's
        output classes (paper §4.1).
      loss: ``None`` (compiled loss, else inferred from the last activation), a name, a
        ``keras.losses.Loss`` or a per-example function.
      pretrain_epochs: random-label pre-training epochs of a clone (0: current weights).
      pretrain_learning_rate: SGD step size of the pre-training.
      pretrain_batch_size: pre-training batch size.
      method: "auto" (exact if p ≤ exact_threshold, else Lanczos), "exact" or "lanczos".
      top_k: k, eigenvalues computed by Lanczos (clipped to p).
      mu_min: μ_min > 0, the smallest eigenvalue that matters (paper: 1e-6); SLQ counts
        p₊ = #{μ ≥ μ_min} and the fitted tail ends there.
      slq_probes, slq_steps: SLQ Rademacher probes and Lanczos steps per probe.
      lanczos_steps: m, the Krylov basis size of the thick-restart Lanczos (memory m × p
        float64; default min(p, max(2k, k + 20))).
      lanczos_max_steps: the budget: at most this many HVPs for the top-k, all restarts
        together; restarts continue until every top-k residual ‖Ĥy − θy‖ ≤ 1e-8·max|θ|,
        and only a spent budget warns (default min(20·m, max(p, 2·m))).
      lanczos_tol: the convergence criterion ‖Ĥy − θy‖ ≤ lanczos_tol·max|θ| of every
        top-k value; default 1e-8 for a float64 model and 1e-6 otherwise (float32 HVPs
        are accurate to ≈1e-7 relative, so smaller residuals measure rounding: on the
        demo's CNN they stall between 1e-8 and 1e-7 once converged).
      tail_fit_from: fit eq. 3 on top-k indices ⌈tail_fit_from·k⌉ … k (``tail.fit_tail``).
      exact_threshold: largest p for which "auto" uses the dense Hessian.
      tail_bins: number of geometric bins of the compressed tail.
      batch_size: examples per HVP batch.
      strategy: optional ``tf.distribute.Strategy`` for the HVPs (TensorFlow backend only).
      seed: seed for labels, pre-training order, Lanczos start and SLQ probes.
      verbose: progress bars / messages.

    Returns:
      ``Spectrum`` of dimension p with provenance metadata: method, p, k, converged
      count, p₊ and its standard error, fit parameters and quality, pre-training,
      number of HVPs, seconds, and how normalisation-layer moments were handled.
    """
    from keras_noisecurve.spectrum.dense import dense_hessian
    from keras_noisecurve.spectrum.hvp import HessianOperator
    from keras_noisecurve.spectrum.moments import exact_moments_available

    check_choice("method", method, ("auto", "exact", "lanczos"))
    top_k = check_int("top_k", top_k, minimum=2)
    mu_min = check_float("mu_min", mu_min, positive=True)
    slq_probes = check_int("slq_probes", slq_probes, minimum=2)
    slq_steps = check_int("slq_steps", slq_steps, minimum=2)
    exact_threshold = check_int("exact_threshold", exact_threshold, minimum=1)
    tail_bins = check_int("tail_bins", tail_bins, minimum=1)
    batch_size = check_int("batch_size", batch_size, minimum=1)
    check_float("pretrain_learning_rate", pretrain_learning_rate, positive=True)
    check_int("pretrain_batch_size", pretrain_batch_size, minimum=1)
    started = time.perf_counter()
    target, x, labels, resolved, info = _prepare(
        model,
        x,
        y,
        loss=loss,
        pretrain_epochs=pretrain_epochs,
        pretrain_learning_rate=pretrain_learning_rate,
        pretrain_batch_size=pretrain_batch_size,
        seed=seed,
        verbose=verbose,
    )
    op = HessianOperator(target, x, labels, loss=resolved.fn, batch_size=batch_size, strategy=strategy)
    p = op.dimension
    if method == "auto":
        method = "exact" if p <= exact_threshold else "lanczos"
    meta = {
        "method": method,
        "dimension": p,
        "mu_min": mu_min,
        "seed": seed,
        **info,
        "moments": {
            "layers": op.moment_layers,
            "handling": ("exact (keras moments patched while computing HVPs)" if exact_moments_available() else "inexact: keras moments could not be patched")
            if op.moment_layers
            else "none needed",
        },
    }
    if method == "exact":
        H, asymmetry = dense_hessian(op, verbose=verbose, return_asymmetry=True)
        eig = np.linalg.eigvalsh(H)[::-1]
        meta.update(
            {
                "hessian_asymmetry": asymmetry,
                "num_negative": int(np.count_nonzero(eig < 0)),
                "min_eigenvalue": float(eig[-1]),
                "p_plus": int(np.count_nonzero(eig >= mu_min)),
                "p_plus_stderr": 0.0,
                "num_hvps": op.num_hvps,
                "seconds": time.perf_counter() - started,
            }
        )
        return Spectrum(eig, dimension=p, metadata=meta)

    values, mults, extra = _lanczos_spectrum(
        op,
        p=p,
        top_k=min(top_k, p),
        mu_min=mu_min,
        slq_probes=slq_probes,
        slq_steps=slq_steps,
        lanczos_steps=lanczos_steps,
        lanczos_max_steps=lanczos_max_steps,
        lanczos_tol=_default_tol(op) if lanczos_tol is None else check_float("lanczos_tol", lanczos_tol, positive=True),
        tail_bins=tail_bins,
        tail_fit_from=tail_fit_from,
        seed=seed,
        verbose=verbose,
    )
    meta.update(extra)
    meta["num_hvps"] = op.num_hvps
    meta["seconds"] = time.perf_counter() - started
    return Spectrum(values, mults, dimension=p, metadata=meta)


def _default_tol(op) -> float:
    """1e-8 when every variable is float64, else 1e-6 (the HVPs' float32 precision)."""
    wide = all(str(getattr(v, "dtype", "")).endswith("float64") for v in op.variables)
    return 1e-8 if wide else 1e-6


def _lanczos_spectrum(op, *, p, top_k, mu_min, slq_probes, slq_steps, lanczos_steps, lanczos_max_steps, lanczos_tol,
                      tail_bins, tail_fit_from, seed, verbose):
    """Top-k + SLQ p₊ + tail fit on a matvec; returns (values, multiplicities, metadata)."""
    from keras_noisecurve.spectrum.lanczos import lanczos_top_k
    from keras_noisecurve.spectrum.slq import slq_count
    from keras_noisecurve.spectrum.tail import fit_tail, tail_pairs

    top = lanczos_top_k(
        op.matvec, dimension=p, k=top_k, num_steps=lanczos_steps, max_steps=lanczos_max_steps, tol=lanczos_tol,
        seed=seed, verbose=verbose,
    )
    mu = top.eigenvalues
    extra = {
        "k": int(top_k),
        "lanczos_steps": int(top.num_steps),
        "lanczos_tol": float(lanczos_tol),
        "lanczos_restarts": int(top.num_restarts),
        "converged": int(top.num_converged),
        "converged_total": int(np.count_nonzero(top.converged)),
        "max_ritz_residual": float(np.max(top.residuals)),
    }
    above = int(np.count_nonzero(mu >= mu_min))
    values, mults = mu, np.ones_like(mu)
    if above < top_k or top_k == p:
        # μ_min is already inside the computed top-k: p₊ is known exactly, no tail.
        extra.update({"p_plus": above, "p_plus_stderr": 0.0, "p_plus_source": "top-k", "tail": None})
        return values, mults, extra
    slq = slq_count(op.matvec, dimension=p, threshold=mu_min, probes=slq_probes, steps=slq_steps, seed=seed, verbose=verbose)
    p_plus = int(np.clip(round(slq.estimate), above, p))
    extra.update(
        {
            "p_plus": p_plus,
            "p_plus_estimate": slq.estimate,
            "p_plus_stderr": slq.stderr,
            "p_plus_source": "slq",
            "slq_probes": slq_probes,
            "slq_steps": slq_steps,
        }
    )
    if p_plus <= top_k:
        extra["tail"] = None
        return values, mults, extra
    fit = fit_tail(mu, p_plus=p_plus, mu_min=mu_min, fit_from=tail_fit_from)
    tail_values, tail_mults = tail_pairs(fit, start=top_k + 1, cap=float(mu[-1]), num_bins=tail_bins)
    extra["tail"] = {
        **fit.as_dict(),
        "bins": int(tail_values.size),
        "first_index": top_k + 1,
        "capped_at": float(mu[-1]),
    }
    return np.concatenate([values, tail_values]), np.concatenate([mults, tail_mults]), extra
