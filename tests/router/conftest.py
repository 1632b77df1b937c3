"""Fixtures for the router tests: Dynamo's standalone KV indexer, started by the tests.

Without the indexer installed these tests skip with the reason printed, except
where ``KVOFFLOAD_REQUIRE_DYNAMO=1`` (CI sets it): there a missing indexer is an
error, so the suite can never pass by skipping them.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvoffload.bench.route_indexer import DYNAMO_PACKAGE, DynamoIndexer, dynamo_installed


def need_dynamo() -> None:
    if dynamo_installed():
        return
    msg = f"Dynamo's KV indexer is not installed (pip install '{DYNAMO_PACKAGE}')"
    if os.environ.get("KVOFFLOAD_REQUIRE_DYNAMO") == "1":
        pytest.fail(msg + " and KVOFFLOAD_REQUIRE_DYNAMO=1", pytrace=False)
    pytest.skip(msg)


@pytest.fixture
def indexer(tmp_path: Path) -> Iterator[DynamoIndexer]:
    need_dynamo()
    idx = DynamoIndexer(log_path=tmp_path / "dynamo-indexer.log")
    idx.start()
    try:
        yield idx
    finally:
        idx.stop()
