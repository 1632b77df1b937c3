"""The engine's published events index every tier exactly (issue 33 items 1-2).

Concurrent requests with the same prompt compute the same blocks (several
GPU copies); small GPU and CPU tiers and a disk tier make them evict. A
consumer that keeps one entry per (medium, hash), as a router does, must
hold exactly what each tier holds, step after step; offloaded stores carry
the same tokens and parents as the GPU tier's stores of the same hashes.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvoffload.engine import EngineConfig, LLMEngine, SamplingParams
from kvoffload.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from kvoffload.events.journal import JOURNAL_NAME
from kvoffload.offload.base import make_offload_key
from tests.events.published import record_published

BS = 4
# Three conversations, each prompt sent twice at once (two GPU copies of every block).
PROMPTS = [[(11 * i + 37 * c) % 400 + 1 for i in range(6 * BS + 1)] for c in range(3)]


def _engine(tmp_path: Path | None, **kw: object) -> tuple[LLMEngine, list[KVEvent]]:
    engine = LLMEngine(
        EngineConfig(
            block_size=BS,
            num_gpu_blocks=24,
            max_num_seqs=4,
            max_num_batched_tokens=64,
            num_cpu_blocks=10,
            disk_dir=None if tmp_path is None else str(tmp_path / "disk"),
            num_disk_blocks=16,
            events_endpoint="tcp://127.0.0.1:*",
            **kw,  # type: ignore[arg-type]
        )
    )
    published = record_published(engine)
    return engine, published


class Router:
    """One entry per (medium, hash); refuses a double store or a removal of nothing."""

    def __init__(self) -> None:
        self.held: dict[str, set[object]] = {}
        self.gpu_payload: dict[object, tuple[object, tuple[int, ...]]] = {}
        self.described: dict[str, int] = {}  # medium -> hashes stored with their tokens
        self.described_hashes: dict[str, set[object]] = {}

    def apply(self, events: list[KVEvent]) -> None:
        for ev in events:
            if isinstance(ev, AllBlocksCleared):
                self.held.pop("GPU", None)
                continue
            assert isinstance(ev, BlockStored | BlockRemoved)
            held = self.held.setdefault(str(ev.medium), set())
            if isinstance(ev, BlockRemoved):
                for h in ev.block_hashes:
                    assert h in held, f"{ev.medium}: removal of a hash not held"
                    held.discard(h)
                continue
            for h in ev.block_hashes:
                assert h not in held, f"{ev.medium}: second store of a held hash"
                held.add(h)
            self._check_payload(ev)

    def _check_payload(self, ev: BlockStored) -> None:
        assert (ev.group_idx or 0) == 0  # GPU events leave it to the wire (0)
        if ev.block_size == 0:  # placeholder: one hash, nothing else
            assert ev.token_ids == [] and ev.parent_block_hash is None
            return
        medium = str(ev.medium)
        self.described[medium] = self.described.get(medium, 0) + len(ev.block_hashes)
        self.described_hashes.setdefault(medium, set()).update(ev.block_hashes)
        assert len(ev.token_ids) == ev.block_size * len(ev.block_hashes)
        parent = ev.parent_block_hash
        for i, h in enumerate(ev.block_hashes):
            tokens = tuple(ev.token_ids[i * ev.block_size : (i + 1) * ev.block_size])
            if ev.medium == "GPU":
                self.gpu_payload[h] = (parent, tokens)
            else:
                # Known from a GPU store, or first seen here (a restarted disk tier's).
                known = self.gpu_payload.setdefault(h, (parent, tokens))
                assert known == (parent, tokens), "offloaded payload differs"
                assert ev.kv_cache_spec_kind == "full_attention"
            parent = h


def _run(engine: LLMEngine, published: list[KVEvent], router: Router) -> None:
    for c, prompt in enumerate(PROMPTS):
        for copy in range(2):
            engine.add_request(prompt, SamplingParams(max_tokens=3), req_id=f"{c}-{copy}")
    cpu = engine.offload.manager if engine.offload else None  # type: ignore[union-attr]
    cpu = getattr(cpu, "cpu", cpu)
    while engine.has_unfinished_requests():
        engine.step()
        router.apply(published)
        published.clear()
        gpu = {b.block_hash for b in engine.pool.blocks if b.block_hash is not None}
        assert router.held.get("GPU", set()) == gpu
        if cpu is not None:
            announced = router.held.get("CPU", set())
            assert all(cpu.is_stored(make_offload_key(h)) for h in announced)  # type: ignore[arg-type]
            known = set(router.gpu_payload)
            assert {h for h in known if cpu.is_stored(make_offload_key(h))} == announced  # type: ignore[arg-type]


@pytest.mark.parametrize("disk", [False, True])
def test_router_index_equals_every_tier(tmp_path: Path, disk: bool) -> None:
    engine, published = _engine(tmp_path if disk else None)
    router = Router()
    try:
        _run(engine, published, router)
        engine.drain()
        engine.step()
        router.apply(published)
    finally:
        engine.close()
    assert router.held.get("CPU"), "the CPU tier announced nothing"
    assert router.described.get("CPU"), "no self-describing CPU store"
    if disk:
        assert router.held.get("DISK"), "the disk tier announced nothing"
        assert router.described.get("DISK"), "no self-describing disk store"


def test_duplicates_break_a_set_router_in_per_copy_mode() -> None:
    # vLLM's stream: a set-keeping router either sees a second store or loses a
    # block that one copy still holds. The named option keeps it for consumers
    # that count copies.
    engine, published = _engine(None, events_mode="per-copy")
    with pytest.raises(AssertionError):  # a second store, a lost block, or a stale index
        try:
            _run(engine, published, Router())
        finally:
            engine.close()


def test_not_self_describing_sends_placeholders() -> None:
    engine, published = _engine(None, events_self_describing=False)
    router = Router()
    events: list[KVEvent] = []
    try:
        engine.generate(PROMPTS, SamplingParams(max_tokens=2))
        engine.drain()
        engine.step()
        events = list(published)
    finally:
        engine.close()
    cpu = [e for e in events if isinstance(e, BlockStored) and e.medium == "CPU"]
    assert cpu and all(e.block_size == 0 and not e.token_ids for e in cpu)
    router.apply(events)


@pytest.mark.parametrize(
    ("argv", "mode", "described"),
    [
        ([], "exact", True),
        (["--events-mode", "per-copy"], "per-copy", True),
        (["--no-events-self-describing"], "exact", False),
    ],
)
def test_run_flags_reach_the_engine_config(argv: list[str], mode: str, described: bool) -> None:
    import argparse

    from kvoffload.cli.engine_args import add_engine_arguments, engine_config_from_args

    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    config = engine_config_from_args(parser.parse_args(argv))
    assert config.events_mode == mode
    assert config.events_self_describing is described


def test_unknown_events_mode_is_one_line() -> None:
    with pytest.raises(ValueError, match=r"EngineConfig\.events_mode: unknown KV events mode"):
        EngineConfig(events_mode="copies")


def _first_run(tmp_path: Path) -> None:
    # One prompt at a time, its stores settled before the next: the CPU tier can
    # then always evict the earlier prompt's blocks to the disk. (All at once, a
    # CPU tier whose every block is still a store in flight has no room for the
    # last prompt's blocks, so whether anything reached the disk hung on the copy
    # threads' timing: 1 run in 20 wrote nothing.)
    first, _ = _engine(tmp_path)
    try:
        for prompt in PROMPTS:
            first.generate([prompt], SamplingParams(max_tokens=2))
            first.drain()
        first.step()  # publish the last steps' events (and keep their payloads)
    finally:
        first.close()


def _restart(tmp_path: Path) -> tuple[LLMEngine, list[KVEvent], Router]:
    """The engine again on the same disk, one step taken, its first batch applied to a router.

    That batch must open with ``AllBlocksCleared`` (a consumer drops the earlier
    incarnation's entries first). The caller closes the engine.
    """
    engine, published = _engine(tmp_path)
    router = Router()
    try:
        engine.step()
        assert isinstance(published[0], AllBlocksCleared)
        router.apply(published)
    except BaseException:
        engine.close()
        raise
    return engine, published, router


def test_restart_on_the_same_disk_announces_its_blocks_with_their_tokens(
    tmp_path: Path,
) -> None:
    # The disk tier's payloads are kept next to it: the restarted engine's first
    # batch clears the earlier incarnation, then announces the disk's blocks described.
    _first_run(tmp_path)
    assert (tmp_path / "disk" / JOURNAL_NAME).exists()
    engine, _, router = _restart(tmp_path)
    engine.close()
    on_disk = router.held.get("DISK", set())
    assert on_disk, "the restarted disk tier announced nothing"
    assert router.described_hashes.get("DISK", set()) == on_disk


def test_restart_without_kept_payloads_describes_blocks_once_seen_again(
    tmp_path: Path,
) -> None:
    # Without the journal the disk's blocks are announced as placeholders; serving
    # the prompts again shows their tokens on the GPU, and the disk tier
    # re-announces them described. The set stays exact throughout.
    _first_run(tmp_path)
    (tmp_path / "disk" / JOURNAL_NAME).unlink()
    engine, published, router = _restart(tmp_path)
    try:
        published.clear()
        on_disk = set(router.held.get("DISK", set()))
        assert on_disk, "the restarted disk tier announced nothing"
        assert not router.described.get("DISK")
        _run(engine, published, router)
    finally:
        engine.close()
    again = on_disk & router.described_hashes.get("DISK", set())
    assert again, "no block of the earlier run re-announced with its tokens"
