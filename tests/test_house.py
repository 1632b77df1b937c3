"""The house rules of issue 37, checked on the source tree itself.

No source file over 500 lines, no function over 80, and nothing in the
product imports the measurement wing (``kvoffload.bench``): only the wing
itself and the command table that names its modules by string may.
"""

from __future__ import annotations

import ast
import pathlib

SRC = pathlib.Path(__file__).resolve().parent.parent / "src" / "kvoffload"
FILE_LIMIT = 500
FUNCTION_LIMIT = 80
SOURCES = sorted(SRC.rglob("*.py"))


def _relative(path: pathlib.Path) -> str:
    return str(path.relative_to(SRC.parent))


def test_the_tree_is_there() -> None:
    assert len(SOURCES) > 100, "the source tree was not found next to tests/"


def test_no_file_over_the_limit() -> None:
    long = [
        f"{_relative(path)} ({lines})"
        for path in SOURCES
        if (lines := path.read_text().count("\n")) > FILE_LIMIT
    ]
    assert not long, f"files over {FILE_LIMIT} lines: {', '.join(long)}"


def _long_functions(path: pathlib.Path) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    return [
        f"{_relative(path)}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1})"
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.end_lineno is not None
        and node.end_lineno - node.lineno + 1 > FUNCTION_LIMIT
    ]


def test_no_function_over_the_limit() -> None:
    long = [name for path in SOURCES for name in _long_functions(path)]
    assert not long, f"functions over {FUNCTION_LIMIT} lines: {', '.join(long)}"


def _imported_modules(tree: ast.AST) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


PRODUCT = [p for p in SOURCES if "bench" not in p.relative_to(SRC).parts[:1]]


def test_the_product_never_imports_the_wing() -> None:
    offenders = [
        f"{_relative(path)} imports {module}"
        for path in PRODUCT
        for module in sorted(_imported_modules(ast.parse(path.read_text(), str(path))))
        if module == "kvoffload.bench" or module.startswith("kvoffload.bench.")
    ]
    assert not offenders, "; ".join(offenders)
