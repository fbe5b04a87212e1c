"""The user-level LoRA recipe of docs/models.md as a test body, for either backend.

:func:`check_user_level` runs the docs block in this process (in a temporary folder) and checks
that it trained the plan's steps with a moving adaptive clip, that only the LoRA'd layers'
trainable weights changed, that ε is within the target, and, on the plan's first batch, that the
model's own clipping engine clips per USER: each user's norm is the norm of the gradient of the
user's weighted rows together, and the clipped sum is ``Σ_u clip(G_u, ζ)``, both against a
per-user loop of plain gradients (the backend's autodiff, an independent per-sequence loss), and
that the LoRA'd projections keep their ghost rule for the units (no per-layer fallback).
"""

import os

import keras
import numpy as np

from tests.e2e.test_docs_code import parse_blocks

HEADING = "## User-level privacy for a language model: LoRA, users, an adaptive clip"
FIT = "history = private.fit("  # the block is run in two parts, split at this line


def block_code() -> str:
    """The python block right under :data:`HEADING` in docs/models.md."""
    blocks, problems = parse_blocks(os.path.join("docs", "models.md"))
    assert not problems, problems
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    text = open(os.path.join(root, "docs", "models.md"), encoding="utf-8").read().split("\n")
    start = text.index(HEADING) + 1
    block = next(b for b in blocks if b.line > start)
    return block.code


def _numpy(t):
    return np.asarray(keras.ops.convert_to_numpy(t))


def _sequence_losses(y, logits):
    """(P,) each sequence's loss, the mean cross-entropy over its real tokens (label ≠ 0), written
    here with ``keras.ops`` (not the library's per-example loss)."""
    ops = keras.ops
    ce = ops.sparse_categorical_crossentropy(ops.maximum(y, 0), ops.cast(logits, "float32"), from_logits=True)
    real = ops.cast(ops.not_equal(y, 0), "float32")
    return ops.sum(ce * real, axis=1) / ops.maximum(ops.sum(real, axis=1), 1.0)


def _grad_of(model):
    """``grad(x, y, w)``: the plain gradient of ``Σ_j w_j·loss_j`` (the rows of one user) with
    respect to ``model.trainable_variables``, float64 numpy."""
    if keras.backend.backend() == "jax":
        import jax
        import jax.numpy as jnp

        trainable = [v.value for v in model.trainable_variables]
        non_trainable = [v.value for v in model.non_trainable_variables]

        def loss(tv, x, y, w):
            logits, _ = model.stateless_call(tv, non_trainable, x, training=True)
            return jnp.sum(_sequence_losses(y, logits) * w)

        grad = jax.jit(jax.grad(loss))
        return lambda x, y, w: [np.asarray(g, np.float64) for g in grad(trainable, x, y, jnp.asarray(w))]
    import tensorflow as tf

    def grad_tf(x, y, w):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(_sequence_losses(y, model(x, training=True)) * w)
        return [np.asarray(g.numpy(), np.float64) for g in tape.gradient(loss, model.trainable_variables)]

    return grad_tf


def _engine(private, x, y, w, clip, unit_rows):
    """``(norms (P,), clipped sums, [(layer name, rule kind)])`` of the private model's own
    clipping engine (the one ``fit`` uses) on one batch, with units of ``unit_rows`` rows."""
    from keras_noisecurve.backend.common import norm_observer

    if keras.backend.backend() == "jax":
        import jax.numpy as jnp

        trainable = [v.value for v in private.trainable_variables]
        non_trainable = [v.value for v in private.non_trainable_variables]
        with norm_observer.observe_layer_norms() as seen:
            sums, norms, _, _, _ = private._dp_clipped_sum()(
                private, private._dp_loss_fn, trainable, non_trainable, x, y, jnp.asarray(w),
                l2_norm_clip=clip, training=True, unit_rows=unit_rows)
        rules = [(layer.name, rule) for layer, rule, _, _ in seen]
    else:
        from keras_noisecurve.backend.tensorflow.clipping import get_engine

        with norm_observer.observe_layer_norms() as seen:
            out = get_engine(private._dp_clipping, private)(private, private._dp_loss_fn, x, y, w,
                                                            l2_norm_clip=clip, training=True, unit_rows=unit_rows)
        sums, norms = out.grads, out.norms
        rules = [(layer.name, rule.kind) for layer, rule, _, _ in seen]
    return _numpy(norms).astype(np.float64), [_numpy(s).astype(np.float64) for s in sums], rules


def check_user_clipping(private, run, x, y, users):
    """On the plan's first batch with two users or more, one of them of several rows, the
    engine's per-user norms and clipped sum equal a per-user loop; the LoRA'd projections keep
    their ``LoRA`` rule on the merged rows of a user."""
    k = run.examples_per_user
    data = run.dataset(x, y, users=users)
    # the plan's batches with the run's own key, which the recipe leaves random (no seed): a step
    # may sample fewer than two users (about 0.5 % of the runs at step 0: 15 users at rate 0.4), so take the
    # first that has two
    seen = []
    for xb, yb, wb, _ in data.batches():
        wb = _numpy(wb).astype(np.float32)
        assert len(wb) == run.padded_rows and len(wb) % k == 0
        slots = wb.reshape(-1, k)
        real = [u for u in range(len(slots)) if slots[u].sum() > 0]
        sizes = {u: int((slots[u] > 0).sum()) for u in real}
        seen.append(sizes)
        if len(real) >= 2 and max(sizes.values()) > 1:  # users of several rows in the batch
            break
    else:
        raise AssertionError(f"no step of the plan has two users, one of several rows: {seen}")
    xb = {name: _numpy(t) for name, t in xb.items()}
    yb = _numpy(yb)
    for u in real:  # each real row of a user with m rows weighs 1/m
        np.testing.assert_allclose(slots[u][: sizes[u]], 1.0 / sizes[u], rtol=1e-6)
        assert not slots[u][sizes[u]:].any()

    grad = _grad_of(private)
    ref = {}
    for u in real:  # the user's real rows only: its plain gradient G_u = Σ_j w_j·∇loss_j
        rows = slice(u * k, u * k + sizes[u])
        ref[u] = grad({name: t[rows] for name, t in xb.items()}, yb[rows], wb[rows])
    ref_norms = {u: np.sqrt(sum(np.sum(g ** 2) for g in ref[u])) for u in real}
    clip = float(np.median(list(ref_norms.values())))  # some users clipped, some not

    norms, sums, rules = _engine(private, xb, yb, wb, clip, k)
    assert rules and all(kind == "LoRA" for _, kind in rules), rules  # no fallback for a unit of k rows
    assert sorted(name for name, _ in rules) == ["query", "value"], rules
    unit_norms = norms.reshape(-1, k)
    assert np.all(unit_norms == unit_norms[:, :1])  # a user's norm on each of its rows
    for u in real:
        np.testing.assert_allclose(unit_norms[u, 0], ref_norms[u], rtol=1e-4, err_msg=f"user slot {u}")
    for u in range(len(slots)):
        if u not in real:
            assert unit_norms[u, 0] == 0  # a padding slot
    want = [sum(min(1.0, clip / ref_norms[u]) * ref[u][i] for u in real) for i in range(len(sums))]
    got, want = np.concatenate([s.ravel() for s in sums]), np.concatenate([w.ravel() for w in want])
    assert np.linalg.norm(got - want) <= 1e-4 * np.linalg.norm(want)
    # not the example-level clip: clipping each row alone gives another sum
    rows_norms, rows_sums, _ = _engine(private, xb, yb, wb, clip, 1)
    several = [u for u in real if sizes[u] > 1]
    assert not np.allclose(rows_norms.reshape(-1, k)[several, 0], unit_norms[several, 0], rtol=1e-3)
    return sizes


def check_user_level(tmp_path, monkeypatch):
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    monkeypatch.chdir(root)
    code = block_code()
    assert code.count(FIT) == 1
    head, tail = code.split(FIT)
    monkeypatch.chdir(tmp_path)
    namespace = {"__name__": "__main__"}
    where = "docs/models.md (user-level privacy for a language model)"
    exec(compile(head, where, "exec"), namespace)
    lm = namespace["lm"]
    before = {v.path: _numpy(v.value).copy() for v in lm.weights}
    exec(compile(FIT + tail, where, "exec"), namespace)
    private, run, history = namespace["private"], namespace["run"], namespace["history"]
    users = namespace["users"]

    # the run is the recipe's: users, k, an adaptive clip
    assert run.privacy_unit == "user" and run.num_users == 30 and run.examples_per_user == 4
    assert len(users) == 240 and len(np.unique(users)) == 30
    counts = np.bincount(np.unique(users, return_inverse=True)[1])
    assert counts.min() <= 2 and counts.max() >= 20  # very uneven users
    assert run.adaptive_clip is not None

    # the plan's steps, a clip that moved, ε within the target
    assert int(_numpy(private.optimizer.iterations.value)) == run.steps
    clips = np.asarray(history.history["l2_norm_clip"], np.float64)
    assert len(clips) == run.epochs and np.all(np.isfinite(clips)) and np.all(clips > 0)
    assert np.all(np.abs(clips - run.adaptive_clip.initial) > 1e-3), clips
    assert np.all(np.isfinite(history.history["loss"]))
    assert run.epsilon() <= run.target_epsilon * (1 + 1e-6)

    # only the LoRA'd layers' trainable weights moved (their factors, their biases)
    trainable = {v.path for v in lm.trainable_variables}
    assert trainable and all(("query" in p or "value" in p) and ("lora" in p or "bias" in p) for p in trainable)
    changed = {v.path for v in lm.weights if not np.array_equal(_numpy(v.value), before[v.path])}
    assert changed <= trainable, sorted(changed - trainable)
    assert [p for p in changed if "lora_kernel_b" in p] and [p for p in changed if "lora_kernel_a" in p]

    check_user_clipping(private, run, namespace["x"], namespace["y"], users)
