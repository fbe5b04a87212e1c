"""Applications built on the public API of keras-noisecurve (the core never imports them).

- ``cli`` and its subcommands ``cli_spectrum``, ``cli_solve``, ``cli_calibrate``,
  ``cli_inspect``, ``cli_audit``, ``demo``: the ``noisecurve`` command line;
- ``strategy_options``: what each mixing-strategy kind takes on the command line;
- ``data``, ``models``, ``layers``: the bundled MNIST/digits data, the paper's model
  builders and their Keras layers (``layers`` registers the ghost-norm rule of its
  ``GroupNorm`` with the clipping engine when imported).

Submodules are imported on access (``from keras_noisecurve.apps import data``), so
``import keras_noisecurve.apps`` starts no TensorFlow.
"""
