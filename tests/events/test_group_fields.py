"""Offloaded tiers' group fields survive the wire: live, replayed, and ``kvoffload events``.

CPU and STORAGE events carry ``group_idx``, ``kv_cache_spec_kind`` and
``kv_cache_spec_sliding_window`` as vLLM 0.33's do (issue 32 item 4), and the
shared tier's ``ownership`` (issue 33): the subscriber, the replay socket and
the printer keep every one of them.
"""

from __future__ import annotations

import argparse
import io
import json

from kvoffload.cli import events_cmd
from kvoffload.events.types import BlockRemoved, BlockStored, vllm_block_hash
from tests.events.conftest import PublisherFactory

H = [bytes([i]) * 32 for i in range(1, 4)]
EVENTS = [
    BlockStored(
        H[:2],
        None,
        list(range(8)),
        4,
        None,
        "CPU",
        None,
        [None, None],
        group_idx=1,
        kv_cache_spec_kind="sliding_window",
        kv_cache_spec_sliding_window=128,
    ),
    BlockStored(
        H[2:],
        None,
        [],
        0,
        None,
        "REMOTE",
        group_idx=2,
        kv_cache_spec_kind="full_attention",
        ownership="redis:ns:abc",
    ),
    BlockRemoved(H[:1], "DISK", group_idx=1),
]
# What comes back: vLLM's media and integer hashes, every group field kept.
WANT = [
    {
        "type": "BlockStored",
        "block_hashes": [vllm_block_hash(h) for h in H[:2]],
        "parent_block_hash": None,
        "token_ids": list(range(8)),
        "block_size": 4,
        "lora_id": None,
        "medium": "CPU",
        "lora_name": None,
        "extra_keys": [None, None],
        "group_idx": 1,
        "kv_cache_spec_kind": "sliding_window",
        "kv_cache_spec_sliding_window": 128,
    },
    {
        "type": "BlockStored",
        "block_hashes": [vllm_block_hash(H[2])],
        "parent_block_hash": None,
        "token_ids": [],
        "block_size": 0,
        "lora_id": None,
        "medium": "STORAGE",
        "lora_name": None,
        "group_idx": 2,
        "kv_cache_spec_kind": "full_attention",
        "locality": "REMOTE",
        "ownership": "redis:ns:abc",
    },
    {
        "type": "BlockRemoved",
        "block_hashes": [vllm_block_hash(H[0])],
        "medium": "STORAGE",
        "group_idx": 1,
        "locality": "LOCAL",
    },
]


def _stream(*argv: str) -> list[dict]:
    parser = argparse.ArgumentParser()
    events_cmd.add_arguments(parser)
    out, err = io.StringIO(), io.StringIO()
    rc = events_cmd.stream_events(parser.parse_args(list(argv)), out, err)
    assert rc == 0, err.getvalue()
    return [json.loads(line) for line in out.getvalue().splitlines()]


def test_group_fields_round_trip_through_replay_and_the_printer(
    make_pub: PublisherFactory,
) -> None:
    pub = make_pub()
    pub.publish(EVENTS)
    pub.publish(EVENTS[:1])
    assert pub.flush(120.0)
    lines = _stream(
        "--endpoint", pub.endpoint, "--replay-endpoint", pub.replay_endpoint,
        "--from-seq", "0", "--max-batches", "2", "--json", "--timeout", "10",
    )  # fmt: skip
    assert [line["replayed"] for line in lines] == [True, True]
    assert lines[0]["events"] == WANT
    assert lines[1]["events"] == WANT[:1]


def test_text_printer_names_the_group() -> None:
    from kvoffload.events.types import KVEventBatch, decode_batch, encode_batch

    batch = decode_batch(encode_batch(KVEventBatch(ts=1.0, events=EVENTS)))
    lines = [events_cmd.format_event(e) for e in batch.events]
    assert "group_idx=1" in lines[0] and "kv_cache_spec_sliding_window=128" in lines[0]
    assert "kv_cache_spec_kind=sliding_window" in lines[0]
    assert "locality=REMOTE" in lines[1] and "ownership=redis:ns:abc" in lines[1]
    assert "medium=STORAGE" in lines[2] and "group_idx=1" in lines[2]
