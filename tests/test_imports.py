"""Layering of src/kvboost, read from the source: no import cycles, no private names across modules, and no
import of the repository's benchmarks (they use the package; the package never uses them).

The graph has an edge A -> B for every import of kvboost module B anywhere in A: at module level, inside
functions and methods, under try/except. Imports under ``if TYPE_CHECKING:`` never run and are left out.
``from pkg import name`` points at ``pkg.name`` when that is a module, else at ``pkg`` (its __init__).
Importing ``a.b.c`` runs the ``a`` and ``a.b`` packages first; those implicit edges are not counted (every
submodule would otherwise form a cycle with its package's __init__).
"""
from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
ROOT = "kvboost"

# Known cycles / private imports in files owned by others, to be emptied as they are fixed. Entries are
# sorted module tuples (cycles) and "importer -> module.name" strings (private imports).
ALLOWED_CYCLES: set[tuple[str, ...]] = set()
ALLOWED_PRIVATE: set[str] = set()


def _modules() -> dict[str, Path]:
    mods = {}
    for path in sorted((SRC / ROOT).rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        mods[".".join(parts)] = path
    return mods


MODULES = _modules()


def _is_package(name: str) -> bool:
    return MODULES[name].name == "__init__.py"


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement in the tree except those under ``if TYPE_CHECKING:``."""
    found: list[ast.Import | ast.ImportFrom] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def _base(module: str, node: ast.ImportFrom) -> str | None:
    """Absolute module name an ImportFrom reads from (None: outside kvboost)."""
    if node.level == 0:
        name = node.module or ""
    else:
        package = module if _is_package(module) else module.rpartition(".")[0]
        parts = package.split(".")
        if node.level - 1 > len(parts) - 1:
            raise AssertionError(f"{module}: relative import beyond the top-level package")
        parts = parts[: len(parts) - (node.level - 1)]
        name = ".".join(parts + ([node.module] if node.module else []))
    return name if name == ROOT or name.startswith(ROOT + ".") else None


def _nearest_module(name: str) -> str | None:
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _analyse() -> tuple[dict[str, set[str]], list[str]]:
    graph: dict[str, set[str]] = {m: set() for m in MODULES}
    private: list[str] = []
    for module, path in MODULES.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in _imports(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name == ROOT or alias.name.startswith(ROOT + "."):
                        target = _nearest_module(alias.name)
                        if target:
                            graph[module].add(target)
                        private += _private_path(module, alias.name)
                continue
            base = _base(module, node)
            if base is None:
                continue
            private += _private_path(module, base)
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                target = sub if sub in MODULES else _nearest_module(base)
                if target:
                    graph[module].add(target)
                name = alias.name
                if name.startswith("_") and not name.startswith("__") and not _allowed_private(module, target):
                    private.append(f"{module} -> {base}.{name}")
    for m in graph:
        graph[m].discard(m)
    return graph, private


def _allowed_private(importer: str, target: str | None) -> bool:
    """Same module, or a package __init__ re-exporting from inside its own package."""
    if target is None or target == importer:
        return True
    return _is_package(importer) and target.startswith(importer + ".")


def _private_path(importer: str, name: str) -> list[str]:
    """A private module (``a._b``) imported from outside the package that holds it."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part.startswith("_") and not part.startswith("__"):
            owner = ".".join(parts[:i])
            if not (importer == owner or importer.startswith(owner + ".")):
                return [f"{importer} -> {name}"]
    return []


def _cycles(graph: dict[str, set[str]]) -> list[tuple[str, ...]]:
    """Strongly connected components with more than one module (Tarjan), each as a sorted tuple."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[tuple[str, ...]] = []
    counter = 0

    def strong(v: str) -> None:
        nonlocal counter
        index[v] = low[v] = counter
        counter += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(tuple(sorted(comp)))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return sorted(out)


def _path_in(graph: dict[str, set[str]], comp: tuple[str, ...]) -> str:
    """One concrete cycle through the component, for the failure message."""
    start, members = comp[0], set(comp)
    prev: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & members):
                if w == start:
                    path = [start]
                    while v != start:
                        path.append(v)
                        v = prev[v]
                    return " -> ".join([start, *reversed(path[1:]), start])
                if w not in prev:
                    prev[w] = v
                    nxt.append(w)
        frontier = nxt
    return " <-> ".join(comp)


GRAPH, PRIVATE = _analyse()


def test_the_walk_sees_the_package():
    assert {"kvboost", "kvboost.cli", "kvboost.cli_common", "kvboost.samples"} <= set(MODULES)
    # A function-local import is an edge: cli registers the cost command inside a function.
    assert "kvboost.cost" in GRAPH["kvboost.cli"]
    assert "kvboost.cli_common" in GRAPH["kvboost.demo"]


def test_cycle_finder_finds_a_function_local_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [("a", "b", "c")]
    assert _path_in(graph, ("a", "b", "c")) == "a -> b -> c -> a"


def test_no_import_cycles():
    found = _cycles(GRAPH)
    unexpected = [c for c in found if c not in ALLOWED_CYCLES]
    assert not unexpected, "import cycles:\n" + "\n".join(_path_in(GRAPH, c) for c in unexpected)
    stale = ALLOWED_CYCLES - set(found)
    assert not stale, f"fixed, remove from ALLOWED_CYCLES: {sorted(stale)}"


def test_no_private_names_imported_across_modules():
    unexpected = sorted(set(PRIVATE) - ALLOWED_PRIVATE)
    assert not unexpected, "private names imported from another module:\n" + "\n".join(unexpected)
    stale = ALLOWED_PRIVATE - set(PRIVATE)
    assert not stale, f"fixed, remove from ALLOWED_PRIVATE: {sorted(stale)}"


def test_nothing_imports_the_cli():
    # cli.py sits on top: it registers every command. What commands share lives in cli_common.
    assert sorted(m for m, deps in GRAPH.items() if "kvboost.cli" in deps) == []
    assert GRAPH["kvboost.cli_common"] <= {"kvboost"}


BENCHMARKS = "benchmarks"


def _imports_benchmarks(tree: ast.AST) -> list[str]:
    """Imports of the benchmarks package anywhere in the tree, under TYPE_CHECKING too."""
    found = []
    for node in ast.walk(tree):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else []
        found += [n for n in names if n == BENCHMARKS or n.startswith(BENCHMARKS + ".")]
    return found


def _names_benchmarks(tree: ast.AST) -> bool:
    """Whether a string constant in the tree is the benchmarks package or one of its modules (a by-name load)."""
    return any(isinstance(node, ast.Constant) and isinstance(node.value, str)
               and (node.value == BENCHMARKS or node.value.startswith(BENCHMARKS + "."))
               for node in ast.walk(tree))


def test_the_benchmark_scans_see_what_they_look_for():
    assert _imports_benchmarks(ast.parse("import benchmarks.prefix\nfrom benchmarks import shapes\n"
                                         "import benchmarks_other\nfrom . import benchmarks\n")) == [
        "benchmarks.prefix", "benchmarks"]
    assert _names_benchmarks(ast.parse("x = 'benchmarks.commands'")) and not _names_benchmarks(ast.parse("x = 'a'"))


def test_the_package_never_imports_the_benchmarks():
    # The benchmarks live beside the package in a checkout, not inside it: an installed kvboost has none.
    found = {m: _imports_benchmarks(ast.parse(path.read_text(encoding="utf-8"))) for m, path in MODULES.items()}
    assert {m: names for m, names in found.items() if names} == {}
    # The CLI loads them by name, when a checkout holds them, in one place.
    by_name = sorted(m for m, path in MODULES.items() if _names_benchmarks(ast.parse(path.read_text(encoding="utf-8"))))
    assert by_name == ["kvboost.benchmarks_finder"]
