"""The package's import graph: one direction, no circle.

Every import counts, including those inside functions and under ``TYPE_CHECKING``: a lazy
import is still a dependency a reader has to follow.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "attnscope"

#: The layers, lowest first. A module may import its own layer's modules and lower layers'
#: (and ``__init__`` is the package's front door, above everything).
LAYERS = [
    {"_version", "errors", "formatting", "display", "stages", "examples", "inputs"},
    {"functional"},
    {"trace", "modules", "grouped"},
    {"checking"},
    {"lesson", "render"},
    {"demo"},
    {"cli", "testing", "__main__"},
]


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(["attnscope", *parts])


def _imports(path: Path, name: str) -> set[str]:
    """The attnscope modules ``path`` imports (relative imports resolved)."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("attnscope")}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            if not module.startswith("attnscope"):
                continue
            # `from . import x` may name a submodule
            for alias in node.names:
                sub = f"{module}.{alias.name}"
                out.add(sub if _exists(sub) else module)
    return out


def _exists(module: str) -> bool:
    rel = Path(*module.split(".")[1:])
    return (PACKAGE / rel).with_suffix(".py").exists() or (PACKAGE / rel / "__init__.py").exists()


def _graph() -> dict[str, set[str]]:
    graph = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        name = _module_name(path)
        graph[name] = {m for m in _imports(path, name) if m != name}
    return graph


def _top(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _layer(module: str) -> int:
    top = _top(module)
    for i, layer in enumerate(LAYERS):
        if top in layer:
            return i
    return len(LAYERS)  # the package's __init__


def test_every_module_has_a_layer():
    """A new module must be placed in the layering, on purpose."""
    missing = {_top(m) for m in _graph() if _layer(m) == len(LAYERS) and m != "attnscope"}
    assert not missing, f"add to LAYERS: {sorted(missing)}"


def test_no_import_circle():
    """No module reaches itself through its imports."""
    graph = _graph()
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph.get(m, ())):
            if state.get(n) == 1:
                cycle = stack[stack.index(n) :] + [n]
                pytest.fail("import circle: " + " -> ".join(cycle))
            if n not in state:
                visit(n)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)


def test_lower_layers_never_import_higher_ones():
    """stages -> functional -> modules/trace -> checking -> render -> demo -> cli."""
    upward = [
        f"{m} imports {n}"
        for m, deps in _graph().items()
        for n in deps
        if m != "attnscope" and _layer(n) > _layer(m)
    ]
    assert not upward, "\n".join(upward)
