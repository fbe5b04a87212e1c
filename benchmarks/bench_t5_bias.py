"""T5's private step with and without the relative-attention bias rule, in ONE process.

``bench_step.py --zoo --models t5``'s model and steps (``bench_zoo``: KerasHub T5Seq2SeqLM,
B = 32, L = 64, width 64, DP-SGD with ``clipping="auto"``): the non-private Keras step, the
private step with the rule of ``keras_noisecurve.backend.tensorflow.ghost_t5``, and the private step
with that rule switched off while it is traced (the per-layer fallback re-runs the two
attention layers that own the bias per example, as before the rule), interleaved over
``--repeats`` rounds of ``--steps`` steps. Prints the minimum over rounds (the least
disturbed on a loaded machine) and the median, in ms and as ratios to the non-private step.

    TF_ENABLE_ONEDNN_OPTS=1 PYTHONPATH=. python benchmarks/bench_t5_bias.py --repeats 6 --steps 2
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench_zoo
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests.training

import numpy as np  # noqa: E402

import bench_zoo  # noqa: E402
from keras_noisecurve.backend.tensorflow.ghost import describe  # noqa: E402
from keras_noisecurve.backend.tensorflow.ghost_t5 import RelativeAttentionBiasRule  # noqa: E402
from tests.training import zoo  # noqa: E402


def _never(self, layer):
    return False


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--length", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args(argv)
    size = zoo.Size(batch=args.batch_size, length=args.length, vocab=1000, width=64)
    plain, rule, _, inner = bench_zoo._steps("t5", size, args.batch_size)
    rule()  # traced with the rule
    matches = RelativeAttentionBiasRule.matches
    RelativeAttentionBiasRule.matches = _never
    try:
        _, fallback, _, inner_fallback = bench_zoo._steps("t5", size, args.batch_size)
        fallback()  # traced with the fallback
        off = sorted({how for *_, how in describe(inner_fallback)})
    finally:
        RelativeAttentionBiasRule.matches = matches
    print("rule:", sorted({how for *_, how in describe(inner)}), "| switched off:", off, flush=True)
    steps = {"plain": plain, "rule": rule, "fallback": fallback}
    for step in steps.values():
        step()
    times = {key: [] for key in steps}
    for r in range(args.repeats):
        for key, step in list(steps.items())[:: 1 if r % 2 else -1]:
            start = time.perf_counter()
            for _ in range(args.steps):
                out = step()
            float(out["loss"])
            times[key].append(1000 * (time.perf_counter() - start) / args.steps)
    print(f"TF_ENABLE_ONEDNN_OPTS={os.environ.get('TF_ENABLE_ONEDNN_OPTS', '(unset)')}, B = {args.batch_size}, "
          f"L = {args.length}, {args.repeats} rounds of {args.steps} steps")
    for name, stat in (("min", np.min), ("median", np.median)):
        t = {key: float(stat(v)) for key, v in times.items()}
        print(f"{name}: non-private {t['plain']:.1f} ms, private with the rule {t['rule']:.1f} ms "
              f"({t['rule'] / t['plain']:.2f}x), with the fallback {t['fallback']:.1f} ms "
              f"({t['fallback'] / t['plain']:.2f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
