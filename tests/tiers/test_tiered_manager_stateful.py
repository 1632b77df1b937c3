"""The tiered manager under random loads, stores, faults and out-of-order completions.

A toy worker (``tier_world.World``) executes every spec on dicts. Jobs stay
in flight and complete in any order, copies fail on demand, disk blocks rot,
the remote server evicts and goes down. Whatever happens, a load that
reports success must deliver each key's own bytes, and once every job has
settled nothing may stay pinned.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvoffload.offload import CPUOffloadingManager, GPULoadStoreSpec, LoadStoreSpec, OffloadKey
from kvoffload.offload.policies import (
    AdmitARCPolicy,
    AdmitLRUPolicy,
    ChainLRUPolicy,
)
from kvoffload.tiers.disk.manager import DiskOffloadingManager
from kvoffload.tiers.lower_tier import LowerTierManager
from kvoffload.tiers.redis.manager import RemoteOffloadingManager
from kvoffload.tiers.tiered_manager import TieredOffloadingManager
from tests.offload.keyutil import key
from tests.tiers.tier_world import GARBAGE, World

CHAINS = 3
CHAIN_LEN = 4
PAIRS = [
    ("GPU", "CPU"),
    ("CPU", "GPU"),
    ("CPU", "DISK"),
    ("DISK", "CPU"),
    ("CPU", "REMOTE"),
    ("REMOTE", "CPU"),
    ("DISK", "REMOTE"),
]


def chain(c: int, n: int, repeat: int | None = None) -> list[OffloadKey]:
    """``n`` keys of chain ``c``; ``repeat``: that key named a second time, right after itself."""
    keys = [key(c * 100 + j) for j in range(n)]
    if repeat is not None:
        j = repeat % n
        keys.insert(j, keys[j])
    return keys


#: Sometimes a key twice in one call (a policy once raised KeyError on touch([k, k])).
repeats = st.one_of(st.none(), st.integers(0, CHAIN_LEN - 1))


@dataclass
class Job:
    keys: list[OffloadKey]
    src: LoadStoreSpec
    dst: LoadStoreSpec
    is_store: bool
    given: list[OffloadKey] | None = None  # a store's keys as given to prepare_store


class TieredMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.world = World()
        self.m: TieredOffloadingManager
        self.jobs: list[Job] = []
        self.in_flight_store_keys: set[OffloadKey] = set()
        self.gpu_ids = itertools.count()
        self.loads_ok = 0

    @initialize(
        tiers=st.sampled_from(["disk", "remote", "disk+remote"]),
        mode=st.sampled_from(["write_back", "write_through"]),
        cpu_blocks=st.integers(1, 4),
        disk_blocks=st.integers(1, 5),
        policy=st.sampled_from(["lru", ChainLRUPolicy, "arc", AdmitLRUPolicy, AdmitARCPolicy]),
    )
    def start(self, tiers: str, mode: str, cpu_blocks: int, disk_blocks: int, policy: str) -> None:
        lower: list[LowerTierManager] = []
        if "disk" in tiers:
            lower.append(DiskOffloadingManager(disk_blocks, enable_events=True))
        if "remote" in tiers:
            w = self.world
            lower.append(RemoteOffloadingManager(w.exists, w.available, enable_events=True))
        cpu = CPUOffloadingManager(cpu_blocks, policy, enable_events=True)
        self.m = TieredOffloadingManager(cpu, lower, write_mode=mode)

    def gpu_spec(self, n: int) -> GPULoadStoreSpec:
        return GPULoadStoreSpec([next(self.gpu_ids) for _ in range(n)])

    # -- the connector's moves ------------------------------------------------

    @rule(c=st.integers(0, CHAINS - 1), n=st.integers(1, CHAIN_LEN), repeat=repeats)
    def store(self, c: int, n: int, repeat: int | None = None) -> None:
        keys = [k for k in chain(c, n, repeat) if k not in self.in_flight_store_keys]
        if not keys:
            return
        out = self.m.prepare_store(keys)
        if out is None or not out.keys_to_store:
            return
        src = self.gpu_spec(len(out.keys_to_store))
        for b, k in zip(src.block_ids.tolist(), out.keys_to_store):
            self.world.gpu[b] = bytes(k)  # the KV the GPU computed for k
        self.jobs.append(Job(list(out.keys_to_store), src, out.store_spec, True, keys))
        self.in_flight_store_keys.update(out.keys_to_store)

    @rule(c=st.integers(0, CHAINS - 1), n=st.integers(1, CHAIN_LEN))
    def load(self, c: int, n: int) -> None:
        keys = chain(c, n)  # distinct: the tiered manager refuses a load naming a key twice
        hit = self.m.lookup(keys)
        if hit == 0:
            return
        spec = self.m.prepare_load(keys[:hit])
        self.jobs.append(Job(keys[:hit], spec, self.gpu_spec(hit), False))

    @rule(c=st.integers(0, CHAINS - 1), n=st.integers(1, CHAIN_LEN), repeat=repeats)
    def touch(self, c: int, n: int, repeat: int | None = None) -> None:
        self.m.touch(chain(c, n, repeat))

    @rule(data=st.data())
    def touch_cpu_blocks_twice(self, data: st.DataObject) -> None:
        """A touch naming blocks the CPU tier holds, each twice."""
        cpu = self.m.cpu
        held = [k for c in range(CHAINS) for k in chain(c, CHAIN_LEN) if cpu.is_stored(k)]
        if held:
            some = st.lists(st.sampled_from(held), min_size=1, max_size=3)
            self.m.touch(data.draw(some.flatmap(lambda ks: st.permutations(ks * 2))))

    @precondition(lambda self: self.jobs)
    @rule(
        i=st.integers(0, 1000),
        fail=st.one_of(st.none(), st.sampled_from(PAIRS)),
        report=st.sampled_from([True, True, True, None]),
        as_given=st.booleans(),
    )
    def finish(
        self, i: int, fail: tuple[str, str] | None, report: bool | None, as_given: bool = False
    ) -> None:
        job = self.jobs.pop(i % len(self.jobs))
        self.world.fail_next = [fail] if fail else []
        ok = self.world.run(job.src, job.dst)
        self.world.fail_next = []
        if job.is_store:
            # The very keys given to prepare_store are accepted too (vLLM 0.33).
            assert job.given is not None
            self.m.complete_store(job.given if as_given else job.keys, success=ok)
            self.in_flight_store_keys.difference_update(job.keys)
            return
        if ok:
            got = self.world.read(job.dst)
            assert got == [bytes(k) for k in job.keys], "a successful load delivered wrong KV"
            self.loads_ok += 1
        # ``report=None``: an engine that does not pass the outcome.
        self.m.complete_load(job.keys, success=ok if report else None)

    @rule(force=st.booleans())
    def reset_cache(self, force: bool) -> None:
        """Refused while anything is in flight; forced, it also drops every job."""
        idle = not self.jobs
        ok = self.m.reset_cache(force=force)
        assert ok == (force or idle)
        if not ok:
            return
        all_keys = [k for c in range(CHAINS) for k in chain(c, CHAIN_LEN)]
        for k in all_keys:
            assert not self.m.cpu.is_stored(k) and not self.m.cpu.is_storing(k)
            for t in self.m.lower:
                if t.answers_locally:
                    assert not t.is_stored(k)
        assert self.m.num_in_flight() == 0
        # A forced reset: the caller never completes jobs prepared before it,
        # and their bytes never land (vLLM's scheduler fences them).
        self.jobs.clear()
        self.in_flight_store_keys.clear()

    # -- faults -----------------------------------------------------------------

    @rule(slot=st.integers(0, 5))
    def rot_disk_block(self, slot: int) -> None:
        entry = self.world.disk.get(slot)
        if entry is not None:
            self.world.disk[slot] = (entry[0], GARBAGE)

    @rule(i=st.integers(0, 1000))
    def server_evicts(self, i: int) -> None:
        if self.world.remote:
            k = sorted(self.world.remote)[i % len(self.world.remote)]
            del self.world.remote[k]

    @rule()
    def server_down_or_up(self) -> None:
        self.world.remote_up = not self.world.remote_up

    # -- checks -----------------------------------------------------------------

    @invariant()
    def cpu_within_capacity(self) -> None:
        cpu = self.m.cpu
        assert 0 <= cpu.num_free_blocks() <= cpu.num_blocks
        assert cpu.num_stored_blocks() + cpu.num_free_blocks() <= cpu.num_blocks

    @invariant()
    def events_name_their_tier(self) -> None:
        for ev in self.m.take_events():
            assert ev.medium in ("CPU", "DISK", "REMOTE")

    def teardown(self) -> None:
        if not hasattr(self, "m"):
            return
        while self.jobs:
            self.finish(0, None, True)
        assert self.m.num_in_flight() == 0
        all_keys = [k for c in range(CHAINS) for k in chain(c, CHAIN_LEN)]
        for k in all_keys:
            assert self.m.cpu.ref_count(k) == 0
            assert not self.m.cpu.is_storing(k)
            for t in self.m.lower:
                assert t.ref_count(k) == 0  # type: ignore[attr-defined]
        # Whatever a tier offers now loads correctly.
        for c in range(CHAINS):
            self.load(c, CHAIN_LEN)
        while self.jobs:
            self.finish(0, None, True)


TieredMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=60, deadline=None)
TestTieredMachine = TieredMachine.TestCase


def random_walk(seed: int, tiers: str, mode: str, steps: int = 400) -> TieredMachine:
    """The same machine driven by a seeded RNG: long runs, many promotions and faults."""
    import random

    rng = random.Random(seed)
    m = TieredMachine()
    m.start(tiers, mode, rng.randint(1, 4), rng.randint(1, 5), rng.choice(["lru", ChainLRUPolicy]))
    for _ in range(steps):
        r = rng.random()
        c, n = rng.randrange(CHAINS), rng.randint(1, CHAIN_LEN)
        if r < 0.25:
            m.store(c, n)
        elif r < 0.5:
            m.load(c, n)
        elif r < 0.85 and m.jobs:
            fail = rng.choice(PAIRS) if rng.random() < 0.15 else None
            m.finish(rng.randrange(1000), fail, rng.random() < 0.9 or None)
        elif r < 0.9:
            m.touch(c, n)
        elif r < 0.95:
            m.rot_disk_block(rng.randrange(6))
        elif r < 0.98:
            m.server_evicts(rng.randrange(1000))
        else:
            m.server_down_or_up()
        m.cpu_within_capacity()
        m.events_name_their_tier()
    m.teardown()
    return m


def test_long_random_walks() -> None:
    promoted = 0
    for seed in range(12):
        for tiers in ("disk", "remote", "disk+remote"):
            for mode in ("write_back", "write_through"):
                promoted += random_walk(seed, tiers, mode).m.stats.promotions
    assert promoted > 100  # the walks do exercise promotions
