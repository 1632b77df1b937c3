"""KV events against vLLM 0.33's own code: its decoder, its replay framing, its publisher.

* Every batch kvoffload publishes in the default "vllm" profile (GPU, CPU, disk
  and remote tiers, LoRA, clears) decodes with vLLM's
  ``msgspec.msgpack.Decoder(KVEventBatch)``, live and replayed through vLLM's
  replay framing, and is byte for byte what vLLM's own structs encode to.
* kvoffload's subscriber receives every batch of vLLM's ``ZmqEventPublisher``:
  live, gaps (filled by replay) and a catch-up replay from a seq.

Real ZMQ sockets on loopback with OS-chosen ports; timeouts are hang guards only.
"""

from tests.vllm_required import need_vllm

need_vllm()

import hashlib  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402

import msgspec  # noqa: E402
import pytest  # noqa: E402
import zmq  # noqa: E402
from vllm.distributed import kv_events as vk  # noqa: E402
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash  # noqa: E402

from kvoffload.events.publisher import ZmqEventPublisher  # noqa: E402
from kvoffload.events.subscriber import KVEventSubscriber, ReceivedBatch  # noqa: E402
from kvoffload.events.types import (  # noqa: E402
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    encode_batch,
)
from tests.conftest_redis import redis_server, redis_server_factory  # noqa: E402, F401

LOOPBACK_ANY = "tcp://127.0.0.1:*"
TOPIC = "kv-events"
GUARD_S = 30.0
END_SEQ = (-1).to_bytes(8, "big", signed=True)
VLLM_DECODER = msgspec.msgpack.Decoder(type=vk.KVEventBatch)

# Real digests: each half of a hash differs from the other, so an encoder that
# published the high 64 bits instead of vLLM's low 64 would not pass.
H = [hashlib.sha256(f"block {i}".encode()).digest() for i in range(1, 6)]
PARENT = hashlib.sha256(b"parent").digest()


def _ours() -> list[list]:
    """Batches as the engine and connector build them: every tier, LoRA, clears."""
    return [
        [BlockStored(H[:3], PARENT, list(range(48)), 16, None, "GPU")],
        [BlockStored(H[:2], None, list(range(32)), 16, 7, "GPU", "adapter-a")],
        [BlockStored(H[:2], None, [], 0, None, medium) for medium in ("CPU", "DISK", "REMOTE")],
        [BlockRemoved(H[:1], medium) for medium in ("GPU", "CPU", "DISK", "REMOTE")],
        [AllBlocksCleared(), BlockRemoved(H[3:], None)],
        [],
    ]


def _vllm_equivalent(events: list) -> list:
    """The same events as vLLM 0.33 itself builds them."""
    place = {"GPU": ("GPU", None), "CPU": ("CPU", None)}
    place |= {"DISK": ("STORAGE", "LOCAL"), "REMOTE": ("STORAGE", "REMOTE")}
    out = []
    for e in events:
        if isinstance(e, BlockStored):
            medium, locality = place[e.medium]
            out.append(
                vk.BlockStored(
                    block_hashes=[maybe_convert_block_hash(h) for h in e.block_hashes],
                    parent_block_hash=(
                        None
                        if e.parent_block_hash is None
                        else maybe_convert_block_hash(e.parent_block_hash)
                    ),
                    token_ids=e.token_ids,
                    block_size=e.block_size,
                    lora_id=e.lora_id,
                    medium=medium,
                    lora_name=e.lora_name,
                    group_idx=0,
                    locality=locality,
                )
            )
        elif isinstance(e, BlockRemoved):
            medium, locality = place[e.medium] if e.medium is not None else (None, None)
            out.append(
                vk.BlockRemoved(
                    block_hashes=[maybe_convert_block_hash(h) for h in e.block_hashes],
                    medium=medium,
                    group_idx=0,
                    locality=locality,
                )
            )
        else:
            out.append(vk.AllBlocksCleared())
    return out


def test_test_hashes_tell_the_two_halves_apart() -> None:
    for h in [*H, PARENT]:
        assert h[:8] != h[-8:]
        assert maybe_convert_block_hash(h) == int.from_bytes(h[-8:], "big")


def test_payloads_are_byte_identical_to_vllm_structs() -> None:
    encoder = msgspec.msgpack.Encoder()
    for events in _ours():
        ours = encode_batch(KVEventBatch(ts=123.25, events=events, data_parallel_rank=2))
        theirs = encoder.encode(
            vk.KVEventBatch(ts=123.25, events=_vllm_equivalent(events), data_parallel_rank=2)
        )
        assert ours == theirs
        decoded = VLLM_DECODER.decode(ours)
        assert decoded.events == _vllm_equivalent(events)


def test_legacy_profile_is_not_vllms_format() -> None:
    payload = encode_batch(KVEventBatch(ts=1.0, events=_ours()[0]), "legacy")
    with pytest.raises(msgspec.ValidationError):
        VLLM_DECODER.decode(payload)


def _sub_socket(ctx: zmq.Context, endpoint: str) -> zmq.Socket:
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, TOPIC.encode())
    sub.setsockopt(zmq.RCVHWM, 0)
    sub.connect(endpoint)
    return sub


def _vllm_replay_client(ctx: zmq.Context, endpoint: str, start: int) -> list[tuple[int, bytes]]:
    """A replay client as vLLM's framing defines it (REQ envelope, topic frame)."""
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(endpoint)
    dealer.send_multipart([b"", start.to_bytes(8, "big")])
    out = []
    try:
        while True:
            assert dealer.poll(int(GUARD_S * 1000)), "replay stalled"
            empty, topic, seq_bytes, payload = dealer.recv_multipart()
            assert empty == b""
            if seq_bytes == END_SEQ:
                assert (topic, payload) == (b"", b"")
                return out
            assert topic == TOPIC.encode()
            out.append((int.from_bytes(seq_bytes, "big"), payload))
    finally:
        dealer.close(linger=0)


def test_our_publisher_decodes_with_vllm_live_and_replayed() -> None:
    pub = ZmqEventPublisher(LOOPBACK_ANY, LOOPBACK_ANY, TOPIC)
    ctx = zmq.Context()
    sub = _sub_socket(ctx, pub.endpoint)
    try:
        # Beat the slow joiner with probe batches (clears), then publish ours.
        for _ in range(int(GUARD_S / 0.05)):
            pub.publish([AllBlocksCleared()])
            if sub.poll(50):
                break
        assert pub.flush()
        while sub.poll(100):
            sub.recv_multipart()
        first = pub.next_seq
        batches = _ours()
        for events in batches:
            assert pub.publish(events)
        assert pub.flush()
        live = []
        for _ in batches:
            assert sub.poll(int(GUARD_S * 1000))
            topic, seq_bytes, payload = sub.recv_multipart()
            assert topic == TOPIC.encode()
            live.append((int.from_bytes(seq_bytes, "big"), payload))
        replayed = _vllm_replay_client(ctx, pub.replay_endpoint, first)
    finally:
        sub.close(linger=0)
        ctx.term()
        pub.shutdown()
    seqs = list(range(first, first + len(batches)))
    assert [s for s, _ in live] == seqs
    assert [s for s, _ in replayed] == seqs
    for (_, live_payload), (_, replay_payload), events in zip(live, replayed, batches, strict=True):
        assert live_payload == replay_payload
        decoded = VLLM_DECODER.decode(live_payload)
        assert decoded.data_parallel_rank == 0  # vLLM's default rank, never nil
        assert decoded.events == _vllm_equivalent(events)


def test_engine_batches_decode_with_vllm() -> None:
    from kvoffload.engine import EngineConfig, LLMEngine, SamplingParams

    config = EngineConfig(
        block_size=8,
        num_gpu_blocks=16,
        max_num_seqs=2,
        max_num_batched_tokens=64,
        num_cpu_blocks=64,
        events_endpoint=LOOPBACK_ANY,
        events_replay_endpoint=LOOPBACK_ANY,
    )
    engine = LLMEngine(config)
    pub = engine.publisher
    assert isinstance(pub, ZmqEventPublisher)
    replay_endpoint = pub.replay_endpoint
    prompts = [[(7 * i + c) % 500 for i in range(40)] for c in range(3)]
    ctx = zmq.Context()
    try:
        engine.generate(prompts, SamplingParams(max_tokens=4))
        engine.drain()
        assert pub.flush()
        replayed = _vllm_replay_client_any_topic(ctx, replay_endpoint, 0)
    finally:
        engine.close()
        ctx.term()
    media: set[str | None] = set()
    assert replayed
    for _, payload in replayed:
        decoded = VLLM_DECODER.decode(payload)
        for e in decoded.events:
            if isinstance(e, vk.BlockStored | vk.BlockRemoved):
                assert all(isinstance(h, int) for h in e.block_hashes)
                media.add(e.medium)
    assert {"GPU", "CPU"} <= media


def _vllm_replay_client_any_topic(
    ctx: zmq.Context, endpoint: str, start: int
) -> list[tuple[int, bytes]]:
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(endpoint)
    dealer.send_multipart([b"", start.to_bytes(8, "big")])
    out = []
    try:
        while True:
            assert dealer.poll(int(GUARD_S * 1000)), "replay stalled"
            _, _, seq_bytes, payload = dealer.recv_multipart()
            if seq_bytes == END_SEQ:
                return out
            out.append((int.from_bytes(seq_bytes, "big"), payload))
    finally:
        dealer.close(linger=0)


# -- vLLM's publisher -> kvoffload's subscriber ----------------------------------------


def _vllm_publisher(**kwargs: object) -> tuple[vk.ZmqEventPublisher, str, str]:
    vpub = vk.ZmqEventPublisher(
        data_parallel_rank=0,
        endpoint=LOOPBACK_ANY,
        replay_endpoint=LOOPBACK_ANY,
        topic=TOPIC,
        **kwargs,  # type: ignore[arg-type]
    )
    # vLLM keeps the wildcard it was given; the bound ports are on the sockets.
    endpoint = vpub._pub.getsockopt_string(zmq.LAST_ENDPOINT)
    replay_endpoint = vpub._replay.getsockopt_string(zmq.LAST_ENDPOINT)
    return vpub, endpoint, replay_endpoint


_PAD = "x" * 30_000


def _vllm_batch(i: int, pad: str | None = None) -> vk.KVEventBatch:
    event = vk.BlockStored(
        block_hashes=[maybe_convert_block_hash(i.to_bytes(32, "big"))],
        parent_block_hash=None,
        token_ids=[i],
        block_size=16,
        lora_id=None,
        medium="GPU",
        lora_name=pad,
    )
    return vk.KVEventBatch(ts=time.time(), events=[event])


def _collect(sub: KVEventSubscriber, until: Callable[[list[ReceivedBatch]], bool]) -> list:
    out: list[ReceivedBatch] = []
    while not until(out):
        got = sub.recv(GUARD_S)
        assert got, f"stalled after {[r.seq for r in out[-3:]]}"
        out.extend(got)
    return out


def _wait_subscribed(vpub: vk.ZmqEventPublisher, sub: KVEventSubscriber) -> int:
    """Publish probes until one arrives; returns the seq the next batch gets."""
    probes = 0
    last = -1
    for _ in range(int(GUARD_S / 0.05)):
        vpub.publish(vk.KVEventBatch(ts=time.time(), events=[vk.AllBlocksCleared()]))
        probes += 1
        got = sub.recv(0.05)
        if got:
            last = got[-1].seq
            break
    else:
        raise AssertionError("never subscribed")
    # Drain the remaining probes (vLLM's publisher has no flush).
    while last < probes - 1:
        got = sub.recv(GUARD_S)
        assert got, "a probe never arrived"
        last = got[-1].seq
    return probes


def test_our_subscriber_follows_vllm_publisher_live_with_gaps_replayed() -> None:
    vpub, endpoint, replay_endpoint = _vllm_publisher(buffer_steps=2000, hwm=4)
    try:
        with KVEventSubscriber(
            endpoint, replay_endpoint, TOPIC, rcvhwm=4, replay_timeout_s=GUARD_S
        ) as sub:
            start = _wait_subscribed(vpub, sub)
            # ~12 MB while the subscriber is not reading: PUB drops beyond its HWM.
            n = 400
            for i in range(n):
                vpub.publish(_vllm_batch(i, _PAD))
            marker = start + n
            got: list[ReceivedBatch] = []
            # The tail may be dropped with nothing after it to reveal the gap:
            # keep sending markers until the first one arrives.
            for _ in range(int(GUARD_S / 0.1)):
                vpub.publish(vk.KVEventBatch(ts=time.time(), events=[vk.AllBlocksCleared()]))
                got.extend(sub.recv(0.1))
                if any(r.seq >= marker for r in got):
                    break
            got = [r for r in got if r.seq < marker]
    finally:
        vpub.shutdown()
    assert [r.seq for r in got] == list(range(start, marker))
    assert sub.lost_ranges == []
    assert sub.stats.gaps >= 1 and sub.stats.replayed > 0
    assert sub.stats.malformed == 0
    for r in got:
        (event,) = r.batch.events
        assert isinstance(event, BlockStored)
        i = r.seq - start
        assert event.block_hashes == [maybe_convert_block_hash(i.to_bytes(32, "big"))]
        assert event.token_ids == [i]
        assert r.profile == "vllm"
        assert r.batch.data_parallel_rank == 0


def test_our_subscriber_catches_up_from_a_seq_on_vllm_publisher() -> None:
    vpub, endpoint, replay_endpoint = _vllm_publisher(buffer_steps=100)
    try:
        for i in range(20):
            vpub.publish(_vllm_batch(i))
        # vLLM's publisher has no flush: wait until its queue is empty.
        for _ in range(int(GUARD_S / 0.01)):
            if vpub._event_queue.unfinished_tasks == 0:
                break
            time.sleep(0.01)
        with KVEventSubscriber(
            endpoint, replay_endpoint, TOPIC, start_seq=5, replay_timeout_s=GUARD_S
        ) as sub:
            got = _collect(sub, lambda out: any(r.seq == 19 for r in out))
    finally:
        vpub.shutdown()
    assert [(r.seq, r.replayed) for r in got] == [(s, True) for s in range(5, 20)]
    assert [r.batch.events[0].token_ids for r in got] == [[s] for s in range(5, 20)]
    assert sub.lost_ranges == []


def test_kvoffload_events_command_prints_vllm_publisher_batches() -> None:
    import argparse
    import io
    import json

    from kvoffload.cli import events_cmd

    vpub, endpoint, replay_endpoint = _vllm_publisher(buffer_steps=100)
    try:
        for i in range(3):
            vpub.publish(_vllm_batch(i))
        for _ in range(int(GUARD_S / 0.01)):
            if vpub._event_queue.unfinished_tasks == 0:
                break
            time.sleep(0.01)
        parser = argparse.ArgumentParser()
        events_cmd.add_arguments(parser)
        args = parser.parse_args(
            [
                "--endpoint", endpoint, "--replay-endpoint", replay_endpoint,
                "--from-seq", "0", "--max-batches", "3", "--json", "--timeout", str(GUARD_S),
            ]
        )  # fmt: skip
        out, err = io.StringIO(), io.StringIO()
        rc = events_cmd.stream_events(args, out, err)
    finally:
        vpub.shutdown()
    assert rc == 0, err.getvalue()
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    assert [line["seq"] for line in lines] == [0, 1, 2]
    assert {line["format"] for line in lines} == {"vllm"}
    assert [line["events"][0]["token_ids"] for line in lines] == [[0], [1], [2]]
    assert "undecodable" not in err.getvalue()


# -- offloaded tiers: group fields and self-describing payloads (issues 32, 33) ---------


def test_group_fields_of_offloaded_tiers_are_vllms() -> None:
    ours = [
        BlockStored(
            H[:2],
            PARENT,
            list(range(32)),
            16,
            None,
            "CPU",
            group_idx=1,
            kv_cache_spec_kind="sliding_window",
            kv_cache_spec_sliding_window=128,
        ),
        BlockStored(H[2:3], None, [], 0, None, "REMOTE", group_idx=2, ownership="redis:ns:digest"),
        BlockRemoved(H[:1], "DISK", group_idx=1),
    ]
    theirs = [
        vk.BlockStored(
            block_hashes=[maybe_convert_block_hash(h) for h in H[:2]],
            parent_block_hash=maybe_convert_block_hash(PARENT),
            token_ids=list(range(32)),
            block_size=16,
            lora_id=None,
            medium="CPU",
            lora_name=None,
            group_idx=1,
            kv_cache_spec_kind="sliding_window",
            kv_cache_spec_sliding_window=128,
        ),
        vk.BlockStored(
            block_hashes=[maybe_convert_block_hash(H[2])],
            parent_block_hash=None,
            token_ids=[],
            block_size=0,
            lora_id=None,
            medium="STORAGE",
            lora_name=None,
            group_idx=2,
            locality="REMOTE",
            ownership="redis:ns:digest",
        ),
        vk.BlockRemoved(
            block_hashes=[maybe_convert_block_hash(H[0])],
            medium="STORAGE",
            group_idx=1,
            locality="LOCAL",
        ),
    ]
    payload = encode_batch(KVEventBatch(ts=5.0, events=ours, data_parallel_rank=0))
    encoder = msgspec.msgpack.Encoder()
    assert payload == encoder.encode(vk.KVEventBatch(ts=5.0, events=theirs, data_parallel_rank=0))
    assert VLLM_DECODER.decode(payload).events == theirs


def _per_hash(events: list) -> list[tuple]:
    """Each announced hash with its own payload, whatever the grouping into events."""
    out = []
    for e in events:
        if isinstance(e, vk.BlockRemoved):
            out += [("removed", h, e.medium, e.locality, e.group_idx) for h in e.block_hashes]
            continue
        parent = e.parent_block_hash
        for i, h in enumerate(e.block_hashes):
            tokens = tuple(e.token_ids[i * e.block_size : (i + 1) * e.block_size])
            out.append(
                (
                    "stored",
                    h,
                    parent,
                    tokens,
                    e.block_size,
                    e.medium,
                    e.locality,
                    e.group_idx,
                    e.kv_cache_spec_kind,
                    e.kv_cache_spec_sliding_window,
                    e.lora_name,
                )
            )
            parent = h
    return out


@pytest.mark.parametrize("factor", [1, 2])
def test_self_describing_offloaded_events_match_vllms_tracker(factor: int) -> None:
    # vLLM 0.33's OffloadingEventsTracker and kvoffload's describer, same chunks, same
    # tier events: the same hashes, parents, tokens, block size, media and group fields.
    from types import SimpleNamespace

    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.events import (
        OffloadingEventGroupSpec,
        OffloadingEventsTracker,
    )
    from vllm.v1.kv_offload import base as vbase

    from kvoffload.engine.connector.events import OffloadEventDescriber
    from kvoffload.offload.base import OffloadingEvent, make_offload_key

    bs, n_blocks = 4, 6
    hashes = [hashlib.sha256(f"chain {i}".encode()).digest() for i in range(n_blocks)]
    tokens = list(range(100, 100 + bs * n_blocks))
    spec = OffloadingEventGroupSpec("full_attention", None)
    tracker = OffloadingEventsTracker(vbase.OffloadingKVEventsConfig(True, True), {0: spec})
    request = SimpleNamespace(block_hashes=hashes, all_token_ids=tokens, lora_request=None)
    group = SimpleNamespace(
        hashes_per_chunk=factor,
        tokens_per_chunk=factor * bs,
        tokens_per_block=bs,
        group_idx=0,
        kv_event_group_spec=spec,
        sliding_window_size_in_chunks=None,
    )
    keys = [make_offload_key(hashes[(j + 1) * factor - 1]) for j in range(n_blocks // factor)]
    for j, key in enumerate(keys):
        tracker.record_store(request, group, j, key)  # type: ignore[arg-type]
    theirs = list(
        tracker.take_events(
            [
                vbase.OffloadingEvent(keys, vbase.Medium.CPU, removed=False),
                vbase.OffloadingEvent(
                    keys[:1], vbase.Medium.STORAGE, removed=False, locality=vbase.Locality.LOCAL
                ),
                vbase.OffloadingEvent(keys[1:2], vbase.Medium.CPU, removed=True),
            ]
        )
    )
    describer = OffloadEventDescriber(factor, self_describing=True)
    describer.observe(BlockStored(hashes, None, tokens, bs, None, "GPU", None, [None] * n_blocks))
    ours = describer.translate(
        [
            OffloadingEvent(keys, "CPU", removed=False),
            OffloadingEvent(keys[:1], "DISK", removed=False),
            OffloadingEvent(keys[1:2], "CPU", removed=True),
        ]
    )
    decoded = VLLM_DECODER.decode(encode_batch(KVEventBatch(ts=1.0, events=ours))).events
    assert _per_hash(decoded) == _per_hash(theirs)
    # Extra keys: vLLM's tracker leaves them out ("deferred"); ours carry the GPU
    # tier's per-block entries.
    assert all(e.extra_keys is None for e in theirs if isinstance(e, vk.BlockStored))


def _subscriber(endpoint: str) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.SUB)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.connect(endpoint)
    return sock


def _drain_vllm(sock: zmq.Socket) -> list:
    events: list = []
    wait_ms = 2000
    while sock.poll(wait_ms):
        _topic, _seq, payload = sock.recv_multipart()
        events.extend(VLLM_DECODER.decode(payload).events)
        wait_ms = 200
    return events


@pytest.mark.parametrize("way_in", ["KVOffloadConnector", "OffloadingConnector+KVOffloadSpec"])
def test_vllm_connectors_publish_self_describing_cpu_and_disk_stores(tmp_path, way_in: str) -> None:
    # vLLM's own scheduler and publisher, kvoffload's tiers, vLLM's
    # ``self_describing_kv_events`` key: every CPU and STORAGE store carries the
    # tokens, parent and block size of the GPU tier's store of the same hashes.
    import os

    from tests.conftest_redis import free_port
    from tests.integrations.test_vllm_engine import (
        BLOCK_BYTES,
        STOCK,
        STOCK_SPEC,
        evict_and_return,
    )
    from tests.integrations.vllm_rig import VLLMRig

    port = free_port()
    extra: dict = {
        "cpu_bytes": 6 * BLOCK_BYTES,
        "disk_dir": str(tmp_path / "disk"),
        "disk_bytes": "1MiB",
        "self_describing_kv_events": True,
    }
    os.makedirs(extra["disk_dir"])
    kwargs: dict = {}
    if way_in != "KVOffloadConnector":
        extra |= STOCK_SPEC
        kwargs["connector"] = STOCK
    rig = VLLMRig.build(
        tmp_path, extra_config=extra, kv_events_endpoint=f"tcp://*:{port}", **kwargs
    )
    sock = _subscriber(f"tcp://127.0.0.1:{port}")
    try:
        evict_and_return(rig)
        events = _drain_vllm(sock)
    finally:
        sock.close(linger=0)
        rig.shutdown()
    gpu: dict[int, tuple] = {}
    described: dict[tuple, int] = {}
    for e in events:
        if not isinstance(e, vk.BlockStored):
            continue
        parent = e.parent_block_hash
        for i, h in enumerate(e.block_hashes):
            payload = (parent, tuple(e.token_ids[i * 16 : (i + 1) * 16]))
            parent = h
            if e.medium == "GPU":
                gpu[h] = payload
                continue
            assert e.block_size == 16, f"{e.medium} store is not self-describing: {e}"
            # (A GPU store published before the subscription joined is not here.)
            assert gpu.get(h, payload) == payload
            assert e.kv_cache_spec_kind == "full_attention" and e.group_idx == 0
            where = (e.medium, e.locality)
            described[where] = described.get(where, 0) + 1
    assert described.get(("CPU", None)), described
    assert described.get(("STORAGE", "LOCAL")), described


@pytest.mark.redis
def test_vllm_redis_tier_announces_its_shared_ownership(tmp_path, redis_server) -> None:  # noqa: F811
    # The shared tier's stores and removals carry the namespace's id, the same one
    # kvoffload's own engine sends (RedisBlockStore.ownership), and are self-describing.
    from tests.conftest_redis import free_port
    from tests.integrations.test_vllm_engine import BLOCK_BYTES, evict_and_return
    from tests.integrations.vllm_rig import VLLMRig

    port = free_port()
    extra = {
        "cpu_bytes": 6 * BLOCK_BYTES,
        "redis_url": redis_server.url,
        "self_describing_kv_events": True,
    }
    rig = VLLMRig.build(tmp_path, extra_config=extra, kv_events_endpoint=f"tcp://*:{port}")
    sock = _subscriber(f"tcp://127.0.0.1:{port}")
    try:
        evict_and_return(rig)
        events = _drain_vllm(sock)
        (tier,) = rig.manager.secondary_tiers
        owner = tier.store.ownership
    finally:
        sock.close(linger=0)
        rig.shutdown()
    remote = [
        e
        for e in events
        if isinstance(e, vk.BlockStored) and (e.medium, e.locality) == ("STORAGE", "REMOTE")
    ]
    assert remote, "the Redis tier announced nothing"
    assert owner.startswith("redis:") and {e.ownership for e in remote} == {owner}
    assert all(e.block_size == 16 and e.token_ids for e in remote)
