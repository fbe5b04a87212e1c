"""Static measures of the package's layout, read with ``ast`` (no imports, no TensorFlow).

``tests/test_layout.py`` asserts the rules on them; run this file to print the counts:

    python tests/layout_rules.py

Measures:

- ``framework_imports``: imports of TensorFlow (TF Privacy, tf_keras) or JAX outside that
  framework's backend package ``backend/<framework>/``.
- ``backend_name_branches``: neutral code (outside ``backend/``) asking which backend is in
  use (``backend.name()``, ``keras.backend.backend()``) outside a message, or comparing with a
  backend's name.
- ``neutral_backend_imports``: neutral code importing a backend package ``backend/<name>/``.
- ``long_modules``: modules over ``MAX_LINES`` lines.
- ``kind_comparisons``: comparisons (``==``, ``!=``, ``in``, ``not in``) of a value with a
  strategy kind (``"banded"``, ``"toeplitz"``, ``"fir"``, ``"blt"``, ``"bisr"``, ``"identity"``) or an
  objective name (``"dpsgd"``, ``"bandmf"``, ``"noisecurve"``, …) outside the registries
  that define them (``REGISTRY_MODULES``).
- ``strategy_isinstance``: ``isinstance``/``issubclass`` on a strategy class outside the
  modules that define strategy classes and their registries.
- ``private_names``: uses of a private name of Keras, TensorFlow or dp-accounting outside
  ``keras_noisecurve/_compat.py``: imports of ``keras.src``/``tensorflow.python``/
  ``tensorflow.core``/a private ``dp_accounting`` module; reads of ``obj._name`` (also through
  ``getattr``/``setattr``/``hasattr`` with a literal) where no module of this package defines
  ``_name``; and methods ``_name`` defined in a subclass of a third-party class that this
  package never refers to (hooks the third party calls: overrides of its private methods).
- ``run_signatures``: functions whose parameters spell out the run description: four or
  more of ``RUN_FIELDS`` (a count for the record, not a rule).
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "keras_noisecurve"
MAX_LINES = 600

STRATEGY_KINDS = frozenset({"banded", "toeplitz", "fir", "blt", "bisr", "identity"})
OBJECTIVE_NAMES = frozenset({
    "dpsgd", "bandmf", "noisecurve", "noisecurve-convergence", "noisecurve-all-iterates", "noisecurve-blend",
})
STRATEGY_CLASSES = frozenset({
    "MixingMatrix", "ToeplitzMixing", "BLTMixing", "BISRMixing", "IdentityMixing", "_ToeplitzFamily",
})
#: Module path patterns (relative to the package, glob) where kind/objective names may be compared:
#: the registries that define them.
REGISTRY_MODULES = ("mixing/strategies*.py", "mixing/objectives.py", "apps/strategy_table.py", "apps/*/strategy_table.py")
#: where private third-party names may be used: Keras's and dp-accounting's, and TensorFlow's
COMPAT_MODULES = ("_compat.py", "backend/tensorflow/compat.py")
THIRD_PARTY_ROOTS = ("keras", "tensorflow", "tf", "dp_accounting", "tf_keras", "tensorflow_privacy")
PRIVATE_IMPORTS = ("keras.src", "tensorflow.python", "tensorflow.core", "tensorflow_privacy.privacy")
#: namedtuple's documented methods (public API despite the underscore)
NAMEDTUPLE_API = frozenset({"_replace", "_fields", "_asdict", "_make", "_field_defaults"})
RUN_FIELDS = frozenset({
    "num_examples", "batch_size", "expected_batch_size", "steps", "bands", "sampling", "epochs",
    "participations", "separation", "min_separation", "mixing", "padded_batch_size",
})


def package_files() -> list[Path]:
    return sorted(p for p in (ROOT / PACKAGE).rglob("*.py") if "__pycache__" not in p.parts)


def _rel(path: Path) -> str:
    return path.relative_to(ROOT / PACKAGE).as_posix()


def _matches(rel: str, patterns) -> bool:
    from fnmatch import fnmatch

    return any(fnmatch(rel, pattern) for pattern in patterns)


def _trees():
    for path in package_files():
        yield path, ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted((ROOT / PACKAGE).rglob("*.py"))}


def _resolve(name: str, known) -> str | None:
    """The longest known module that ``name`` is or lies in (``a.b.attr`` -> ``a.b``)."""
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in known:
            return candidate
        parts.pop()
    return None


def _is_package(module: str, modules) -> bool:
    return modules[module].name == "__init__.py"


def imports(module: str, modules) -> set[str]:
    """The keras_noisecurve modules that ``module`` imports anywhere in its source."""
    tree = ast.parse(modules[module].read_text(encoding="utf-8"), filename=str(modules[module]))
    package = module if _is_package(module, modules) else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == PACKAGE:
                    found.add(_resolve(alias.name, modules))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = package.split(".")
                base_parts = base_parts[: len(base_parts) - (node.level - 1)]
                base = ".".join(base_parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            if base.split(".")[0] != PACKAGE:
                continue
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                found.add(submodule if submodule in modules else _resolve(base, modules))
        elif isinstance(node, ast.Call) and node.args:
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            first = node.args[0]
            if (
                name == "import_module"
                and isinstance(first, ast.Constant)
                and isinstance(first.value, str)
                and first.value.split(".")[0] == PACKAGE
            ):
                found.add(_resolve(first.value, modules))
    found.discard(None)
    found.discard(module)
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component with more than one module (Tarjan)."""
    index, low, stack, on_stack, components = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)

    return [_cycle_through(component[0], graph, set(component)) for component in components]


def _cycle_through(start: str, graph, members) -> list[str]:
    """A shortest import chain start -> ... -> start inside one strongly connected component."""
    parents, queue = {start: None}, [start]
    for v in queue:  # breadth first; the component guarantees a way back to start
        for w in sorted(graph[v] & members):
            if w == start:
                path = [v]
                while parents[path[-1]] is not None:
                    path.append(parents[path[-1]])
                return list(reversed(path)) + [start]
            if w not in parents:
                parents[w] = v
                queue.append(w)
    raise AssertionError(f"{start} is in a cycle but no path back was found")


def import_graph() -> dict[str, set[str]]:
    """module -> the package modules it imports (anywhere in its source)."""
    found = modules()
    return {m: imports(m, found) for m in found}


#: The layers of the package, bottom to top: a package may import only packages of its own
#: or a lower layer (``_validation``, ``_npz``, ``_quiet``, ``_losses``, ``_compat`` and the
#: package root are shared helpers, importable from everywhere).
LAYERS = (
    ("backend",),
    ("spectrum",),
    ("mixing",),
    ("privacy",),
    ("training",),
    ("audit", "integrations", "callbacks"),
    ("apps",),
)


def package_of(module: str) -> str:
    """``keras_noisecurve.mixing.matrix`` -> ``mixing``; top-level helpers -> their own name."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def package_graph() -> dict[str, set[str]]:
    """package -> the other packages its modules import (helpers and the root left out)."""
    layer_of = {name: i for i, layer in enumerate(LAYERS) for name in layer}
    graph: dict[str, set[str]] = {name: set() for name in layer_of}
    for module, targets in import_graph().items():
        source = package_of(module)
        if source not in layer_of:
            continue
        for target in targets:
            other = package_of(target)
            if other in layer_of and other != source:
                graph[source].add(other)
    return graph


def layer_violations() -> list[str]:
    """Imports from a package to one of a higher layer, or sideways within a layer (a
    backend package importing the library above it is one: a back-arrow)."""
    layer_of = {name: i for i, layer in enumerate(LAYERS) for name in layer}
    out = []
    for module, targets in sorted(import_graph().items()):
        source = package_of(module)
        if source not in layer_of:
            continue
        for target in sorted(targets):
            other = package_of(target)
            if other in layer_of and other != source and layer_of[other] >= layer_of[source]:
                out.append(f"{module} imports {target} ({other} is not below {source})")
    return out


#: framework -> the top-level import names that are that framework (TF Privacy and tf_keras
#: stand on TensorFlow); only ``backend/<framework>/`` may import them
FRAMEWORKS = {
    "tensorflow": ("tensorflow", "tensorflow_privacy", "tf_keras"),
    "jax": ("jax", "jaxlib"),
}


def framework_imports() -> list[str]:
    """``module imports name`` for every import of a framework (module level or inside a
    function, ``import x``, ``from x import y`` and ``importlib.import_module("x")``) outside
    that framework's backend package ``keras_noisecurve/backend/<framework>/``."""
    roots = {root: framework for framework, names in FRAMEWORKS.items() for root in names}
    out = []
    for module, path in modules().items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
                func = node.func
                called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
                if called == "import_module" and isinstance(node.args[0].value, str):
                    names = [node.args[0].value]
            for name in names:
                framework = roots.get(name.split(".")[0])
                if framework and not module.startswith(f"{PACKAGE}.backend.{framework}."):
                    out.append(f"{module}:{node.lineno} imports {name}")
    return sorted(out)


def backend_modules() -> dict[str, set[str]]:
    """backend name -> the module names of ``keras_noisecurve/backend/<name>/``."""
    folder = ROOT / PACKAGE / "backend"
    return {
        name: {p.stem for p in (folder / name).glob("*.py") if p.stem != "__init__"}
        for name in FRAMEWORKS
    }


def _is_neutral(module: str) -> bool:
    """Whether ``module`` is neutral code: outside ``keras_noisecurve/backend/``."""
    return not (module == f"{PACKAGE}.backend" or module.startswith(f"{PACKAGE}.backend."))


def _backend_aliases(tree) -> tuple[set[str], set[str]]:
    """``(modules, functions)``: the names ``tree`` binds to ``keras_noisecurve.backend`` and to its
    ``name`` function (``from keras_noisecurve import backend as _backend``, ``from
    keras_noisecurve.backend import name``, ``import keras_noisecurve.backend as b``)."""
    modules, functions = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and not node.level:
            for alias in node.names:
                if node.module == PACKAGE and alias.name == "backend":
                    modules.add(alias.asname or alias.name)
                elif node.module == f"{PACKAGE}.backend" and alias.name == "name":
                    functions.add(alias.asname or alias.name)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == f"{PACKAGE}.backend" and alias.asname:
                    modules.add(alias.asname)
    return modules, functions


def _dotted(node) -> str:
    """``a.b.c`` of a chain of attributes on a name ('' for anything else)."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return ""
    return ".".join([node.id, *reversed(parts)])


#: the names of the backends, as neutral code must not compare them
BACKEND_NAMES = frozenset({"tensorflow", "jax", "torch", "numpy", "openvino"})


def _in_message(node, parents) -> bool:
    """Whether ``node`` lies inside an f-string (a message, which may name the backend)."""
    while node in parents:
        node = parents[node]
        if isinstance(node, ast.JoinedStr):
            return True
    return False


def backend_name_branches() -> list[str]:
    """Neutral code that asks which backend is in use, outside a message: calls of
    ``keras_noisecurve.backend.name()`` (by any alias) or of Keras's ``keras.backend.backend()`` /
    ``keras.config.backend()`` that are not inside an f-string, and comparisons (``==``, ``!=``,
    ``in``, ``not in``) with a backend's name as a string (``os.environ["KERAS_BACKEND"] == "jax"``).
    The backend is chosen in ``keras_noisecurve/backend/__init__.py``; what one backend lacks is its
    package's to say (its modules refuse it, its ``REFUSED``)."""
    out = []
    for module, path in modules().items():
        if not _is_neutral(module):
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        aliases, functions = _backend_aliases(tree)
        parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and not node.args and not node.keywords:
                func = node.func
                dotted = _dotted(func)
                asks = (isinstance(func, ast.Attribute) and func.attr == "name" and isinstance(func.value, ast.Name)
                        and func.value.id in aliases) or (isinstance(func, ast.Name) and func.id in functions)
                if asks or dotted in ("keras.backend.backend", "keras.config.backend"):
                    if not _in_message(node, parents):
                        out.append(f"{module}:{node.lineno} asks {ast.unparse(func)}()")
            elif isinstance(node, ast.Compare) and any(
                    isinstance(op, (ast.Eq, ast.NotEq, ast.In, ast.NotIn)) for op in node.ops):
                found = set()
                for operand in [node.left, *node.comparators]:
                    found |= _string_constants(operand) & BACKEND_NAMES
                if found:
                    out.append(f"{module}:{node.lineno} compares with {sorted(found)}")
    return sorted(out)


def neutral_backend_imports() -> list[str]:
    """Imports of a backend package (``keras_noisecurve.backend.<name>`` and its modules) from
    neutral code, wherever they are (lazy imports and ``importlib.import_module`` strings too),
    and strings that are such a module's path (a table of modules to import later): neutral code
    asks ``keras_noisecurve.backend.module(...)``."""
    import re

    found = modules()
    packages = tuple(f"{PACKAGE}.backend.{name}" for name in FRAMEWORKS)
    path_of_one = re.compile(rf"^{re.escape(PACKAGE)}\.backend\.({'|'.join(FRAMEWORKS)})(\.\w+)*$")
    out = []
    for module, path in found.items():
        if not _is_neutral(module):
            continue
        for target in sorted(imports(module, found)):
            if target in packages or target.startswith(tuple(p + "." for p in packages)):
                out.append(f"{module} imports {target}")
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and path_of_one.match(node.value):
                out.append(f"{module}:{node.lineno} names {node.value}")
    return sorted(set(out))


def backend_module_requests() -> list[tuple[str, int, object]]:
    """``(module, line, X)`` for every ``keras_noisecurve.backend.module(X)`` call in neutral code
    (by any alias of the backend module); X is the string, or ``None`` where it is not a literal."""
    out = []
    for module, path in modules().items():
        if not _is_neutral(module):
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        aliases, _ = _backend_aliases(tree)
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "module"
                    and isinstance(node.func.value, ast.Name) and node.func.value.id in aliases):
                first = node.args[0] if node.args else None
                literal = isinstance(first, ast.Constant) and isinstance(first.value, str)
                out.append((module, node.lineno, first.value if literal else None))
    return sorted(out, key=lambda entry: entry[:2])


def cross_backend_imports() -> list[str]:
    """Imports of one backend package's modules from another's, or from ``backend/common``."""
    found = modules()
    out = []
    for module in found:
        for name in (*FRAMEWORKS, "common"):
            if not module.startswith(f"{PACKAGE}.backend.{name}."):
                continue
            for other in FRAMEWORKS:
                prefix = f"{PACKAGE}.backend.{other}"
                if other != name:
                    out += [f"{module} imports {t}" for t in sorted(imports(module, found))
                            if t == prefix or t.startswith(prefix + ".")]
    return sorted(out)


def backend_exports(backend: str, module: str) -> list[str]:
    """The ``__all__`` of ``keras_noisecurve/backend/<backend>/<module>.py``, read statically
    (``backend`` may be a folder below ``backend/``: ``"common/defaults"``)."""
    path = ROOT / PACKAGE / "backend" / backend / f"{module}.py"
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            return list(ast.literal_eval(node.value))
    raise AssertionError(f"backend/{backend}/{module}.py has no __all__")


def seam_constant(constant: str) -> tuple:
    """A literal tuple of ``keras_noisecurve/backend/__init__.py`` (``MODULES``, ``OPTIONAL``)."""
    path = ROOT / PACKAGE / "backend" / "__init__.py"
    for node in ast.parse(path.read_text(encoding="utf-8"), filename=str(path)).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == constant for t in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError(f"keras_noisecurve/backend/__init__.py has no {constant}")


def seam_modules() -> tuple:
    """``keras_noisecurve.backend.MODULES``, the seam modules, read statically."""
    return seam_constant("MODULES")


def package_constant(backend: str, constant: str):
    """A literal constant of ``keras_noisecurve/backend/<backend>/__init__.py`` (``MODULES``, a
    tuple; ``REFUSED``, a ``frozenset(...)`` of a literal)."""
    path = ROOT / PACKAGE / "backend" / backend / "__init__.py"
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == constant for t in node.targets):
            value = node.value
            if isinstance(value, ast.Call) and getattr(value.func, "id", None) == "frozenset":
                return frozenset(ast.literal_eval(value.args[0]) if value.args else ())
            return ast.literal_eval(value)
    raise AssertionError(f"backend/{backend}/__init__.py has no {constant}")


def long_modules(max_lines: int = MAX_LINES) -> list[str]:
    out = []
    for path in package_files():
        lines = len(path.read_text(encoding="utf-8").splitlines())
        if lines > max_lines:
            out.append(f"{_rel(path)}: {lines} lines")
    return out


def _string_constants(node) -> set[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value}
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        found = set()
        for element in node.elts:
            found |= _string_constants(element)
        return found
    return set()


def kind_comparisons() -> list[str]:
    names = STRATEGY_KINDS | OBJECTIVE_NAMES
    out = []
    for path, tree in _trees():
        rel = _rel(path)
        if _matches(rel, REGISTRY_MODULES):
            continue
        for node in ast.walk(tree):
            if not isinstance(node, ast.Compare):
                continue
            if not any(isinstance(op, (ast.Eq, ast.NotEq, ast.In, ast.NotIn)) for op in node.ops):
                continue
            found = set()
            for operand in [node.left, *node.comparators]:
                found |= _string_constants(operand) & names
            if found:
                out.append(f"{rel}:{node.lineno}: compares with {sorted(found)}")
    return out


def _class_names(node) -> set[str]:
    if isinstance(node, ast.Name):
        return {node.id}
    if isinstance(node, ast.Attribute):
        return {node.attr}
    if isinstance(node, ast.Tuple):
        found = set()
        for element in node.elts:
            found |= _class_names(element)
        return found
    return set()


def strategy_isinstance() -> list[str]:
    out = []
    for path, tree in _trees():
        defined = {n.name for n in ast.walk(tree) if isinstance(n, ast.ClassDef)}
        if defined & STRATEGY_CLASSES or _matches(_rel(path), REGISTRY_MODULES):
            continue  # a module that defines strategy classes, or their registry
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id in ("isinstance", "issubclass") and len(node.args) == 2):
                hit = _class_names(node.args[1]) & STRATEGY_CLASSES
                if hit:
                    out.append(f"{_rel(path)}:{node.lineno}: {node.func.id} on {sorted(hit)}")
    return out


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _own_private_names() -> set[str]:
    """Private names this package defines: assigned attributes, functions, classes, class attributes."""
    names = set()
    for _, tree in _trees():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
                for arg in [*node.args.args, *node.args.kwonlyargs] if not isinstance(node, ast.ClassDef) else []:
                    names.add(arg.arg)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.Call):
                func = node.func
                name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
                if name in ("setattr", "__setattr__") and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant):
                    names.add(str(node.args[1].value))
                names.update(k.arg for k in node.keywords if k.arg)  # e.g. set_defaults(_module=...)
    return {n for n in names if _is_private(n)}


def _loaded_names(tree) -> dict[str, int]:
    """How often each name is referenced (loaded, or named by a string) in ``tree``."""
    counts: dict[str, int] = {}
    for node in ast.walk(tree):
        if True:
            name = None
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
                name = node.attr
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
                name = node.id
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                name = node.value
            if name:
                counts[name] = counts.get(name, 0) + 1
    return counts


def _referenced_names() -> dict[str, int]:
    """How often each name is referenced anywhere in the package."""
    counts: dict[str, int] = {}
    for _, tree in _trees():
        for name, count in _loaded_names(tree).items():
            counts[name] = counts.get(name, 0) + count
    return counts


def _third_party_base(base) -> bool:
    node = base
    while isinstance(node, ast.Attribute):
        node = node.value
    return isinstance(node, ast.Name) and node.id in THIRD_PARTY_ROOTS


def private_names() -> list[str]:
    own = _own_private_names()
    referenced = _referenced_names()
    out = []
    for path, tree in _trees():
        rel = _rel(path)
        if rel in COMPAT_MODULES:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.startswith(PRIVATE_IMPORTS):
                        out.append(f"{rel}:{node.lineno}: import {alias.name}")
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                if node.module.startswith(PRIVATE_IMPORTS) or (
                        node.module.split(".")[0] in THIRD_PARTY_ROOTS
                        and any(_is_private(part) for part in node.module.split("."))):
                    out.append(f"{rel}:{node.lineno}: from {node.module} import ...")
                elif node.module.split(".")[0] in THIRD_PARTY_ROOTS:
                    for alias in node.names:
                        if _is_private(alias.name):
                            out.append(f"{rel}:{node.lineno}: from {node.module} import {alias.name}")
            elif (isinstance(node, ast.Attribute) and _is_private(node.attr) and node.attr not in own
                  and node.attr not in NAMEDTUPLE_API):
                out.append(f"{rel}:{node.lineno}: .{node.attr}")
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                  and node.func.id in ("getattr", "setattr", "hasattr", "delattr") and len(node.args) >= 2
                  and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)
                  and _is_private(node.args[1].value) and node.args[1].value not in NAMEDTUPLE_API):
                name = node.args[1].value
                if name not in own:
                    out.append(f"{rel}:{node.lineno}: {node.func.id}(..., {name!r})")
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith(
                    tuple(p + "." for p in PRIVATE_IMPORTS)):
                out.append(f"{rel}:{node.lineno}: {node.value!r}")
            elif isinstance(node, ast.ClassDef) and any(_third_party_base(b) for b in node.bases):
                for item in node.body:
                    if not (isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and _is_private(item.name)):
                        continue
                    # references outside the method's own body (its super() call is not one)
                    outside = referenced.get(item.name, 0) - _loaded_names(item).get(item.name, 0)
                    if outside == 0:
                        out.append(f"{rel}:{item.lineno}: overrides {node.name}.{item.name}")
    return out


RUN_SIGNATURE_FIELDS = 4


def run_signatures() -> list[str]:
    out = []
    for path, tree in _trees():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                args = node.args
                params = {a.arg for a in [*args.posonlyargs, *args.args, *args.kwonlyargs]}
                fields = params & RUN_FIELDS
                if len(fields) >= RUN_SIGNATURE_FIELDS:
                    out.append(f"{_rel(path)}:{node.lineno}: {node.name}({', '.join(sorted(fields))})")
    return out


def largest_modules(count: int = 5) -> list[str]:
    sizes = [(len(p.read_text(encoding="utf-8").splitlines()), _rel(p)) for p in package_files()]
    return [f"{rel}: {lines}" for lines, rel in sorted(sizes, reverse=True)[:count]]


MEASURES = {
    "framework_imports": framework_imports,
    "backend_name_branches": backend_name_branches,
    "neutral_backend_imports": neutral_backend_imports,
    "layer_violations": layer_violations,
    "long_modules": long_modules,
    "kind_comparisons": kind_comparisons,
    "strategy_isinstance": strategy_isinstance,
    "private_names": private_names,
    "run_signatures": run_signatures,
}


def main(argv=None) -> int:
    verbose = "-v" in (argv if argv is not None else sys.argv[1:])
    for name, measure in MEASURES.items():
        found = measure()
        files = sorted({line.split(":")[0] for line in found})
        print(f"{name}: {len(found)} in {len(files)} files")
        if verbose:
            for line in found:
                print(f"    {line}")
    print("largest modules: " + ", ".join(largest_modules()))
    return 0


if __name__ == "__main__":
    import signal

    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # `... | head` ends quietly
    sys.exit(main())
