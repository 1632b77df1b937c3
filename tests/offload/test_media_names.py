"""Medium names are written once (``kvoffload.offload.media``): no module spells them out."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import kvoffload
from kvoffload.offload import media

SRC = Path(kvoffload.__file__).parent
NAMES = {media.GPU_MEDIUM, media.CPU_MEDIUM, media.DISK_MEDIUM, media.REMOTE_MEDIUM}


def literal_names(path: Path) -> list[tuple[int, str]]:
    """(line, name) of every string constant that is a medium name (docstrings excluded)."""
    tree = ast.parse(path.read_text())
    docs = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    return [
        (node.lineno, node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and node.value in NAMES and id(node) not in docs
    ]


@pytest.mark.parametrize(
    "module",
    [
        "engine/llm_engine.py",
        "integrations/vllm/worker/worker.py",
        "integrations/vllm/worker/chunk_rows.py",
        "integrations/vllm/scheduler/manager.py",
    ],
)
def test_these_modules_use_the_medium_constants(module: str) -> None:
    assert literal_names(SRC / module) == []
