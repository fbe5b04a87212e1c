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
(b) The repository stands on its own: no file in ``keras_noisecurve/``, ``docs/`` or
    ``README.md`` cites the internal design brief (``DESIGN.md``) or the directory
    it lives in.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "keras_noisecurve"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted((ROOT / PACKAGE).rglob("*.py"))}


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


def _imports(module: str, modules) -> set[str]:
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


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
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


def test_import_graph_is_built_from_every_module():
    modules = _modules()
    graph = {m: _imports(m, modules) for m in modules}
    assert f"{PACKAGE}.training.clipping" in graph
    # a function-level import is an edge (estimate imports its helpers lazily)
    assert f"{PACKAGE}.spectrum.lanczos" in graph[f"{PACKAGE}.spectrum.estimate"]
    # `from package import submodule` is an edge to the submodule
    assert f"{PACKAGE}.training.ghost" in graph[f"{PACKAGE}.training.clipping"]


def test_no_import_cycles():
    modules = _modules()
    graph = {m: _imports(m, modules) for m in modules}
    cycles = _cycles(graph)
    assert not cycles, "import cycles among keras_noisecurve modules:\n" + "\n".join(
        "  " + " -> ".join(cycle) for cycle in cycles
    )


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
