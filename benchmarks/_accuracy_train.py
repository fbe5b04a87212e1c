"""Data, models and the private training loop of ``benchmarks/accuracy.py`` (numpy).

Split out of ``accuracy.py`` so that the benchmark driver (grid, mixing matrices,
statistics, report) and the arithmetic it runs stay separately readable. Everything here
is deterministic given its seeds; nothing here imports Keras.
"""

from __future__ import annotations

import dataclasses

import numpy as np


# ----------------------------------------------------------------------------- data
@dataclasses.dataclass
class Problem:
    x_train: np.ndarray  # (n, d) features incl. bias
    y_train: np.ndarray
    x_val: np.ndarray
    y_val: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    x_public: np.ndarray
    num_classes: int


def build_problem(pca_dim: int, split_seed: int = 0) -> Problem:
    """PCA features fitted on the public digits; MNIST-5k splits projected on them."""
    from keras_noisecurve.apps.data import load_mnist5k, load_public_digits

    splits = load_mnist5k(seed=split_seed)
    public = load_public_digits().reshape(-1, 784).astype(np.float64)
    mean = public.mean(axis=0)
    _, _, vt = np.linalg.svd(public - mean, full_matrices=False)
    basis = vt[:pca_dim].T  # (784, pca_dim)

    def feats(x):
        z = (x.reshape(len(x), -1).astype(np.float64) - mean) @ basis
        z /= np.maximum(np.linalg.norm(z, axis=1, keepdims=True), 1e-12)
        return np.hstack([z, np.ones((len(z), 1))])

    return Problem(
        feats(splits.x_train), splits.y_train, feats(splits.x_val), splits.y_val,
        feats(splits.x_test), splits.y_test, feats(public), 10,
    )


# ------------------------------------------------------------------------ models
def softmax(logits: np.ndarray) -> np.ndarray:
    z = logits - logits.max(axis=1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=1, keepdims=True)


def _residual(logits, y):
    """dL_i/dlogits_i = softmax − onehot, shape (n, k)."""
    r = softmax(logits)
    r[np.arange(len(y)), y] -= 1.0
    return r


class SoftmaxRegression:
    """Softmax regression on features x (bias included as a constant feature); w flat (d·k,)."""

    name = "softmax regression"

    def __init__(self, d: int, k: int):
        self.d, self.k, self.p = d, k, d * k

    def init(self, rng):
        return np.zeros(self.p)

    def logits(self, w, x):
        return x @ w.reshape(self.d, self.k)

    def mean_gradient(self, w, x, y):
        return (x.T @ _residual(self.logits(w, x), y) / len(y)).ravel()

    def per_example(self, w, x, y):
        """(norms, pieces): ‖x rᵀ‖_F = ‖x‖·‖r‖ without materialising per-example gradients."""
        r = _residual(self.logits(w, x), y)
        return np.linalg.norm(x, axis=1) * np.linalg.norm(r, axis=1), r

    def clipped_sum(self, w, x, y, clip):
        norms, r = self.per_example(w, x, y)
        f = np.minimum(1.0, clip / np.maximum(norms, 1e-12))
        return (x.T @ (r * f[:, None])).ravel()

    def hessian(self, w, x, y):
        """Exact Hessian of the mean cross-entropy, (p, p), index a·k + c (label-independent).

        H[(a,c),(b,e)] = (1/n) Σ_i x_ia x_ib (p_ic δ_ce − p_ic p_ie).
        """
        n, d = x.shape
        p = softmax(self.logits(w, x))
        k = self.k
        a = np.einsum("ic,ce->ice", p, np.eye(k)) - np.einsum("ic,ie->ice", p, p)
        return np.einsum("ia,ice,ib->acbe", x, a, x, optimize=True).reshape(d * k, d * k) / n


class TinyMLP:
    """One hidden ReLU layer: logits = [relu(x W1), 1] W2; w flat = (W1 (d, H), W2 (H+1, k)).

    Per-example gradients are outer products (W1: x ⊗ δh, W2: [h, 1] ⊗ r), so their norms
    and the clipped sum cost O(B·(d + H + k)·H) without materialising them.
    """

    name = "tiny MLP"

    def __init__(self, d: int, k: int, hidden: int):
        self.d, self.k, self.h = d, k, hidden
        self.p = d * hidden + (hidden + 1) * k

    def split(self, w):
        cut = self.d * self.h
        return w[:cut].reshape(self.d, self.h), w[cut:].reshape(self.h + 1, self.k)

    def init(self, rng):
        w1 = rng.standard_normal((self.d, self.h)) * np.sqrt(2.0 / self.d)
        w2 = rng.standard_normal((self.h + 1, self.k)) * np.sqrt(1.0 / (self.h + 1))
        w2[-1] = 0.0
        return np.concatenate([w1.ravel(), w2.ravel()])

    def _forward(self, w, x):
        w1, w2 = self.split(w)
        a = x @ w1
        ha = np.hstack([np.maximum(a, 0.0), np.ones((len(x), 1))])
        return a, ha, ha @ w2, w2

    def logits(self, w, x):
        return self._forward(w, x)[2]

    def _pieces(self, w, x, y):
        a, ha, logits, w2 = self._forward(w, x)
        r = _residual(logits, y)
        dh = (r @ w2[:-1].T) * (a > 0)
        return ha, r, dh

    def mean_gradient(self, w, x, y):
        ha, r, dh = self._pieces(w, x, y)
        return np.concatenate([(x.T @ dh).ravel(), (ha.T @ r).ravel()]) / len(y)

    def per_example(self, w, x, y):
        ha, r, dh = self._pieces(w, x, y)
        sq = (np.sum(x * x, 1) * np.sum(dh * dh, 1)) + (np.sum(ha * ha, 1) * np.sum(r * r, 1))
        return np.sqrt(sq), (ha, r, dh)

    def clipped_sum(self, w, x, y, clip):
        norms, (ha, r, dh) = self.per_example(w, x, y)
        f = np.minimum(1.0, clip / np.maximum(norms, 1e-12))[:, None]
        return np.concatenate([(x.T @ (dh * f)).ravel(), (ha.T @ (r * f)).ravel()])

    def hvp(self, w, x, y, v):
        """Exact Hessian-vector product of the mean cross-entropy (Pearlmutter's R-operator).

        ReLU is piecewise linear, so its second derivative is 0 almost everywhere; the
        Hessian is the Gauss-Newton part plus the W1-W2 cross terms, both included.
        """
        w1, w2 = self.split(w)
        v1, v2 = self.split(v)
        a = x @ w1
        mask = (a > 0).astype(a.dtype)
        ha = np.hstack([a * mask, np.ones((len(x), 1))])
        p = softmax(ha @ w2)
        r = p.copy()
        r[np.arange(len(y)), y] -= 1.0
        r_a = x @ v1
        r_ha = np.hstack([r_a * mask, np.zeros((len(x), 1))])
        r_z = r_ha @ w2 + ha @ v2
        r_r = p * (r_z - np.sum(p * r_z, axis=1, keepdims=True))
        g2 = r_ha.T @ r + ha.T @ r_r
        r_dh = (r_r @ w2[:-1].T + r @ v2[:-1].T) * mask
        g1 = x.T @ r_dh
        return np.concatenate([g1.ravel(), g2.ravel()]) / len(y)

    def hessian(self, w, x, y):
        """Exact dense Hessian, column by column from ``hvp``, symmetrised (p HVPs)."""
        h = np.empty((self.p, self.p))
        e = np.zeros(self.p)
        for i in range(self.p):
            e[i] = 1.0
            h[:, i] = self.hvp(w, x, y, e)
            e[i] = 0.0
        return 0.5 * (h + h.T)


def make_model(args, problem):
    d = problem.x_train.shape[1]
    if args.model == "softmax":
        return SoftmaxRegression(d, problem.num_classes)
    return TinyMLP(d, problem.num_classes, args.hidden)


def random_labels(n, k, seed):
    return np.random.default_rng([seed, 7]).integers(0, k, size=n)


def random_label_pretrain(model, x, num_classes, *, steps, lr, seed):
    """Full-batch GD on random labels (paper §4.1); returns (weights, labels)."""
    y = random_labels(len(x), num_classes, seed)
    w = model.init(np.random.default_rng([seed, 8]))
    for _ in range(steps):
        w = w - lr * model.mean_gradient(w, x, y)
    return w, y


def clipping_scale(model, w, x, y, clip: float) -> float:
    """Mean of min(1, ζ/‖g_i‖) over PUBLIC examples with their random labels at w.

    With clipping, the clipped mean gradient is ≈ s·∇L, so the curvature the
    dynamics see is s·μ: the NoiseCurve objectives get learning_rate η·s (the same
    rule as ``keras_noisecurve.spectrum.clipping_scale``).
    """
    norms, _ = model.per_example(w, x, y)
    return float(np.mean(np.minimum(1.0, clip / np.maximum(norms, 1e-12))))


def cyclic_poisson_batches(n: int, batch_size: int, bands: int, steps: int, rng: np.random.Generator):
    """Index arrays of T batches: b fixed balanced partitions, partition t mod b, q = B·b/n."""
    perm = rng.permutation(n)
    parts = np.array_split(perm, bands)
    q = batch_size * bands / n
    if q > 1:
        raise ValueError(f"batch_size·bands/n = {q:.3f} > 1: bands {bands} too large for B={batch_size}, n={n}.")
    return [parts[t % bands][rng.random(len(parts[t % bands])) < q] for t in range(steps)]


class HeavyBall:
    """Keras's ``SGD(momentum=β, nesterov=False)`` with learning rate η·s_t, in numpy.

    At step t = 0 … T−1, with s = ``rule.multipliers(T)`` (all ones without a rule)::

        m_{t+1} = β·m_t − η·s_t·g_t,        w_{t+1} = w_t + m_{t+1},        m_0 = 0

    in Keras's operation order (``m ← m·β − g·η_t``, then ``w ← w + m``). With β = 0 the
    step is ``w − η·s_t·g_t`` directly, bit-identical to the plain loop this replaced.
    """

    def __init__(self, lr: float, steps: int, rule=None):
        self.rates = lr * (np.ones(steps) if rule is None else rule.multipliers(steps))
        self.momentum = 0.0 if rule is None else float(rule.momentum)
        self.m = None

    def step(self, w, t: int, g):
        """Return w_{t+1} from w_t and the (privatized) gradient g_t."""
        if self.momentum == 0.0:
            return w - self.rates[t] * g
        m = np.zeros_like(w) if self.m is None else self.m
        self.m = m * self.momentum - g * self.rates[t]
        return w + self.m


def train_dp(problem: Problem, model, *, mixing, sigma: float, lr: float, clip: float, batch_size: int, seed: int,
             rule=None):
    """One private run; returns the final weights (None if they diverged).

    ĝ_t = (Σ clip(g_i, ζ) + ζσ·z̃_t)/B with z̃ = C⁻¹z, applied by ``HeavyBall`` (the update
    rule ``rule``: momentum and learning-rate schedule; None is plain SGD, w ← w − η·ĝ_t).
    Batches, raw noise z and initial weights depend only on ``seed`` (paired across methods).
    """
    x, y = problem.x_train, problem.y_train
    steps = mixing.steps
    batches = cyclic_poisson_batches(len(y), batch_size, mixing.bands, steps, np.random.default_rng([seed, 1]))
    z = np.random.default_rng([seed, 2]).standard_normal((steps, model.p))
    z_tilde = mixing.inverse_apply(z)  # the library's online recurrence C⁻¹z
    w = model.init(np.random.default_rng([seed, 3]))
    opt = HeavyBall(lr, steps, rule)
    for t in range(steps):
        idx = batches[t]
        gsum = model.clipped_sum(w, x[idx], y[idx], clip) if len(idx) else 0.0
        w = opt.step(w, t, (gsum + clip * sigma * z_tilde[t]) / batch_size)
        if not np.all(np.isfinite(w)):
            return None
    return w


def accuracy(model, w, x, y) -> float:
    if w is None:
        return 0.0
    return float(np.mean(np.argmax(model.logits(w, x), axis=1) == y))


def lr_candidates(rule=None):
    """Learning rates the non-private reference tries: {0.5 … 8}·(1 − β) (the same effective rate
    η/(1 − β) under momentum β)."""
    beta = 0.0 if rule is None else float(rule.momentum)
    return [float(f"{c * (1.0 - beta):.12g}") for c in (0.5, 1.0, 2.0, 4.0, 8.0)]


def nonprivate_reference(problem, model, args, rule=None):
    """Non-private full-batch GD (same model, same T, same update rule), learning rate picked on
    validation; returns (val, test, lr)."""
    best = None
    for lr in sorted({*lr_candidates(rule), *args.lr_grid}):
        w = model.init(np.random.default_rng([0, 3]))
        opt = HeavyBall(lr, args.steps, rule)
        for t in range(args.steps):
            w = opt.step(w, t, model.mean_gradient(w, problem.x_train, problem.y_train))
            if not np.all(np.isfinite(w)):
                break
        val = accuracy(model, w if np.all(np.isfinite(w)) else None, problem.x_val, problem.y_val)
        if best is None or val > best[0]:
            best = (val, accuracy(model, w, problem.x_test, problem.y_test), lr)
    return best
