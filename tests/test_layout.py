"""The package's shape: no import cycles, imports run downward, modules and functions stay small.

The import graph is read from the source (``ast``), module by module: every ``import`` and
``from ... import`` of a mixprec module counts, also inside functions (a lazy import is still a
dependency); only ``if TYPE_CHECKING:`` blocks are left out (they never run).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import mixprec

SRC = Path(mixprec.__file__).resolve().parent
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 40  # of code: docstrings, comments, blank lines and nested defs left out

# Known exceptions in other engineers' areas, each with who fixes it. The test fails when one
# is no longer needed, so the list only shrinks.
MODULE_EXCEPTIONS: dict[str, str] = {}
FUNCTION_EXCEPTIONS: dict[tuple[str, str], str] = {}

# (importer prefix, forbidden prefix): the layers of docs/internals.md.
FORBIDDEN = [
    ("mixprec._src.kernels", "mixprec._src.scaling"),
    ("mixprec._src.dist", "mixprec._src.scaling"),
    ("mixprec._src.devices", "mixprec._src.scaling"),
    ("mixprec._src.optim", "mixprec._src.scaling"),
    ("mixprec._src.master", "mixprec._src.scaling"),
    ("mixprec._src.autocast", "mixprec._src.scaling"),
    ("mixprec._src.fp8", "mixprec._src.autocast"),
    ("mixprec._src", "mixprec.integrations"),
    ("mixprec._src", "mixprec.cli"),
    ("mixprec._src", "mixprec.distributed"),
    ("mixprec._src", "mixprec.types"),
]


def _name(path: Path) -> str:
    parts = ["mixprec", *path.relative_to(SRC).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_name(p): p for p in sorted(SRC.rglob("*.py"))}


def _type_checking(node: ast.If) -> bool:
    test = node.test
    return getattr(test, "id", None) == "TYPE_CHECKING" or getattr(test, "attr", None) == (
        "TYPE_CHECKING"
    )


def _imports(name: str, path: Path) -> set[str]:
    """The mixprec modules ``name`` imports (a ``from pkg import module`` names the module)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _type_checking(child):
                continue
            if isinstance(child, ast.Import):
                found.update(a.name for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    head = package.split(".")[: len(package.split(".")) - child.level + 1]
                    base = ".".join([*head, *([child.module] if child.module else [])])
                for alias in child.names:
                    full = f"{base}.{alias.name}"
                    found.add(full if full in MODULES else base)
            visit(child)

    visit(ast.parse(path.read_text()))
    return {m for m in found if m in MODULES and m != name}


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return found


def test_the_graph_is_read_at_all() -> None:
    assert "mixprec._src.scaling.state" in GRAPH["mixprec._src.scaling.grad_scaler"]
    assert "mixprec._src.dist.norms" in GRAPH["mixprec._src.dist.state"]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycles_between_modules() -> None:
    assert _cycles(GRAPH) == []


def test_no_import_cycles_between_subpackages() -> None:
    def package(name: str) -> str:
        parts = name.split(".")
        return ".".join(parts[:3] if parts[1:2] == ["_src"] else parts[:2])

    packages: dict[str, set[str]] = {}
    for name, targets in GRAPH.items():
        edges = packages.setdefault(package(name), set())
        edges.update(package(t) for t in targets if package(t) != package(name))
    for name in list(packages.values()):
        for target in name:
            packages.setdefault(target, set())
    assert _cycles(packages) == []


def test_imports_run_downward() -> None:
    wrong = [
        (name, target)
        for name, targets in GRAPH.items()
        for target in targets
        for low, high in FORBIDDEN
        if name.startswith(low) and target.startswith(high)
    ]
    assert wrong == []


def test_modules_stay_small() -> None:
    sizes = {name: len(p.read_text().splitlines()) for name, p in MODULES.items()}
    big = {n: s for n, s in sizes.items() if s >= MAX_MODULE_LINES and n not in MODULE_EXCEPTIONS}
    assert big == {}
    fixed = [n for n in MODULE_EXCEPTIONS if n in sizes and sizes[n] < MAX_MODULE_LINES]
    assert fixed == [], "remove these from MODULE_EXCEPTIONS"


def _code_lines(function: ast.AST, lines: list[str]) -> int:
    skipped: set[int] = set()
    body = getattr(function, "body", [])
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        skipped.update(range(body[0].lineno, (body[0].end_lineno or body[0].lineno) + 1))
    for inner in ast.walk(function):
        if inner is not function and isinstance(
            inner, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
        ):
            skipped.update(range(inner.lineno, (inner.end_lineno or inner.lineno) + 1))
    first, last = body[0].lineno, getattr(function, "end_lineno", 0) or 0
    return sum(
        1
        for i in range(first, last + 1)
        if i not in skipped and lines[i - 1].strip() and not lines[i - 1].strip().startswith("#")
    )


def test_functions_stay_short() -> None:
    long, seen = {}, set()
    for name, path in MODULES.items():
        lines = path.read_text().splitlines()
        for node in ast.walk(ast.parse("\n".join(lines))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                size = _code_lines(node, lines)
                key = (name, node.name)
                seen.add(key)
                if size > MAX_FUNCTION_LINES and key not in FUNCTION_EXCEPTIONS:
                    long[key] = size
    assert long == {}
    assert [k for k in FUNCTION_EXCEPTIONS if k not in seen] == []


def test_the_root_exports_at_most_25_names() -> None:
    assert len(mixprec.__all__) <= 25
    assert all(hasattr(mixprec, name) for name in mixprec.__all__)


def test_import_mixprec_loads_no_integration_and_no_cli() -> None:
    """`import mixprec` in a fresh interpreter: the integrations and the CLI load on use only."""
    code = (
        "import sys, mixprec; print(' '.join(sorted(m for m in sys.modules "
        "if m.startswith(('mixprec.integrations', 'mixprec.cli')))))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.split() == []
