"""The one place that imports TensorFlow Privacy submodules.

TensorFlow Privacy is optional: ``pip install "keras-noisecurve[tf-privacy]"``.
Its last release (0.9.0) supports Python <= 3.11 only and pins numpy < 2.

``import tensorflow_privacy`` fails on TensorFlow >= 2.16 (it imports
``tensorflow_estimator``'s ``estimator_training``). Setting
``sys.skip_tf_privacy_import = True`` before importing its submodules skips the
package's eager ``__init__`` imports; its ``privacy.analysis.*`` and
``privacy.dp_query.*`` modules then work under Keras 3.
Every other module of this library goes through :func:`import_tf_privacy`.
"""

from __future__ import annotations

import importlib
import sys

INSTALL_HINT = 'pip install "keras-noisecurve[tf-privacy]"'


def missing_message() -> str:
    """The error message when tensorflow-privacy is not installed."""
    running = f"{sys.version_info.major}.{sys.version_info.minor}"
    return (
        "keras_noisecurve.integrations.tf_privacy needs TensorFlow Privacy, an optional extra: "
        f"{INSTALL_HINT}. tensorflow-privacy supports Python <= 3.11 only (this is Python {running}); "
        "the rest of keras-noisecurve does not need it."
    )


def import_tf_privacy(module: str):
    """Import ``tensorflow_privacy.<module>`` with the TF >= 2.16 workaround.

    Args:
      module: dotted path below ``tensorflow_privacy``, e.g.
        ``"privacy.dp_query.dp_query"``.

    Raises:
      ModuleNotFoundError: (an ``ImportError``) naming the ``tf-privacy`` extra and
        the Python limit if tensorflow-privacy is not installed.
    """
    sys.skip_tf_privacy_import = True
    try:
        return importlib.import_module(f"tensorflow_privacy.{module}")
    except ModuleNotFoundError as exc:
        if exc.name == "tensorflow_privacy":
            raise ModuleNotFoundError(missing_message(), name="tensorflow_privacy") from exc
        raise
