"""Record every batch of KV events an engine publishes, in the test process.

Invariant: the wrapper passes each batch on to the engine's real ``publish``
unchanged (subscribers still get it) and appends its events to the list
first, in publish order, so the list is exactly what was published.
"""

from __future__ import annotations

from kvoffload.engine import LLMEngine
from kvoffload.events import KVEvent


def record_published(engine: LLMEngine) -> list[KVEvent]:
    """Wrap ``engine.publisher.publish``; the list it returns fills as the engine publishes."""
    published: list[KVEvent] = []
    publish = engine.publisher.publish

    def record(events: list[KVEvent]) -> bool:
        published.extend(events)
        return publish(events)

    engine.publisher.publish = record  # type: ignore[method-assign]
    return published
