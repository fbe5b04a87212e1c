"""The backend seam is a contract (read statically; no framework is imported).

- Every backend package lists the seam modules it has, ``MODULES`` in its ``__init__.py``:
  ``keras_noisecurve.backend.MODULES`` in its order, less some of ``OPTIONAL``, which
  ``backend/common/defaults/`` has (a module the package leaves out is not a file of it), and every
  module of its list is a file of the package.
- Neutral code (outside ``keras_noisecurve/backend/``) asks ``keras_noisecurve.backend.module(X)``
  only for an X of that list, spelled as a string.
- The modules of the list export the same public names (``__all__``) on every backend, but for
  the per-backend extras of :data:`EXTRAS`, each with its reason.
- What a backend has not is its package's ``REFUSED``, public names of the library.
- A backend package (or ``backend/common``) imports a backend package only where :data:`CROSS_IMPORTS`
  says why.

``tests/test_layout.py`` checks the rest of the seam: no framework import outside its package, no
backend-name branch and no import of a backend package in neutral code, no back-arrow.
"""

from __future__ import annotations

from tests import layout_rules
from tests.layout_rules import PACKAGE, ROOT

BACKENDS = tuple(layout_rules.FRAMEWORKS)

#: ``(module, backend)`` -> {public name: why only this backend's module has it}. Each is a part of
#: that backend's engine that its own modules use (neutral code never asks for it), or what only
#: TensorFlow has (on JAX the default module, ``backend/common/defaults``, refuses it).
EXTRAS = {
    ("clipping", "tensorflow"): {
        "ClippedSum": "the TensorFlow engines' result (a class, public as training.ClippedSum); JAX's engines "
        "return arrays (REFUSED on JAX)",
        "get_engine": "picks a TensorFlow engine by name (public as training.get_engine; REFUSED on JAX, whose "
        "dp_model picks its engine in the traced step)",
        "vectorized_clipped_sum": "the TensorFlow vectorized engine on a ClippedSum (public as "
        "training.vectorized_clipped_sum; REFUSED on JAX)",
        "add_regularization": "B·∇reg added to a ClippedSum (JAX's step adds it to its arrays itself)",
    },
    ("clipping", "jax"): {
        "clipped_sum": "JAX's vectorized engine (jax.vmap of jax.grad), called by its dp_model and ghost",
        "per_example_grads": "JAX's per-example gradients of the whole model, the vectorized engine's first half",
    },
    ("distributed", "tensorflow"): {
        "assert_same_on_all_workers": "a helper of tf.distribute workers (JAX has no tf.distribute: the default "
        "module refuses the name with the reason)",
        "is_chief": "a helper of tf.distribute workers (refused by name by the default module)",
        "worker_checkpoint_dir": "a helper of tf.distribute workers (refused by name by the default module)",
    },
    ("ghost", "tensorflow"): {
        "plan": "the TensorFlow engine's rule per layer, planned from the layers before any step (JAX plans "
        "while the step is traced)",
        "supports": "whether the TensorFlow ghost engine can clip a model, asked by get_engine (JAX hands what "
        "it cannot clip to its vectorized engine inside the traced step)",
    },
    ("ghost", "jax"): {
        "ghost_norms": "JAX's per-layer analysis of one traced batch, shared by its step and its audit reads",
        "targets": "the layers JAX's engine records (a recurrent layer whole), read by its dp_model",
    },
    ("noise", "tensorflow"): {
        "TensorFlowOps": "the class of OPS, the array namespace of the noise recurrence (JAX's is JaxOps)",
        "fold_in": "Philox's fold-in as TensorFlow ops, also under XLA",
        "fused_blt_step": "a BLT noise step in place, compiled by XLA (TensorFlow variables are updated in place)",
        "fused_ring_step": "a banded noise step in place, compiled by XLA (TensorFlow variables are updated in "
        "place)",
    },
    ("noise", "jax"): {
        "JaxOps": "the class of OPS, the array namespace of the noise recurrence (TensorFlow's is TensorFlowOps)",
        "key_words": "a key as its uint32 words: JAX has no int64 without x64",
        "variable_normals": "every variable's draws of a step as lanes of one Philox computation (one jitted "
        "update of all variables)",
    },
    ("optimizer", "jax"): {
        "int64_words": "a key stored as int32 words: JAX has no int64 without x64",
        "words_int64": "the inverse of int64_words",
    },
    ("pipeline", "jax"): {
        "RunBatches": "the PyDataset of a run's batches, which JAX's dp_model recognises in fit",
        "shared_key": "process 0's key in every JAX process, for the optimizer's build",
    },
    ("pipeline", "common/defaults"): {
        "RunBatches": "the PyDataset of a run's batches (JAX's is this class; TensorFlow's batches are tf.data)",
        "shared_key": "the run's key for an optimizer's build, where JAX shares process 0's (TensorFlow's "
        "optimizer needs none)",
    },
}

#: backend module -> the other backend's module it imports, and why
CROSS_IMPORTS = {
    f"{PACKAGE}.backend.common.defaults.pipeline": (
        f"{PACKAGE}.backend.tensorflow.pipeline",
        "tf.data inputs are TensorFlow's on any Keras backend (a program that made a tf.data.Dataset has "
        "TensorFlow): the default pipeline (JAX's too) hands them to TensorFlow's, imported when one is used",
    ),
}


#: where ``backend.module`` finds a module of ``OPTIONAL`` a package leaves out
DEFAULTS = "common/defaults"


def _providers(module: str) -> list[str]:
    """Where ``backend.module(module)`` may come from: the backends that have it, and the defaults
    for a module of ``OPTIONAL`` (compared even while every backend has its own)."""
    have = [b for b in BACKENDS if module in layout_rules.package_constant(b, "MODULES")]
    return have + ([DEFAULTS] if module in layout_rules.seam_constant("OPTIONAL") else [])


def test_every_backend_package_lists_the_seam_modules_less_some_optional_ones():
    modules, optional = layout_rules.seam_modules(), layout_rules.seam_constant("OPTIONAL")
    assert isinstance(modules, tuple) and modules and len(set(modules)) == len(modules)
    assert set(optional) <= set(modules)
    for backend in BACKENDS:
        own = layout_rules.package_constant(backend, "MODULES")
        assert own == tuple(m for m in modules if m in own), (backend, own)  # the seam's order, no other name
        assert set(modules) - set(own) <= set(optional), (backend, sorted(set(modules) - set(own) - set(optional)))
    assert layout_rules.package_constant("tensorflow", "MODULES") == modules


def test_every_module_of_a_list_is_a_file_of_its_package_and_every_optional_one_has_a_default():
    missing, stray = [], []
    for backend in BACKENDS:
        own = layout_rules.package_constant(backend, "MODULES")
        for m in layout_rules.seam_modules():
            is_file = (ROOT / PACKAGE / "backend" / backend / f"{m}.py").is_file()
            if m in own and not is_file:
                missing.append(f"backend/{backend}/{m}.py")
            if m not in own and is_file:  # backend.module would never import it
                stray.append(f"backend/{backend}/{m}.py")
    missing += [f"backend/{DEFAULTS}/{m}.py" for m in layout_rules.seam_constant("OPTIONAL")
                if not (ROOT / PACKAGE / "backend" / DEFAULTS / f"{m}.py").is_file()]
    assert not missing and not stray, (missing, stray)


def test_neutral_code_asks_only_for_modules_of_the_list():
    requests = layout_rules.backend_module_requests()
    assert len(requests) >= 10  # the measure sees the calls (optimizer, noise, pipeline, ...)
    asked = {name for _, _, name in requests}
    assert {"optimizer", "noise", "pipeline", "dp_model"} <= asked
    wrong = [f"{module}:{line} asks backend.module({name!r})" for module, line, name in requests
             if name not in layout_rules.seam_modules()]
    assert not wrong, "backend.module(X) with X not in keras_noisecurve.backend.MODULES (or not a string):\n" + (
        "\n".join(wrong))


def test_the_modules_of_the_list_export_the_same_names():
    wrong = []
    for module in layout_rules.seam_modules():
        exports = {b: set(layout_rules.backend_exports(b, module)) for b in _providers(module)}
        for backend in exports:
            only = set.union(*(exports[backend] - exports[other] for other in exports if other != backend))
            documented = set(EXTRAS.get((module, backend), {}))
            if only != documented:
                wrong.append(f"{backend}/{module}: only here {sorted(only)}, documented {sorted(documented)}")
    assert not wrong, ("public names one backend's module has and another's has not (give both the name, or "
                       "say in EXTRAS why one has it alone):\n" + "\n".join(wrong))


def test_every_extra_has_a_reason():
    for (module, backend), names in EXTRAS.items():
        assert module in layout_rules.seam_modules() and backend in (*BACKENDS, DEFAULTS), (module, backend)
        assert names and all(isinstance(why, str) and len(why) > 20 for why in names.values()), (module, backend)


def test_what_a_backend_refuses_is_a_public_name_of_the_library():
    import keras_noisecurve
    import keras_noisecurve.training as training  # imports no framework

    public = set(keras_noisecurve._EXPORTS) | set(training.__all__)
    for backend in BACKENDS:
        refused = layout_rules.package_constant(backend, "REFUSED")
        assert isinstance(refused, frozenset) and refused <= public, (backend, sorted(refused - public))
    assert not layout_rules.package_constant("tensorflow", "REFUSED")


#: a seam module a package may leave out -> the public names the package must then refuse
REFUSED_WITHOUT = {"devices": set(), "distributed": {"fit_distributed"}, "ghost_conv": set(), "pipeline": set(),
                   "tf_privacy": {"BandedMatrixFactorizationQuery"}}


def test_a_package_that_leaves_a_feature_to_the_defaults_refuses_its_public_names():
    assert set(REFUSED_WITHOUT) == set(layout_rules.seam_constant("OPTIONAL"))
    for backend in BACKENDS:
        own, refused = layout_rules.package_constant(backend, "MODULES"), layout_rules.package_constant(backend, "REFUSED")
        for module, names in REFUSED_WITHOUT.items():
            assert (names <= refused) if module not in own else not (names & refused), (backend, module, names)


def test_backend_packages_import_one_another_only_where_listed():
    found = layout_rules.cross_backend_imports()
    assert found == [f"{module} imports {target}" for module, (target, _) in sorted(CROSS_IMPORTS.items())], found
