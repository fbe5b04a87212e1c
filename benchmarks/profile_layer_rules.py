"""Per-layer cost of the ghost-clipping rules on a mobile network's own layer shapes.

For every distinct layer (class, input/output shape, kernel, strides) of EfficientNetB0 or
MobileNetV2 (32×32×3, ``weights=None``, BatchNormalization replaced), at B = 32 and in
isolation on random inputs: the rule's forward + ``analyse`` (per-example norms and the
clipped sum) and the non-private forward + weight gradient, each minus the rule's forward
alone (medians of 5 calls of a ``tf.function``). Printed per layer and summed by rule kind
over all the network's layers (a repeated shape counts every time). Differences of a few
tenths of a millisecond are noise on a loaded machine (some come out negative).

    PYTHONPATH=. python benchmarks/profile_layer_rules.py --model efficientnetb0
"""

from __future__ import annotations

import argparse
import collections
import os
import time

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from keras_noisecurve.training.batchnorm import replace_batch_normalization  # noqa: E402
from keras_noisecurve.backend.tensorflow.engine_rules import find_rule  # noqa: E402

BUILDERS = {"efficientnetb0": keras.applications.EfficientNetB0, "mobilenetv2": keras.applications.MobileNetV2}


def _median_ms(fn, repeats=5):
    fn(), fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for t in tf.nest.flatten(fn()):
            t.numpy()
        times.append(time.perf_counter() - start)
    return float(np.median(times)) * 1e3


def _layer_costs(layer, rule, batch):
    """(rule analyse ms, non-private weight-gradient ms), both net of the rule's forward."""
    x = tf.random.normal((batch, *layer.input.shape[1:]))
    recorded = {}
    rule.forward(layer, layer.call, lambda **t: recorded.update(t), x)
    g = tf.random.normal(tf.shape(recorded["out"]))
    scale = tf.random.uniform((batch,))

    def forward(x):
        rec = {}
        rule.forward(layer, layer.call, lambda **t: rec.update(t), x)
        return rec

    @tf.function
    def private(x, g):
        total, grads = rule.analyse(layer, [{**forward(x), "g": g}])
        return total, [v for _, v in grads(scale)]

    @tf.function
    def plain(x, g):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(forward(x)["out"] * g)
        return tape.gradient(loss, layer.trainable_weights)

    only_forward = tf.function(lambda x: forward(x)["out"])
    base = _median_ms(lambda: only_forward(x))
    return _median_ms(lambda: private(x, g)) - base, _median_ms(lambda: plain(x, g)) - base


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(BUILDERS), default="efficientnetb0")
    parser.add_argument("--batch-size", type=int, default=32)
    args = parser.parse_args(argv)
    model = replace_batch_normalization(BUILDERS[args.model](weights=None, input_shape=(32, 32, 3), classes=10,
                                                             classifier_activation=None))
    seen, by_kind = {}, collections.defaultdict(lambda: [0.0, 0.0, 0])
    for layer in model.layers:
        if not layer.trainable_weights:
            continue
        rule = find_rule(layer)
        key = (type(layer).__name__, tuple(layer.input.shape[1:]), tuple(layer.output.shape[1:]),
               tuple(getattr(layer, "kernel_size", ())), tuple(getattr(layer, "strides", ())))
        if key not in seen:
            seen[key] = _layer_costs(layer, rule, args.batch_size)
            print(f"{rule.kind:18s} {str(key[1:]):52s} rule {seen[key][0]:7.2f} ms  "
                  f"non-private weight gradient {seen[key][1]:7.2f} ms", flush=True)
        total = by_kind[rule.kind]
        total[0], total[1], total[2] = total[0] + seen[key][0], total[1] + seen[key][1], total[2] + 1
    print("\n| rule | layers | rule ms | non-private weight-gradient ms |\n|---|---|---|---|")
    for kind, (ours, theirs, n) in by_kind.items():
        print(f"| {kind} | {n} | {ours:.1f} | {theirs:.1f} |")


if __name__ == "__main__":
    main()
