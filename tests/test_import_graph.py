"""The package's import graph (issue 22): no import circles, no module importing the top package
``probehook``, and no vLLM in the layers that run without it.

The source is read with ``ast``; nothing is imported, so this runs in well under a second. Every
``import`` counts, at module level or inside a function, except under ``if TYPE_CHECKING:``
(those never run). An import is an edge to the deepest ``probehook`` module it names:
``from probehook.store import records`` to ``probehook.store.records``,
``from probehook.store import ActivationStore`` to ``probehook.store``. The parent packages
Python imports on the way (``probehook``, ``probehook.store``) are not edges, or every package
whose ``__init__`` re-exports its modules would be a circle with each of them.
"""

from __future__ import annotations

import ast
import importlib.util
from collections.abc import Iterator
from pathlib import Path

PACKAGE = "probehook"
_SPEC = importlib.util.find_spec(PACKAGE)  # finds the package without running it
assert _SPEC is not None and _SPEC.origin is not None
ROOT = Path(_SPEC.origin).resolve().parent

# Circles (strongly connected components of more than one module) still allowed, with why.
# Keep it short: a new circle is fixed, not added here, and one that is gone must leave the list
# (test_allowlist_is_current), so it cannot come back unnoticed.
ALLOWED_CYCLES: dict[frozenset[str], str] = {
    frozenset({"probehook.probes.file", "probehook.probes.linear", "probehook.probes.train"}): (
        "LinearProbe.save/load/fit delegate, inside the methods, to probes/file.py and "
        "probes/train.py, which build LinearProbe objects; the issue accepts these class <-> "
        "helper circles (breaking them means moving the class's public methods)."
    ),
    frozenset({"probehook.steering.file", "probehook.steering.vector"}): (
        "SteeringVector.save/load delegate, inside the methods, to steering/file.py, which "
        "builds SteeringVector objects: the same accepted class <-> helper circle."
    ),
}

# Layers that run without vLLM (the user's process, vLLM's worker through our own operators,
# offline tools): neither they nor any probehook module they import may import vllm. Only
# probehook/adapter, the command line and model plugins (probehook/models) do.
NO_VLLM = (
    "core", "worker", "frontend", "store", "probes", "steering", "outputs", "saes", "lenses",
)  # fmt: skip


def module_names(root: Path = ROOT, package: str = PACKAGE) -> dict[str, Path]:
    """Dotted name of every module under ``root``; a package by its own name."""
    names = {}
    for path in sorted(root.rglob("*.py")):
        parts = [package, *path.relative_to(root).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def runtime_imports(tree: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement that can run: all nesting levels, ``if TYPE_CHECKING:`` skipped."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                yield from runtime_imports(ast.Module(body=[child], type_ignores=[]))
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        yield from runtime_imports(node)


def imported_names(module: str, is_package: bool, node: ast.Import | ast.ImportFrom) -> list[str]:
    """The dotted names an import statement reaches: ``from a.b import c`` gives ``a.b.c``."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if node.level:
        base = module.split(".")
        if not is_package:
            base = base[:-1]
        base = base[: len(base) - node.level + 1]
        target = ".".join([*base, *([node.module] if node.module else [])])
    else:
        target = node.module or ""
    return [f"{target}.{alias.name}" for alias in node.names]


def _deepest_module(name: str, modules: dict[str, Path]) -> str | None:
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


class Graph:
    """Edges between the package's modules, plus the facts the tests below check."""

    def __init__(self, root: Path = ROOT, package: str = PACKAGE) -> None:
        self.package = package
        self.modules = module_names(root, package)
        self.edges: dict[str, set[str]] = {name: set() for name in self.modules}
        self.top_imports: list[str] = []  # "module:line" importing the top package itself
        self.vllm_imports: dict[str, list[int]] = {}
        for name, path in self.modules.items():
            is_package = path.name == "__init__.py"
            tree = ast.parse(path.read_text(), filename=str(path))
            for node in runtime_imports(tree):
                for target in imported_names(name, is_package, node):
                    if target == "vllm" or target.startswith("vllm."):
                        self.vllm_imports.setdefault(name, []).append(node.lineno)
                    if target != package and not target.startswith(package + "."):
                        continue
                    reached = _deepest_module(target, self.modules)
                    if reached == package and name != package:
                        self.top_imports.append(f"{name}:{node.lineno} ({target})")
                    if reached is not None and reached != name:
                        self.edges[name].add(reached)

    def cycles(self) -> list[frozenset[str]]:
        """Strongly connected components of more than one module (Tarjan, iterative)."""
        index: dict[str, int] = {}
        low: dict[str, int] = {}
        stack: list[str] = []
        on_stack: set[str] = set()
        found: list[frozenset[str]] = []
        for start in sorted(self.edges):
            if start in index:
                continue
            work = [(start, iter(sorted(self.edges[start])))]
            index[start] = low[start] = len(index)
            stack.append(start)
            on_stack.add(start)
            while work:
                node, children = work[-1]
                child = next(children, None)
                if child is not None:
                    if child not in index:
                        index[child] = low[child] = len(index)
                        stack.append(child)
                        on_stack.add(child)
                        work.append((child, iter(sorted(self.edges[child]))))
                    elif child in on_stack:
                        low[node] = min(low[node], index[child])
                    continue
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
                if low[node] == index[node]:
                    component = set()
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.add(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(frozenset(component))
        return found

    def folders(self) -> Graph:
        """The same imports, between the package's folders (``pkg.store``, ``pkg.adapter``; a
        module at the top is its own): a circle of folders is a layering error even where no
        module circle exists (store -> frontend -> probes -> store, say)."""
        top = self.package  # its facade imports every folder; imports of it are refused apart
        folded = object.__new__(Graph)
        folded.package = top
        folded.modules = {_folder(n): path for n, path in self.modules.items() if n != top}
        folded.edges = {folder: set() for folder in folded.modules}
        for name, targets in self.edges.items():
            if name != top:
                mine = _folder(name)
                folded.edges[mine] |= {_folder(t) for t in targets} - {mine, top}
        return folded

    def path_in(self, component: frozenset[str]) -> list[str]:
        """A shortest closed walk through ``component``'s first module, for the failure message."""
        start = min(component)
        previous: dict[str, str] = {}
        frontier = [start]
        while frontier:
            following = []
            for node in frontier:
                for child in sorted(self.edges[node] & component):
                    if child == start:
                        walk = [node]
                        while walk[-1] != start:
                            walk.append(previous[walk[-1]])
                        return [*reversed(walk), start]
                    if child not in previous:
                        previous[child] = node
                        following.append(child)
            frontier = following
        return sorted(component)


GRAPH = Graph()


def _describe(graph: Graph, component: frozenset[str]) -> str:
    members = ", ".join(sorted(component))
    return f"{' -> '.join(graph.path_in(component))}  (component: {members})"


def _folder(module: str) -> str:
    return ".".join(module.split(".")[:2])


def _layer(module: str) -> str:
    return module.split(".")[1] if "." in module else ""


def _reached(graph: Graph, start: str, not_through: str | None = None) -> dict[str, str]:
    """Every module ``start`` imports, directly or not, each with the module that imports it
    (``not_through``: a module whose own imports are not followed)."""
    via = {start: start}
    todo = [start]
    while todo:
        node = todo.pop()
        if node == not_through:
            continue
        for child in sorted(graph.edges[node]):
            if child not in via:
                via[child] = node
                todo.append(child)
    return via


def _chain(via: dict[str, str], end: str) -> list[str]:
    chain = [end]
    while via[chain[-1]] != chain[-1]:
        chain.append(via[chain[-1]])
    return chain[::-1]


def vllm_offenders(graph: Graph) -> list[str]:
    """Each no-vLLM module that imports vllm, itself or through probehook modules."""
    offenders = []
    for module in sorted(graph.modules):
        if _layer(module) not in NO_VLLM:
            continue
        via = _reached(graph, module)
        for reached in sorted(via):
            if reached in graph.vllm_imports:
                lines = ", ".join(map(str, graph.vllm_imports[reached]))
                offenders.append(f"{' -> '.join(_chain(via, reached))} (vllm at line {lines})")
                break
    return offenders


def test_graph_sees_the_package() -> None:
    # A broken walk (wrong root, every import skipped) would pass the tests below vacuously.
    assert len(GRAPH.modules) > 50
    assert "probehook.adapter.frontend.offline" in GRAPH.vllm_imports
    assert "probehook.frontend.response_fields" in GRAPH.edges["probehook.adapter.server.serve"]


def test_the_checks_catch_what_they_are_for(tmp_path: Path) -> None:
    # A small package with one of each thing the tests refuse, and what they must let through.
    files = {
        "__init__.py": "from pkg.core import a\n",
        "core/__init__.py": "",
        # a circle through an import inside a function
        "core/a.py": "from pkg.core.b import B\n",
        "core/b.py": "class B:\n    def f(self):\n        from pkg.core import a\n",
        # a circle only under TYPE_CHECKING: never runs, not a circle
        "core/c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import pkg.core.d\n",
        "core/d.py": "import pkg.core.c\n",
        # the top package, imported inside a function
        "core/e.py": "def f():\n    from pkg import thing\n",
        # vllm: directly inside a function, and through an adapter module
        "core/f.py": "def f():\n    import vllm.config\n",
        "core/g.py": "from pkg.adapter import h\n",
        "adapter/__init__.py": "",
        "adapter/h.py": "from vllm import LLM\n",
        # folders in a circle whose modules are not: store -> front -> store
        "store/__init__.py": "",
        "store/s1.py": "from pkg.front import f1\n",
        "store/s2.py": "",
        "front/__init__.py": "",
        "front/f1.py": "",
        "front/f2.py": "from pkg.store import s2\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    graph = Graph(tmp_path, "pkg")
    assert graph.cycles() == [frozenset({"pkg.core.a", "pkg.core.b"})]
    assert graph.path_in(frozenset({"pkg.core.a", "pkg.core.b"})) == [
        "pkg.core.a",
        "pkg.core.b",
        "pkg.core.a",
    ]
    assert graph.folders().cycles() == [frozenset({"pkg.front", "pkg.store"})]
    assert graph.top_imports == ["pkg.core.e:2 (pkg.thing)"]
    assert vllm_offenders(graph) == [
        "pkg.core.f (vllm at line 2)",
        "pkg.core.g -> pkg.adapter.h (vllm at line 1)",
    ]


def test_no_import_circles() -> None:
    found = GRAPH.cycles()
    new = [component for component in found if component not in ALLOWED_CYCLES]
    assert not new, "import circles (move what both sides need to a module of its own):\n" + (
        "\n".join(_describe(GRAPH, component) for component in new)
    )


def test_no_folder_circles() -> None:
    folders = GRAPH.folders()
    found = folders.cycles()
    assert not found, "folders importing each other in a circle (a layering error):\n" + (
        "\n".join(_describe(folders, component) for component in found)
    )


def test_allowlist_is_current() -> None:
    found = set(GRAPH.cycles())
    stale = [sorted(component) for component in ALLOWED_CYCLES if component not in found]
    assert not stale, f"circles gone or changed, update ALLOWED_CYCLES: {stale}"


def test_no_imports_of_the_top_package() -> None:
    # probehook/__init__.py is the user's facade: inside the package a name is imported from the
    # module that defines it (probehook._version for __version__), since the facade's lazy
    # names would pull vLLM and every layer into the module that asks.
    assert not GRAPH.top_imports, "imports of the top package from inside it:\n" + "\n".join(
        GRAPH.top_imports
    )


def test_no_vllm_in_the_layers_without_it() -> None:
    offenders = vllm_offenders(GRAPH)
    assert not offenders, "vllm imported by a layer that runs without it:\n" + "\n".join(offenders)


FRONT_END = ("probehook.frontend", "probehook.adapter.frontend", "probehook.adapter.server")
WORKER = ("probehook.worker", "probehook.adapter.worker")
ENTRY_POINT = "probehook.adapter.plugin"
"""vLLM's entry point: it imports the worker's loader in the processes that load the model."""


def test_the_front_end_never_imports_the_workers_code() -> None:
    """The user's process checks models and builds engine arguments from ``probehook.core``;
    the worker's modules (its custom ops, the loader) load only where the model does, through
    the plugin (issue 37, item 6: engine_config imported the loader for a table and keys)."""
    offenders = []
    for module in sorted(m for m in GRAPH.modules if m.startswith(FRONT_END)):
        via = _reached(GRAPH, module, not_through=ENTRY_POINT)
        worker = sorted(r for r in via if r.startswith(WORKER))
        if worker:
            offenders.append(" -> ".join(_chain(via, worker[0])))
    assert not offenders, "front-end modules importing the worker's:\n" + "\n".join(offenders)
