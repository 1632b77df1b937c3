"""kvoffload inside vLLM 0.33's real scheduler and worker-side connector, on the CPU.

Every engine here is built through the public names (``KVOffloadConnector``
via ``kv_connector_module_path``, or vLLM's stock ``OffloadingConnector``
with ``spec_name="KVOffloadSpec"``) by vLLM's own factories; see ``vllm_rig``.
"""

from tests.vllm_required import need_vllm

need_vllm()

import os  # noqa: E402
from pathlib import Path  # noqa: E402

import msgspec  # noqa: E402
import pytest  # noqa: E402
import zmq  # noqa: E402
from vllm.distributed.kv_events import BlockStored, KVEventBatch  # noqa: E402
from vllm.v1.core.sched.async_scheduler import AsyncScheduler  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402

from kvoffload.integrations.vllm import KVOffloadConfigError  # noqa: E402
from kvoffload.integrations.vllm.scheduler.tiering import KVOffloadTieringManager  # noqa: E402
from tests.conftest_redis import free_port  # noqa: E402
from tests.integrations.vllm_rig import BLOCK_SIZE, VLLMRig  # noqa: E402

PROMPT = list(range(1, 81))  # 5 full blocks
PROMPT_BLOCKS = len(PROMPT) // BLOCK_SIZE
PAGE_BYTES = 2048  # one layer's K and V of one block: 16 tokens x 2 heads x 16 x fp16 x 2
BLOCK_BYTES = 2 * PAGE_BYTES  # two layers
STOCK = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both"}
STOCK_SPEC = {"spec_name": "KVOffloadSpec", "spec_module_path": "kvoffload.integrations.vllm"}


def flood(rig: VLLMRig, n: int = 3) -> None:
    """Serve ``n`` unrelated prompts, enough to push every earlier block out of the GPU tier."""
    for i in range(n):
        rig.add([1000 + 100 * i + j for j in range(len(PROMPT))], req_id=f"flood{i}")
    rig.run()


def evict_and_return(rig: VLLMRig) -> int:
    """Serve PROMPT, push it out of the GPU tier, serve it again; tokens computed at re-entry."""
    rig.add(PROMPT, req_id="first")
    rig.run()
    flood(rig)
    rig.add([*PROMPT, 5, 6], req_id="again")
    rig.run()
    return rig.first_computed["again"]


def assert_no_leaks(rig: VLLMRig) -> None:
    """Nothing pinned, storing or in flight on either side; every GPU block back in the pool."""
    manager = rig.manager
    if isinstance(manager, KVOffloadTieringManager):
        # Lower tiers: vLLM's tiering manager, its CPU tier on the shared region.
        assert not manager.has_pending_work()
    else:
        assert manager.num_in_flight() == 0
        cpu = manager.cpu
        assert cpu.num_evictable_blocks() == cpu.num_stored_blocks(), "CPU blocks left pinned"
    assert rig.kv_worker.num_in_flight() == 0
    assert not rig.scheduler.requests
    pool = rig.scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == rig.scheduler.cache_config.num_gpu_blocks - 1


@pytest.mark.parametrize("scheduler_cls", [Scheduler, AsyncScheduler])
def test_cpu_tier_serves_a_prefix_the_gpu_tier_evicted(
    tmp_path: Path, scheduler_cls: type[Scheduler], record_property
) -> None:
    baseline = VLLMRig.build(tmp_path / "gpu", scheduler_cls=scheduler_cls)
    gpu_only = evict_and_return(baseline)
    rig = VLLMRig.build(
        tmp_path / "cpu", scheduler_cls=scheduler_cls, extra_config={"cpu_bytes": "1MiB"}
    )
    with_cpu = evict_and_return(rig)
    record_property("computed_tokens_gpu_hit_alone", gpu_only)
    record_property("computed_tokens_with_cpu_tier", with_cpu)
    record_property("bytes_verified", rig.bytes_verified)
    print(
        f"{scheduler_cls.__name__}: computed tokens at re-entry: GPU hit alone {gpu_only}, "
        f"with kvoffload's CPU tier {with_cpu}; loaded bytes verified {rig.bytes_verified}"
    )
    assert gpu_only == 0  # the flood evicted every block of PROMPT from the GPU tier
    assert with_cpu == len(PROMPT) > gpu_only
    assert rig.mismatches == []
    assert rig.blocks_verified == PROMPT_BLOCKS
    assert rig.bytes_verified == PROMPT_BLOCKS * BLOCK_BYTES
    assert rig.kv_worker.bytes_loaded == PROMPT_BLOCKS * BLOCK_BYTES
    assert_no_leaks(rig)
    rig.shutdown()


def test_stock_connector_with_kvoffload_spec(tmp_path: Path) -> None:
    rig = VLLMRig.build(
        tmp_path, extra_config={**STOCK_SPEC, "cpu_bytes_to_use": 1 << 20}, connector=STOCK
    )
    assert type(rig.scheduler.connector).__name__ == "OffloadingConnector"
    assert evict_and_return(rig) == len(PROMPT)
    assert rig.mismatches == [] and rig.bytes_verified == PROMPT_BLOCKS * BLOCK_BYTES
    assert_no_leaks(rig)
    rig.shutdown()


def test_abort_while_load_in_flight_leaks_nothing(tmp_path: Path) -> None:
    # Asynchronous loads (no synchronous budget): the load outlives the step.
    rig = VLLMRig.build(tmp_path, extra_config={"cpu_bytes": "1MiB", "sync_load_budget_bytes": 0})
    rig.add(PROMPT, req_id="first")
    rig.run()
    flood(rig)
    rig.add([*PROMPT, 5, 6], req_id="again")
    output = rig.step()
    assert output.kv_connector_metadata.load_jobs, "the step should have started a load"
    assert rig.scheduler.requests["again"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    rig.scheduler.finish_requests("again", RequestStatus.FINISHED_ABORTED)
    rig.run()
    assert_no_leaks(rig)
    # The aborted request's blocks are still offered to the next one.
    rig.add([*PROMPT, 9], req_id="later")
    rig.run()
    assert rig.first_computed["later"] == len(PROMPT)
    assert rig.mismatches == []
    assert_no_leaks(rig)
    rig.shutdown()


def test_preemption_with_transfers_in_flight_leaks_nothing(tmp_path: Path) -> None:
    rig = VLLMRig.build(tmp_path, num_gpu_blocks=10, extra_config={"cpu_bytes": "1MiB"})
    for i in range(3):
        rig.add([1 + 7 * i + j for j in range(64)], max_tokens=40, req_id=f"long{i}")
    rig.run(max_steps=400)
    assert rig.preempted, "the GPU tier was meant to be too small for all three"
    assert rig.mismatches == []
    finished = {
        o.request_id
        for outs in rig.outputs
        for eco in outs.values()
        for o in eco.outputs
        if o.finished
    }
    assert finished == {"long0", "long1", "long2"}
    assert_no_leaks(rig)
    rig.shutdown()


def _subscribe(endpoint: str) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.SUB)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.connect(endpoint)
    return sock


def _drain(sock: zmq.Socket, decoder: msgspec.msgpack.Decoder, until: float = 2.0) -> list:
    events = []
    while sock.poll(int(until * 1000)):
        _topic, _seq, payload = sock.recv_multipart()
        events.extend(decoder.decode(payload).events)
        until = 0.2
    return events


def test_disk_tier_serves_after_cpu_eviction_with_events_from_vllms_publisher(
    tmp_path: Path,
) -> None:
    port = free_port()
    endpoint = f"tcp://127.0.0.1:{port}"
    extra = {"cpu_bytes": 6 * BLOCK_BYTES, "disk_dir": str(tmp_path / "disk"), "disk_bytes": "1MiB"}
    os.makedirs(extra["disk_dir"])
    # "tcp://*:port" makes vLLM's publisher bind; a host name would make it connect.
    rig = VLLMRig.build(tmp_path, extra_config=extra, kv_events_endpoint=f"tcp://*:{port}")
    sock = _subscribe(endpoint)
    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
    try:
        assert evict_and_return(rig) == len(PROMPT)
        events = _drain(sock, decoder)
    finally:
        sock.close(linger=0)
    promoted = rig.manager.promotions_by_tier  # tier 0: the disk; the CPU tier may keep some
    assert set(promoted) == {0} and 0 < promoted[0] <= PROMPT_BLOCKS
    assert rig.mismatches == [] and rig.bytes_verified == PROMPT_BLOCKS * BLOCK_BYTES
    stored = [e for e in events if isinstance(e, BlockStored)]
    media = {(e.medium, e.locality) for e in stored}
    assert ("GPU", None) in media
    assert ("CPU", None) in media
    assert ("STORAGE", "LOCAL") in media
    for e in stored:
        if e.medium != "GPU":
            assert e.block_size == 0  # sizes come from the GPU tier's events
    assert_no_leaks(rig)
    rig.shutdown()


@pytest.mark.redis
def test_redis_tier_serves_after_cpu_eviction_with_remote_events(
    tmp_path: Path, redis_server
) -> None:
    port = free_port()
    extra = {"cpu_bytes": 6 * BLOCK_BYTES, "redis_url": redis_server.url}
    rig = VLLMRig.build(tmp_path, extra_config=extra, kv_events_endpoint=f"tcp://*:{port}")
    sock = _subscribe(f"tcp://127.0.0.1:{port}")
    try:
        assert evict_and_return(rig) == len(PROMPT)
        events = _drain(sock, msgspec.msgpack.Decoder(type=KVEventBatch))
    finally:
        sock.close(linger=0)
    promoted = rig.manager.promotions_by_tier  # tier 0: Redis; the CPU tier may keep some
    assert set(promoted) == {0} and 0 < promoted[0] <= PROMPT_BLOCKS
    assert rig.mismatches == [] and rig.bytes_verified == PROMPT_BLOCKS * BLOCK_BYTES
    stored = {(e.medium, e.locality) for e in events if isinstance(e, BlockStored)}
    assert ("STORAGE", "REMOTE") in stored
    assert_no_leaks(rig)
    rig.shutdown()


def test_write_through_puts_every_stored_block_on_disk(tmp_path: Path) -> None:
    disk = tmp_path / "disk"
    disk.mkdir()
    extra = {
        "cpu_bytes": "1MiB",
        "disk_dir": str(disk),
        "disk_bytes": "1MiB",
        "write_through": True,
    }
    rig = VLLMRig.build(tmp_path, extra_config=extra)
    rig.add(PROMPT, req_id="first")
    rig.run()
    (disk_tier,) = rig.manager.secondary_tiers
    assert disk_tier.manager.num_stored_blocks() == PROMPT_BLOCKS  # no CPU eviction needed
    assert_no_leaks(rig)
    rig.shutdown()


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_a_corrupt_disk_block_is_a_miss_under_both_failure_policies(
    tmp_path: Path, policy: str
) -> None:
    """A block that fails its checksum fails its promotion in the scheduler process: the
    request recomputes it; no worker job fails, so vLLM's load-failure policy never fires."""
    disk = tmp_path / "disk"
    disk.mkdir()
    extra = {"cpu_bytes": 6 * BLOCK_BYTES, "disk_dir": str(disk), "disk_bytes": "1MiB"}
    rig = VLLMRig.build(tmp_path, extra_config=extra, recompute_failed_loads=policy == "recompute")
    rig.add(PROMPT, req_id="first")
    rig.run()
    flood(rig)
    for slab in disk.rglob("slab-*.bin"):
        slab.write_bytes(os.urandom(slab.stat().st_size))
    rig.add([*PROMPT, 5, 6], req_id="again")
    rig.run()
    assert rig.kv_worker.failed_jobs == 0
    finished = rig.finish_reasons()
    assert "error" not in finished["again"].lower()
    assert rig.mismatches == []
    assert_no_leaks(rig)
    # The unreadable blocks are gone from the disk tier: the same prefix now misses cleanly.
    promoted = dict(rig.manager.promotions_by_tier)
    rig.add([*PROMPT, 9], req_id="later")
    rig.run()
    assert rig.manager.promotions_by_tier == promoted
    assert rig.kv_worker.failed_jobs == 0
    assert_no_leaks(rig)
    rig.shutdown()


def test_reset_prefix_cache_clears_kvoffloads_tiers(tmp_path: Path) -> None:
    extra = {"cpu_bytes": 6 * BLOCK_BYTES, "disk_dir": str(tmp_path / "disk"), "disk_bytes": "1MiB"}
    os.makedirs(extra["disk_dir"])
    rig = VLLMRig.build(tmp_path, extra_config=extra)
    rig.add(PROMPT, req_id="first")
    rig.run()
    flood(rig)
    assert rig.scheduler.reset_prefix_cache(reset_connector=True)
    rig.add([*PROMPT, 5, 6], req_id="again")
    rig.run()
    assert rig.first_computed["again"] == 0
    assert_no_leaks(rig)
    rig.shutdown()


@pytest.mark.parametrize(
    ("extra", "key"),
    [
        ({"cpu_bytes": "1MiB", "cpu_bytez": 1}, "cpu_bytez"),
        ({"cpu_bytes": "lots"}, "cpu_bytes"),
        ({"cpu_bytes": "1MiB", "cache_policy": "mru"}, "cache_policy"),
        ({"cpu_bytes": "1MiB", "disk_dir": "/tmp/x"}, "disk_bytes"),
        ({"cpu_bytes": "1MiB", "write_through": "maybe"}, "write_through"),
        ({"cpu_bytes": "1MiB", "spec_name": "CPUOffloadingSpec"}, "spec_name"),
    ],
)
def test_bad_extra_config_fails_at_start_up_with_one_line(
    tmp_path: Path, extra: dict, key: str
) -> None:
    with pytest.raises(KVOffloadConfigError) as info:
        VLLMRig.build(tmp_path, extra_config=extra)
    message = str(info.value)
    assert "\n" not in message
    assert repr(key) in message


def test_unknown_key_through_the_stock_connector(tmp_path: Path) -> None:
    with pytest.raises(KVOffloadConfigError, match="'cpu_bytez'"):
        VLLMRig.build(tmp_path, extra_config={**STOCK_SPEC, "cpu_bytez": "1MiB"}, connector=STOCK)


def test_a_disk_tier_written_for_another_model_is_not_read(tmp_path: Path) -> None:
    disk = tmp_path / "disk"
    disk.mkdir()
    extra = {"cpu_bytes": "1MiB", "disk_dir": str(disk), "disk_bytes": "1MiB"}
    rig = VLLMRig.build(tmp_path / "model-a", extra_config=extra)
    rig.add(PROMPT, req_id="first")
    rig.run()
    rig.shutdown()
    # Same geometry, another model (its path is its name): its blocks are not ours.
    other = VLLMRig.build(tmp_path / "model-b", extra_config=extra)
    other.add([*PROMPT, 5], req_id="b")
    other.run()
    assert other.first_computed["b"] == 0 and other.manager.promotions_by_tier == {}
    other.shutdown()
    # The same model again reopens its blocks.
    again = VLLMRig.build(tmp_path / "model-a", extra_config=extra)
    again.add([*PROMPT, 5], req_id="a")
    again.run()
    assert again.first_computed["a"] == len(PROMPT)
    assert again.mismatches == [] and again.bytes_verified == PROMPT_BLOCKS * BLOCK_BYTES
    again.shutdown()


def test_frontend_prometheus_metrics_describe_kvoffloads_spec(tmp_path: Path) -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorProm

    from kvoffload.integrations.vllm import KVOffloadSpec
    from tests.integrations.vllm_rig import vllm_config, write_tiny_llama

    config = vllm_config(write_tiny_llama(tmp_path / "m"), 12, {"cpu_bytes": "1MiB"})
    prom = KVConnectorProm(config, ["model_name", "engine"], {0: ["tiny", "0"]})
    assert prom.prom_metrics is not None
    assert prom.prom_metrics._spec_cls is KVOffloadSpec  # what vLLM reads


def test_stock_connector_recomputes_a_corrupt_disk_block(tmp_path: Path) -> None:
    """vLLM's stock connector asserts on every failed worker job; with lower tiers a bad
    block fails its promotion in the scheduler process instead, so it is a plain miss."""
    disk = tmp_path / "disk"
    disk.mkdir()
    extra = {
        **STOCK_SPEC,
        "cpu_bytes": 6 * BLOCK_BYTES,
        "disk_dir": str(disk),
        "disk_bytes": "1MiB",
    }
    rig = VLLMRig.build(tmp_path, extra_config=extra, connector=STOCK)
    rig.add(PROMPT, req_id="first")
    rig.run()
    flood(rig)
    for slab in disk.rglob("slab-*.bin"):
        slab.write_bytes(os.urandom(slab.stat().st_size))
    rig.add([*PROMPT, 5, 6], req_id="again")
    rig.run()
    assert rig.kv_worker.failed_jobs == 0 and rig.mismatches == []
    assert_no_leaks(rig)
    rig.shutdown()
