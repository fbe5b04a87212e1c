"""The one place that imports TensorFlow Privacy submodules.

``import tensorflow_privacy`` fails on TensorFlow >= 2.16 (it imports
``tensorflow_estimator``'s ``estimator_training``). Setting
``sys.skip_tf_privacy_import = True`` before importing its submodules skips the
package's eager ``__init__`` imports; its ``privacy.analysis.*`` and
``privacy.dp_query.*`` modules then work under Keras 3 (DESIGN.md §6).
Every other module of this library goes through :func:`import_tf_privacy`.
"""

from __future__ import annotations

import importlib
import sys


def import_tf_privacy(module: str):
    """Import ``tensorflow_privacy.<module>`` with the TF >= 2.16 workaround.

    Args:
      module: dotted path below ``tensorflow_privacy``, e.g.
        ``"privacy.dp_query.dp_query"``.

    Raises:
      ImportError: with install instructions if tensorflow-privacy is missing.
    """
    sys.skip_tf_privacy_import = True
    try:
        return importlib.import_module(f"tensorflow_privacy.{module}")
    except ModuleNotFoundError as exc:
        if exc.name and exc.name.startswith("tensorflow_privacy"):
            raise ImportError(
                "This feature needs tensorflow-privacy: pip install 'tensorflow-privacy==0.9.0'."
            ) from exc
        raise
