"""What Dynamo 1.6.1's indexer answers for a chain spread over tiers.

It pins ``truth.staged_overlap``.

One publisher per tier layout announces a four-block chain, each block in the
tiers its letters say (G: GPU, C: CPU, D: local disk, R: the shared remote
store); the indexer's ``gpu / cpu / disk`` must be the staged runs that
``staged_overlap`` computes. The remote store (``STORAGE``/``REMOTE``) is not
indexed by 1.6.1, and an offloaded store without token ids is dropped.
"""

from __future__ import annotations

import time

from kvoffload.bench.routing.indexer import DynamoIndexer, TierOverlap
from kvoffload.events.publisher import ZmqEventPublisher
from kvoffload.events.types import BlockStored
from kvoffload.hashing import hash_request_tokens, sha256
from tests.conftest_redis import free_port
from tests.router.test_dynamo_engine import wait_indexed
from tests.router.truth import staged_overlap

BS = 4
MEDIA = {"G": "GPU", "C": "CPU", "D": "DISK", "R": "REMOTE"}
LAYOUTS = ["GCDC", "GDCD", "CGDG", "DCGG", "GGCD", "CDCD", "DDGC", "GDDC", "CCDG", "GR", "RRRR"]


def test_staged_overlap_matches_dynamo(indexer: DynamoIndexer) -> None:
    client = indexer.client
    tokens = list(range(100, 100 + 4 * BS))
    hashes = [bytes(h) for h in hash_request_tokens(tokens, BS, sha256)]
    pubs = []
    try:
        for n in range(len(LAYOUTS)):
            port, replay = free_port(), free_port()
            pub = ZmqEventPublisher(f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{replay}")
            pubs.append(pub)
            client.register(n + 1, f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{replay}", "m", BS)
        time.sleep(0.5)  # the indexer's subscriptions connect (missed batches come by replay)
        for pub, layout in zip(pubs, LAYOUTS):
            for i, letter in enumerate(layout):
                pub.publish(
                    [
                        BlockStored(
                            block_hashes=[hashes[i]],
                            parent_block_hash=hashes[i - 1] if i else None,
                            token_ids=tokens[i * BS : (i + 1) * BS],
                            block_size=BS,
                            medium=MEDIA[letter],
                        )
                    ]
                )
        # An anonymous CPU store (no tokens, size 0: the old default) is dropped.
        pubs[0].publish(
            [
                BlockStored(
                    block_hashes=[b"x" * 32],
                    parent_block_hash=hashes[3],
                    token_ids=[],
                    block_size=0,
                    medium="CPU",
                )
            ]
        )
        wait_indexed(client)
        answer = client.query(tokens, "m")
        for n, layout in enumerate(LAYOUTS):
            flags = {
                tier: [letter == mark for letter in layout] + [False] * (4 - len(layout))
                for tier, mark in (("gpu", "G"), ("cpu", "C"), ("disk", "D"))
            }
            want = staged_overlap(flags, BS)
            got = answer.get(n + 1, TierOverlap())
            assert (got.gpu, got.cpu, got.disk) == (want.gpu, want.cpu, want.disk), layout
        assert indexer.log_lines("Block not published") or indexer.log_lines("Block size")
    finally:
        for pub in pubs:
            pub.shutdown()
