"""Write the model and data files that docs/audit.md's ``noisecurve audit --model`` runs use.

    python benchmarks/audit_mechanism_files.py --out /tmp/audit_files

writes, for two private models compiled with their run (nothing is trained, no download):

- ``cnn.keras`` / ``cnn.npz``: the bundled GroupNorm CNN (``apps.models.small_groupnorm_cnn``)
  on the bundled MNIST training split (3,500 images), DP-BandMF (b = 4) with momentum SGD,
  B = 250, T = 140, fixed epochs, ε = 2;
- ``bert.keras`` / ``bert.npz``: a KerasHub ``BertTextClassifier`` built from a small config
  (2 layers, width 32, random weights) on 512 random token sequences of length 16, banded
  Toeplitz (b = 4) with Adam, B = 32, cyclic Poisson, 32 steps, ε = 4;

then prints the commands to run. Generated files: never commit them.
"""

from __future__ import annotations

import argparse
import os

import numpy as np


def _cnn(out):
    import keras

    import keras_noisecurve as knc
    from keras_noisecurve.apps import data, models

    splits = data.load_mnist5k()
    x, y = splits.x_train, splits.y_train
    steps = 140
    rule = knc.UpdateRule(momentum=0.9)
    mixing = knc.solve_mixing_matrix(steps=steps, bands=4, objective="bandmf", update_rule=rule)
    run = knc.PrivateRun(num_examples=len(y), batch_size=250, steps=steps, mixing=mixing, epsilon=2.0, delta=1e-5,
                         sampling="fixed_epochs")
    model = models.small_groupnorm_cnn((28, 28, 1), 10, dense_size=32)
    private = knc.make_private(model)
    private.compile(optimizer=knc.NoiseCurveOptimizer(run=run, l2_norm_clip=1.0,
                                                      inner=keras.optimizers.SGD(0.4, momentum=0.9)),
                    loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    private.save(os.path.join(out, "cnn.keras"))
    np.savez(os.path.join(out, "cnn.npz"), x=x, y=y)


def _bert(out):
    import keras
    import keras_hub

    import keras_noisecurve as knc

    rng = np.random.default_rng(0)
    n, length, vocab = 512, 16, 100
    backbone = keras_hub.models.BertBackbone(vocabulary_size=vocab, num_layers=2, num_heads=2, hidden_dim=32,
                                             intermediate_dim=64, max_sequence_length=length, dropout=0.0)
    model = keras_hub.models.BertTextClassifier(backbone=backbone, num_classes=3, preprocessor=None, dropout=0.0)
    ids = rng.integers(1, vocab, size=(n, length)).astype("int32")
    mask = np.ones((n, length), "int32")
    for i in range(n):  # sequences of different lengths (padding id 0, mask 0)
        cut = length - int(rng.integers(0, 6))
        ids[i, cut:], mask[i, cut:] = 0, 0
    y = rng.integers(0, 3, n)
    mixing = knc.solve_mixing_matrix(steps=32, bands=4, strategy="toeplitz", objective="bandmf")
    run = knc.PrivateRun(num_examples=n, batch_size=32, steps=32, mixing=mixing, epsilon=4.0, delta=1e-5,
                         sampling="cyclic_poisson")
    private = knc.make_private(model)
    private.compile(optimizer=knc.NoiseCurveOptimizer(run=run, l2_norm_clip=1.0, inner=keras.optimizers.Adam(1e-3)),
                    loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    private(
        {"token_ids": ids[:1], "segment_ids": np.zeros_like(ids[:1]), "padding_mask": mask[:1]}, training=False)
    private.save(os.path.join(out, "bert.keras"))
    np.savez(os.path.join(out, "bert.npz"), x_token_ids=ids, x_segment_ids=np.zeros_like(ids), x_padding_mask=mask,
             y=y)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    _cnn(args.out)
    _bert(args.out)
    for name in ("cnn", "bert"):
        print(f"noisecurve audit --model {args.out}/{name}.keras --data {args.out}/{name}.npz")


if __name__ == "__main__":
    main()
