"""The house in figures: lines per top-level room, files over 500 lines, functions over 80.

Run from the repository root: ``python scripts/house.py [--list]``. ``--list`` names
every file and function over its limit (the figures alone otherwise).
"""

from __future__ import annotations

import argparse
import ast
import collections
import pathlib
import re

FILE_LIMIT = 500
FUNCTION_LIMIT = 80
ROOT = pathlib.Path("src/kvoffload")


def long_functions(path: pathlib.Path) -> list[tuple[str, int]]:
    tree = ast.parse(path.read_text(), str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            length = (node.end_lineno or node.lineno) - node.lineno + 1
            if length > FUNCTION_LIMIT:
                found.append((f"{path}:{node.lineno} {node.name}", length))
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--list", action="store_true", help="name each file / function over")
    args = parser.parse_args()
    rooms: collections.Counter[str] = collections.Counter()
    big_files, big_functions, ignores = [], [], 0
    for path in sorted(ROOT.rglob("*.py")):
        text = path.read_text()
        lines = text.count("\n")
        parts = path.relative_to(ROOT).parts
        rooms[parts[0] if len(parts) > 1 else "(top)"] += lines
        ignores += len(re.findall(r"#\s*type:\s*ignore", text))
        if lines > FILE_LIMIT:
            big_files.append((str(path), lines))
        big_functions += long_functions(path)
    total = sum(rooms.values())
    for room, lines in rooms.most_common():
        print(f"{room:14s} {lines:6d} lines  {100 * lines / total:5.1f}%")
    print(f"{'total':14s} {total:6d} lines")
    print(f"files over {FILE_LIMIT}: {len(big_files)}; functions over {FUNCTION_LIMIT}: "
          f"{len(big_functions)}; type: ignore: {ignores}")
    if args.list:
        for name, n in big_files + big_functions:
            print(f"  {n:4d}  {name}")


if __name__ == "__main__":
    main()
