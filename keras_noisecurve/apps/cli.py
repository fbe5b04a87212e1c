"""The ``noisecurve`` command line: ``spectrum | solve | calibrate | inspect | demo``.

Each subcommand is a module of ``keras_noisecurve.apps`` (``cli_spectrum``,
``cli_solve``, ``cli_calibrate``, ``cli_inspect``, ``demo``, ``cli_audit``) that defines
``add_arguments(parser)`` and ``run(args) -> int`` and calls the library's public API;
this file only dispatches, and imports a subcommand's module (and so Keras's backend) only
when that subcommand runs.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from keras_noisecurve import __version__
from keras_noisecurve._quiet import quiet_startup  # noqa: F401 - used by main, re-exported

# name -> (module, one-line help)
SUBCOMMANDS = {
    "spectrum": ("keras_noisecurve.apps.cli_spectrum", "estimate a Hessian-upper-bound spectrum from public data"),
    "solve": ("keras_noisecurve.apps.cli_solve", "solve a mixing strategy C (banded, toeplitz, blt, bisr) and save it"),
    "calibrate": ("keras_noisecurve.apps.cli_calibrate", "calibrate the noise multiplier for a target (epsilon, delta)"),
    "inspect": ("keras_noisecurve.apps.cli_inspect", "show a mixing-matrix file: metadata, norms, expected error"),
    "demo": ("keras_noisecurve.apps.demo", "run the whole pipeline end to end on bundled MNIST data"),
    "audit": ("keras_noisecurve.apps.cli_audit", "audit a training configuration: empirical epsilon lower bound"),
}

#: subcommands that start Keras's backend (the others are numpy/scipy only)
USES_BACKEND = frozenset({"spectrum", "demo"})


def main(argv=None) -> int:
    """Entry point of the ``noisecurve`` console script; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    if args.command in USES_BACKEND:
        quiet_startup(_start_backend)
    module = importlib.import_module(args._module)
    return int(module.run(args) or 0)


def _start_backend() -> None:
    try:
        import keras  # noqa: F401 - a missing backend fails here, named below
    except ImportError as error:
        from keras_noisecurve.backend import missing_backend

        better = missing_backend(error)
        if better is None:
            raise
        raise SystemExit(f"error: {better}") from error

    from keras_noisecurve import backend

    if backend.supported():  # another backend is refused by the command's own code
        backend.module("devices").probe()  # GPU drivers are probed (and complain) here


def build_parser(argv) -> argparse.ArgumentParser:
    """The parser; only the chosen subcommand's module is imported to add its arguments."""
    parser = argparse.ArgumentParser(
        prog="noisecurve",
        description="Curvature-aware correlated noise for differentially private Keras training.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    chosen = next((a for a in argv if a in SUBCOMMANDS), None)
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        sub_parser = sub.add_parser(name, help=help_text, description=help_text)
        sub_parser.set_defaults(_module=module_name)
        if name == chosen:
            importlib.import_module(module_name).add_arguments(sub_parser)
    return parser


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
