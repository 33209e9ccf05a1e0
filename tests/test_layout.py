"""The package's shape: subpackages named for the pipeline's stages, layered lowest first; every
`specdecode` import (at module level or inside a function) goes to the same layer or a lower one;
no import circle; functions that fit on a screen. Modules are split by job, not by a line count.

`python tests/test_layout.py` prints the layers, the modules' sizes and the longest functions.
"""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "specdecode"

# Lowest first. A module may import from its own layer and the layers before it, never after it.
# The package root (`specdecode/__init__.py`, the public API) sits above them all.
LAYERS = ("core", "data", "models", "decoding", "training", "routing", "watch", "evaluation", "pipeline")
ROOT_LAYER = len(LAYERS)

# Code lines of a function: from `def` to its last line, less its docstring (documentation is not
# what makes a function hard to hold in one's head, and should not be cut to fit).
MAX_FUNCTION_LINES = 75
# Over the limit, capped at their size so they cannot grow. Lower a cap, or drop its entry, when
# its function shrinks.
FUNCTION_LINE_CAPS: dict[str, int] = {
    "specdecode.models.card.render_card": 85,
    "specdecode.training.job._run": 87,
}

SMOKE_MODEL = "specdecode.models.smoke"
SMOKE_LOADER = "specdecode.models.loading"


@cache
def modules() -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its own name, for its __init__)."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


@cache
def tree(name: str) -> ast.Module:
    return ast.parse(modules()[name].read_text(), filename=str(modules()[name]))


def _resolve(target: str) -> str:
    """The module an import of `target` runs: `specdecode.a.b.name` → `specdecode.a.b`."""
    while target not in modules():
        target = target.rpartition(".")[0]
    return target


def imports(name: str) -> list[tuple[str, int, bool]]:
    """`(module, line, at module level)` of every specdecode module that `name` imports."""
    package = name if modules()[name].name == "__init__.py" else name.rpartition(".")[0]
    top_level = {id(node) for node in tree(name).body}
    found = []
    for node in ast.walk(tree(name)):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package
                for _ in range(node.level - 1):
                    anchor = anchor.rpartition(".")[0]
                base = f"{anchor}.{base}".rstrip(".")
            # `from package import submodule` imports the submodule; `from module import name` the module.
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules() else base for alias in node.names]
        else:
            continue
        for target in targets:
            if target == "specdecode" or target.startswith("specdecode."):
                found.append((_resolve(target), node.lineno, id(node) in top_level))
    return found


def layer(name: str) -> int:
    parts = name.split(".")
    if len(parts) == 1:
        return ROOT_LAYER
    return LAYERS.index(parts[1]) if parts[1] in LAYERS else -1


def graph() -> dict[str, set[str]]:
    return {name: {target for target, _, _ in imports(name) if target != name} for name in modules()}


def code_lines(function: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Lines from `def` to the last line of the body, less the docstring's."""
    total = function.end_lineno - function.lineno + 1  # type: ignore[operator]
    first = function.body[0]
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
        total -= first.end_lineno - first.lineno + 1  # type: ignore[operator]
    return total


def function_lengths() -> dict[str, int]:
    """Code lines (`code_lines`) of every function by dotted name (methods and nested functions
    included, under their class or enclosing function)."""
    lengths = {}

    def walk(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lengths[f"{prefix}.{child.name}"] = code_lines(child)
                walk(child, f"{prefix}.{child.name}")
            elif isinstance(child, ast.ClassDef):
                walk(child, f"{prefix}.{child.name}")

    for name in modules():
        walk(tree(name), name)
    return lengths


def module_lines(name: str) -> int:
    return len(modules()[name].read_text().splitlines())


def test_every_module_lives_in_a_layer() -> None:
    stray = [name for name in modules() if layer(name) < 0]
    assert not stray, f"modules outside the layers {LAYERS}: {stray} (move each into the subpackage of its stage)"
    assert set(LAYERS) <= {name.split(".")[1] for name in modules() if "." in name}


def test_imports_point_down() -> None:
    upward = [
        f"{name}:{line} imports {target} ({LAYERS[layer(name)] if layer(name) < ROOT_LAYER else 'root'} → "
        f"{LAYERS[layer(target)] if layer(target) < ROOT_LAYER else 'root'})"
        for name in modules()
        for target, line, _ in imports(name)
        if layer(target) > layer(name)
    ]
    assert not upward, "imports from a lower layer to a higher one:\n" + "\n".join(upward)


def test_no_import_cycle() -> None:
    edges = graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(name: str) -> list[str] | None:
        state[name] = 1
        path.append(name)
        for target in sorted(edges[name]):
            if state.get(target) == 1:
                return path[path.index(target) :] + [target]
            if target not in state and (cycle := visit(target)):
                return cycle
        state[name] = 2
        path.pop()
        return None

    for name in sorted(edges):
        if name not in state and (cycle := visit(name)):
            raise AssertionError("import cycle: " + " → ".join(cycle))


def test_the_smoke_model_is_imported_only_where_it_is_built() -> None:
    importers = [
        (name, line, top) for name in modules() for target, line, top in imports(name) if target == SMOKE_MODEL
    ]
    assert all(name == SMOKE_LOADER and not top for name, _, top in importers), (
        f"{SMOKE_MODEL} may only be imported inside {SMOKE_LOADER}'s functions, got {importers}"
    )


def test_the_layer_test_sees_imports_at_every_level() -> None:
    """The checks above read function-level imports too (the loader's smoke import is one)."""
    assert any(target == SMOKE_MODEL and not top for target, _, top in imports(SMOKE_LOADER))
    assert any(target == "specdecode.decoding.decode" and top for target, _, top in imports("specdecode"))


def test_functions_fit_on_a_screen() -> None:
    too_long = {
        name: length
        for name, length in function_lengths().items()
        if length > FUNCTION_LINE_CAPS.get(name, MAX_FUNCTION_LINES)
    }
    assert not too_long, f"functions over {MAX_FUNCTION_LINES} lines (or their cap): {too_long}"


def test_the_public_api_is_importable_from_the_root() -> None:
    import specdecode

    assert set(specdecode.__all__) == {
        "DecodeStats",
        "GenerationResult",
        "SamplingParams",
        "autoregressive_generate",
        "logits_to_probs",
        "rejection_sample",
        "sample",
        "speculative_generate",
    }
    assert all(callable(getattr(specdecode, name)) for name in specdecode.__all__)


if __name__ == "__main__":
    for index, name in enumerate(LAYERS):
        members = [m for m in modules() if layer(m) == index]
        print(f"{index} {name}: " + ", ".join(f"{m.split('.', 2)[-1]} ({module_lines(m)})" for m in members))
    print("longest functions (code lines, docstrings not counted):")
    for name, length in sorted(function_lengths().items(), key=lambda item: -item[1])[:8]:
        print(f"  {length:4d} {name}")
