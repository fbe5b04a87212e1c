"""What each mixing-strategy kind takes on the command line and how the apps describe it.

One row per kind (``KINDS``, keyed by the kind string a strategy object carries as its
``kind`` attribute): the options ``noisecurve solve`` accepts for it, the arguments it
passes to ``keras_noisecurve.mixing.solve_mixing_matrix``, how its size and parameters
are printed by ``solve``/``inspect``, and the samplings ``noisecurve audit`` may train it
with. The command-line modules look a kind up here (:func:`options_for`, :func:`kind_of`)
and never compare kind strings themselves; adding a kind is adding a row.

numpy only (no TensorFlow); the rows' functions read the strategy objects' public
attributes (``bands``, ``buffers``, ``coefficients``, ``theta``, ``omega``,
``inverse_bands``, ``inverse_coefficients``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

__all__ = ["AUDIT_KINDS", "KINDS", "SOLVE_KINDS", "StrategyOptions", "kind_of", "options_for"]

#: every sampling the audit knows (``keras_noisecurve.audit``)
_SAMPLINGS = ("fixed_epochs", "cyclic_poisson")


def _abbreviated(values, *, head: int = 8, tail: int = 4) -> str:
    """``v0, …, v7, …, v(-4) … (n more not shown)``: a long 1-D array on one line."""
    values = [float(v) for v in values]

    def text(vs):
        return ", ".join(f"{v:.6g}" for v in vs)

    if len(values) <= head + tail:
        return text(values)
    return f"{text(values[:head])}, …, {text(values[-tail:])} ({len(values) - head - tail} more not shown)"


def _toeplitz_parameters(mixing) -> list[str]:
    return [f"  coefficients c_0 … c_{{b-1}} (b = {mixing.bands}): {_abbreviated(mixing.coefficients)}"]


def _blt_parameters(mixing) -> list[str]:
    return [f"  theta (d = {mixing.theta.shape[0]}): {_abbreviated(mixing.theta)}",
            f"  omega (d = {mixing.omega.shape[0]}): {_abbreviated(mixing.omega)}"]


def _bisr_parameters(mixing) -> list[str]:
    return [f"  p = {mixing.inverse_bands}: C^-1 is p-banded Toeplitz with the first p coefficients of (1 - x)^(1/2)",
            f"  C^-1 first column (up to scale): {_abbreviated(mixing.inverse_coefficients)}"]


@dataclasses.dataclass(frozen=True)
class StrategyOptions:
    """How the apps treat one strategy kind.

    Attributes:
      kind: the kind string (``strategy.kind``).
      description: one line, for help texts.
      size_option: the command-line option that sizes C (``--bands`` or ``--buffers``).
      size_attribute: the strategy attribute holding that size (also the JSON key of
        ``inspect``'s ``size``).
      size_label: how the size is printed (``bands b``, ``buffers d``, ``C^-1 bands p``).
      size_requirement: what ``size_option`` must be, for the "needs ..." message.
      options: the ``noisecurve solve`` arguments (argparse attribute names) only some kinds
        take that this kind takes.
      solve_arguments: arguments passed to ``solve_mixing_matrix`` always (None when not
        given, or the default in ``solve_defaults``).
      optional_solve_arguments: arguments passed only when given.
      solve_defaults: defaults of ``solve_arguments`` the command line sets itself.
      solver_module: the module the solve needs (refused with a message when it is not
        installed), or None.
      min_steps: the fewest steps T this kind can be solved for.
      every_objective: True: every objective (and ``--blend-weight auto``); False: only the
        objectives the Toeplitz-family solvers take (``mixing.api.TOEPLITZ_OBJECTIVES``).
      update_rule: solved for the update rule training runs (momentum, schedule; the
        learning rate is accepted without a curvature objective); False: plain SGD only.
      matrix_file: saved as a banded ``MixingMatrix`` file (``inspect`` shows its column
        norms, noise diagnostics, plot and DP-BandMF reference); False: the strategy format.
      dense_bands: the solver holds T x b floats (the memory check's width is b).
      optimises_participations: solved for k participations ``--separation s`` apart; its
        stored loss and DP-SGD baseline are for that pattern.
      closed_form: nothing is optimised (its loss is the closed form scored afterwards).
      stores_bandmf_baseline: the solver stores a DP-BandMF baseline loss in the metadata.
      samplings: the samplings ``noisecurve audit`` may train it with (a banded C is
        amplified by cyclic Poisson sampling; other C are not).
      solvable: ``noisecurve solve`` writes it; audit: ``noisecurve audit`` takes it.
      parameter_lines: the ``inspect`` lines that show its parameters (strategy-format
        kinds; a ``matrix_file`` kind is shown by its column norms and plot).
    """

    kind: str
    description: str
    size_option: str | None = None
    size_attribute: str | None = None
    size_label: str = ""
    size_requirement: str = ""
    options: frozenset = frozenset()
    solve_arguments: tuple = ()
    optional_solve_arguments: tuple = ()
    solve_defaults: dict = dataclasses.field(default_factory=dict)
    solver_module: str | None = None
    min_steps: int = 1
    every_objective: bool = False
    update_rule: bool = False
    matrix_file: bool = False
    dense_bands: bool = False
    optimises_participations: bool = False
    closed_form: bool = False
    stores_bandmf_baseline: bool = False
    samplings: tuple = ("fixed_epochs",)
    solvable: bool = True
    audit: bool = False
    parameter_lines: Callable | None = None

    def size(self, mixing) -> int:
        """The size of ``mixing`` (bands b, buffers d or the bands p of C⁻¹)."""
        return int(getattr(mixing, self.size_attribute))

    def size_text(self, mixing) -> str:
        return f"{self.size_label} = {self.size(mixing)}"

    def solve_kwargs(self, args) -> dict:
        """The strategy-specific keyword arguments of ``solve_mixing_matrix`` from ``args``."""
        kwargs = {}
        for name in self.solve_arguments:
            value = getattr(args, name)
            kwargs[name] = self.solve_defaults.get(name) if value is None else value
        for name in self.optional_solve_arguments:
            if getattr(args, name) is not None:
                kwargs[name] = getattr(args, name)
        return kwargs


#: the kinds in the order the command line lists them
KINDS = {
    row.kind: row
    for row in (
        StrategyOptions(
            kind="dpsgd", description="DP-SGD: C = I, independent noise at every step",
            samplings=_SAMPLINGS, solvable=False, audit=True,
        ),
        StrategyOptions(
            kind="banded", description="banded C (DP-BandMF, NoiseCurve): b bands, any objective and update rule",
            size_option="--bands", size_attribute="bands", size_label="bands b", size_requirement="b, 1 <= b",
            options=frozenset({"bands", "momentum", "schedule", "cooldown_fraction", "tol", "max_iterations"}),
            solve_arguments=("bands", "tol", "max_iterations"),
            solve_defaults={"tol": 1e-6, "max_iterations": 10_000},
            every_objective=True, update_rule=True, matrix_file=True, dense_bands=True,
            samplings=_SAMPLINGS, audit=True,
        ),
        StrategyOptions(
            kind="toeplitz", description="banded Toeplitz C: b coefficients",
            size_option="--bands", size_attribute="bands", size_label="bands b", size_requirement="b, 1 <= b",
            options=frozenset({"bands", "tol", "max_iterations"}),
            solve_arguments=("bands", "max_iterations"), optional_solve_arguments=("tol",),
            solver_module="keras_noisecurve.mixing.solve_toeplitz", stores_bandmf_baseline=True,
            samplings=_SAMPLINGS, audit=True, parameter_lines=_toeplitz_parameters,
        ),
        StrategyOptions(
            kind="blt", description="buffered linear Toeplitz C: d buffers, for k participations",
            size_option="--buffers", size_attribute="buffers", size_label="buffers d",
            size_requirement="d (the optimizer keeps d noise buffers), 1 <= d",
            options=frozenset({"buffers", "participations", "separation", "tol", "max_iterations"}),
            solve_arguments=("buffers", "participations", "separation", "max_iterations"),
            optional_solve_arguments=("tol",),
            solver_module="keras_noisecurve.mixing.solve_blt", min_steps=2, optimises_participations=True,
            audit=True, parameter_lines=_blt_parameters,
        ),
        StrategyOptions(
            kind="bisr", description="banded inverse square root: C^-1 has p bands (closed form)",
            size_option="--bands", size_attribute="inverse_bands", size_label="C^-1 bands p",
            size_requirement="p (the bands of C^-1), 1 <= p",
            options=frozenset({"bands"}), solve_arguments=("bands",), closed_form=True,
            parameter_lines=_bisr_parameters,
        ),
    )
}

#: kinds ``noisecurve solve`` writes, and kinds ``noisecurve audit`` trains
SOLVE_KINDS = tuple(kind for kind, row in KINDS.items() if row.solvable)
AUDIT_KINDS = tuple(kind for kind, row in KINDS.items() if row.audit)


def options_for(kind: str) -> StrategyOptions:
    """The row of ``kind``; a one-line ``ValueError`` naming the known kinds otherwise."""
    try:
        return KINDS[kind]
    except (KeyError, TypeError):
        raise ValueError(f"unknown strategy kind {kind!r}; known: {', '.join(KINDS)}") from None


def kind_of(mixing) -> StrategyOptions:
    """The row of a strategy object (its ``kind`` attribute)."""
    return options_for(mixing.kind)
