"""Repository layout rules, checked statically (no imports, no TensorFlow).

(a) No import cycle among the modules of ``keras_noisecurve``. The graph is built with
    ``ast`` from every ``.py`` file under ``keras_noisecurve/``, counting every
    ``import`` / ``from ... import`` of a ``keras_noisecurve`` module wherever it
    appears (module level and inside functions), relative imports resolved,
    ``from package import submodule`` taken as an import of the submodule, and
    ``importlib.import_module("keras_noisecurve....")`` calls with a string literal.
    Importing ``a.b.c`` also runs ``a/__init__`` and ``a/b/__init__``; those implicit
    parent-package imports are not edges (every module of a package would otherwise
    "cycle" through the package's own ``__init__``).
(b) The backend seam: no module outside ``backend/<framework>/`` imports that framework
    (TensorFlow, TF Privacy, tf_keras; JAX), and the two backend packages have the same module
    names, less the seam modules a package leaves to ``backend/common/defaults``, and but for the
    modules one backend has for a reason written down here.
(c) The repository stands on its own: no file in ``keras_noisecurve/``, ``docs/`` or
    ``README.md`` cites the internal design brief (``DESIGN.md``) or the directory
    it lives in.
"""

from __future__ import annotations

from tests import layout_rules
from tests.layout_rules import PACKAGE, ROOT, cycles as _cycles, imports as _imports, modules as _modules



def test_import_graph_is_built_from_every_module():
    modules = _modules()
    graph = {m: _imports(m, modules) for m in modules}
    assert f"{PACKAGE}.backend.tensorflow.clipping" in graph
    # a function-level import is an edge (estimate imports its helpers lazily)
    assert f"{PACKAGE}.spectrum.lanczos" in graph[f"{PACKAGE}.spectrum.estimate"]
    # `from package import submodule` is an edge to the submodule
    assert f"{PACKAGE}.backend.tensorflow.ghost" in graph[f"{PACKAGE}.backend.tensorflow.clipping"]


def test_no_import_cycles():
    modules = _modules()
    graph = {m: _imports(m, modules) for m in modules}
    cycles = _cycles(graph)
    assert not cycles, "import cycles among keras_noisecurve modules:\n" + "\n".join(
        "  " + " -> ".join(cycle) for cycle in cycles
    )


def test_no_framework_is_imported_outside_its_backend_package():
    found = layout_rules.framework_imports()
    assert not found, _report(
        "framework imports outside keras_noisecurve/backend/<framework>/ (call the backend's module through "
        "keras_noisecurve.backend.module(...), or keras.ops)", found)


def test_the_rule_finds_framework_imports_wherever_they_are(tmp_path, monkeypatch):
    package = tmp_path / PACKAGE
    (package / "backend" / "jax").mkdir(parents=True)
    (package / "privacy").mkdir()
    (package / "privacy" / "lazy.py").write_text("def f():\n    import tensorflow as tf\n    return tf\n")
    (package / "privacy" / "string.py").write_text("import importlib\nimportlib.import_module('jax.numpy')\n")
    (package / "privacy" / "fine.py").write_text("import numpy\nfrom keras import ops\n")
    (package / "backend" / "jax" / "noise.py").write_text("import jax\n")
    (package / "backend" / "jax" / "wrong.py").write_text("from tensorflow_privacy import x\n")
    monkeypatch.setattr(layout_rules, "ROOT", tmp_path)
    found = layout_rules.framework_imports()
    assert found == [
        f"{PACKAGE}.backend.jax.wrong:1 imports tensorflow_privacy",
        f"{PACKAGE}.privacy.lazy:2 imports tensorflow",
        f"{PACKAGE}.privacy.string:2 imports jax.numpy",
    ]


#: modules one backend package has and the other has not, and why; every other module name is in both
BACKEND_ONLY = {
    "tensorflow": {
        "clipped_sum": "ClippedSum, what the TensorFlow engines return (JAX's return arrays)",
        "compat": "the TensorFlow internals read (XLA context)",
        "engine_forms": "the Rule interface of the recording engine and KernelRule, its adapter of the kernels written "
        "once (JAX calls them as they are; the forms both share are backend/common/norm_forms)",
        "engine_fallback": "the per-layer fallback by re-running a layer per example (JAX's is a vmap, in ghost)",
        "engine_rows": "rows that are not examples, found by tracing before any step (JAX's engine, which plans in its "
        "shape pass, uses the neutral backend/common/row_probe)",
        "features": "the step's training features in TensorFlow ops, with tf.Variable counters (JAX's are the neutral "
        "backend/common/step_features)",
        "engine_rules": "the registry of the Rule interface (JAX's engine, whose kernels are functions, uses the neutral "
        "backend/common/kernel_rules)",
        "engine_reads": "weights read outside their layer's call, found by tracing (recorded in ghost on JAX)",
        "ghost_t5": "T5's relative-attention bias (the exact fallback clips it on JAX)",
        "ghost_timedist": "TimeDistributed folded onto its layer's rule (the exact fallback on JAX)",
        "kernels": "which formulations TensorFlow's CPU kernels execute",
        "tf_privacy_import": "TensorFlow Privacy's import workaround",
    },
    "jax": {
        "sharding": "the noise of a variable split by keras.distribution.ModelParallel (a JAX feature of Keras)",
    },
}


def test_the_backend_packages_have_the_same_module_names():
    modules = layout_rules.backend_modules()
    for name, other in (("tensorflow", "jax"), ("jax", "tensorflow")):
        # a seam module the other package leaves to backend/common/defaults (test_seam_contract)
        defaulted = set(layout_rules.seam_modules()) - set(layout_rules.package_constant(other, "MODULES"))
        only = modules[name] - modules[other] - defaulted
        assert only == set(BACKEND_ONLY[name]), (
            f"modules in backend/{name}/ and not in backend/{other}/: {sorted(only)}; documented: "
            f"{sorted(BACKEND_ONLY[name])} (give the module the other backend's name, or say here why it has none)"
        )
    # the interface the neutral code reaches through keras_noisecurve.backend.module(...) is in both
    # (its module list, MODULES: tests/backend/test_seam_contract.py)
    for name in modules:
        interface = set(layout_rules.package_constant(name, "MODULES"))
        assert interface <= modules[name], (name, sorted(interface - modules[name]))


def test_neutral_code_asks_no_backend_name():
    found = layout_rules.backend_name_branches()
    assert not found, _report(
        "neutral code that branches on the backend's name (ask a capability of the backend's module, "
        "keras_noisecurve.backend.module(...), or keras_noisecurve.backend.refuses; a message may name it)", found)


def test_neutral_code_imports_no_backend_package():
    found = layout_rules.neutral_backend_imports()
    assert not found, _report(
        "neutral code that imports keras_noisecurve.backend.<name> (ask keras_noisecurve.backend.module(...))",
        found)


def test_the_seam_rules_find_what_they_claim(tmp_path, monkeypatch):
    package = tmp_path / PACKAGE
    (package / "backend" / "jax").mkdir(parents=True)
    (package / "training").mkdir()
    (package / "backend" / "__init__.py").write_text("def name():\n    return 'jax'\n")
    (package / "backend" / "jax" / "noise.py").write_text("from keras_noisecurve.backend import name\nname()\n")
    (package / "training" / "branch.py").write_text(
        "import os\nimport keras\nfrom keras_noisecurve import backend as b\n"
        "if b.name() == 'jax':\n    pass\n"
        "x = keras.backend.backend()\n"
        "y = os.environ.get('KERAS_BACKEND') in ('torch', 'numpy')\n"
        "message = f'the backend is {b.name()!r}'\n")
    (package / "training" / "reach.py").write_text(
        "import importlib\n"
        "def f():\n    from keras_noisecurve.backend.jax import noise\n    return noise\n"
        "importlib.import_module('keras_noisecurve.backend.jax.noise')\n"
        "TABLE = {'noise': 'keras_noisecurve.backend.jax.noise'}\n"
        "from keras_noisecurve.backend import name\n")
    monkeypatch.setattr(layout_rules, "ROOT", tmp_path)
    assert layout_rules.backend_name_branches() == [
        f"{PACKAGE}.training.branch:4 asks b.name()",
        f"{PACKAGE}.training.branch:4 compares with ['jax']",
        f"{PACKAGE}.training.branch:6 asks keras.backend.backend()",
        f"{PACKAGE}.training.branch:7 compares with ['numpy', 'torch']",
    ]
    assert layout_rules.neutral_backend_imports() == [
        f"{PACKAGE}.training.reach imports {PACKAGE}.backend.jax.noise",
        f"{PACKAGE}.training.reach:5 names {PACKAGE}.backend.jax.noise",
        f"{PACKAGE}.training.reach:6 names {PACKAGE}.backend.jax.noise",
    ]


def test_nothing_cites_the_internal_design_brief():
    files = [ROOT / "README.md"]
    for folder in (ROOT / PACKAGE, ROOT / "docs"):
        files += [p for p in sorted(folder.rglob("*")) if p.is_file() and "__pycache__" not in p.parts]
    offenders = []
    for path in files:
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        for number, line in enumerate(text.splitlines(), 1):
            if "DESIGN.md" in line or "../shared" in line or "/work/shared" in line:
                offenders.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not offenders, "the repository must not cite the internal design brief:\n" + "\n".join(offenders)


# --------------------------------------------------------------- the house rules
# Measured by tests/layout_rules.py (run it to print the counts and every offender).



def _report(title, found):
    return f"{title}:\n" + "\n".join(f"  {line}" for line in found)


def test_no_module_is_over_600_lines():
    found = layout_rules.long_modules()
    assert not found, _report(f"modules over {layout_rules.MAX_LINES} lines (split them by job)", found)


def test_kinds_and_objectives_are_compared_only_in_their_registries():
    found = layout_rules.kind_comparisons()
    assert not found, _report(
        "strategy kinds / objective names compared outside their registries (ask the strategy or "
        "objective object instead)", found)


def test_no_isinstance_on_strategy_classes_outside_their_modules():
    found = layout_rules.strategy_isinstance()
    assert not found, _report("isinstance on strategy classes (use the strategy's own attributes)", found)


def test_private_third_party_names_only_in_compat():
    found = layout_rules.private_names()
    assert not found, _report(
        "private names of Keras / TensorFlow / dp-accounting outside keras_noisecurve/_compat.py", found)


def test_packages_import_only_lower_layers():
    found = layout_rules.layer_violations()
    assert not found, _report("imports against the layers (tests/layout_rules.py LAYERS)", found)


def _documented_graph() -> dict[str, set[str]]:
    text = (ROOT / "docs" / "design.md").read_text(encoding="utf-8")
    block = text.split("<!-- import-graph -->", 2)
    assert len(block) == 3, "docs/design.md must hold the package graph between two <!-- import-graph --> markers"
    graph = {}
    for line in block[1].splitlines():
        if "->" in line:
            source, _, targets = line.partition("->")
            graph[source.strip()] = {t.strip() for t in targets.split(",") if t.strip() and t.strip() != "(nothing)"}
    return graph


def test_the_documented_import_graph_is_the_code_s():
    assert _documented_graph() == layout_rules.package_graph(), (
        "docs/design.md's import graph is stale; the code's is:\n"
        + "\n".join(f"{k} -> {', '.join(sorted(v)) or '(nothing)'}" for k, v in layout_rules.package_graph().items()))


def test_the_measures_see_what_they_claim(tmp_path, monkeypatch):
    """Each measure flags a planted offender (so a rule cannot pass by measuring nothing)."""
    package = tmp_path / layout_rules.PACKAGE
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "bad.py").write_text(
        "import keras\n"
        "from keras.src.backend import tensorflow\n"
        "def f(mixing, x):\n"
        "    if mixing.kind == 'blt':\n"
        "        return isinstance(x, BLTMixing)\n"
        "    return x._private_thing\n"
        "class O(keras.optimizers.Optimizer):\n"
        "    def _hook(self):\n"
        "        return super()._hook()\n"
        + "\n" * 600
    )
    (package / "_compat.py").write_text("def g(x):\n    return x._allowed_here\n")
    monkeypatch.setattr(layout_rules, "ROOT", tmp_path)
    assert layout_rules.long_modules() == ["bad.py: 609 lines"]
    assert [line.split(": ", 1)[0] for line in layout_rules.kind_comparisons()] == ["bad.py:4"]
    assert [line.split(": ", 1)[0] for line in layout_rules.strategy_isinstance()] == ["bad.py:5"]
    private = layout_rules.private_names()
    assert any("keras.src" in line for line in private), private
    assert any("._private_thing" in line for line in private), private
    assert any("overrides O._hook" in line for line in private), private
    assert not any("_allowed_here" in line for line in private), private
