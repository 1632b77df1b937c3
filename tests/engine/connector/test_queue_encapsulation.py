"""Only kvoffload.blocks may touch the free queue's sentinels and links."""

import re
from pathlib import Path

import kvoffload

SRC = Path(kvoffload.__file__).parent
FORBIDDEN = re.compile(r"\b(prev_free_block|next_free_block)\b|free_block_queue\._|\bqueue\._")


def test_no_code_outside_blocks_touches_queue_internals() -> None:
    offenders = []
    files = [p for p in SRC.rglob("*.py") if "blocks" not in p.relative_to(SRC).parts]
    assert files, "found no source files to check"
    for path in files:
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
            if FORBIDDEN.search(line):
                offenders.append(f"{path.relative_to(SRC)}:{lineno}: {line.strip()}")
    assert not offenders, "queue internals used outside kvoffload.blocks:\n" + "\n".join(offenders)


def test_the_check_itself_catches_a_link_access() -> None:
    assert FORBIDDEN.search("cur = block.next_free_block")
    assert FORBIDDEN.search("pool.free_block_queue._head")
    assert FORBIDDEN.search("queue._tail")
    assert not FORBIDDEN.search("queue.iter_blocks_after(cursor)")
