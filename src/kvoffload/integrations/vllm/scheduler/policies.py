"""kvoffload's cache policies as vLLM 0.33 ``CachePolicy`` classes, for vLLM's own CPU tier.

vLLM's ``CPUOffloadingManager`` (and the CPU tier of its ``TieringOffloadingSpec``)
loads its policy by class name: ``"eviction_policy": "KVOffloadQueueArmsPolicy",
"cache_policy_module_path": "kvoffload.integrations.vllm"``. Every policy of
kvoffload's menu (``policy_names``) has a class here, named ``KVOffload<Name>Policy``
(``policy_class_name``): ``lru`` -> ``KVOffloadLRUPolicy``, ``chain_arms`` ->
``KVOffloadChainArmsPolicy``, ...; ``KVOffloadPolicy`` is kvoffload's default.

The two interfaces cut the work differently. vLLM's policy owns the chunk
table (``get``/``insert``/``remove``, stores in flight included) and hears
about pins one key at a time (``mark_evictable``/``mark_non_evictable``);
kvoffload's policy orders only stored keys and takes one call per manager
operation, in chain order. ``KVOffloadVLLMPolicy`` keeps the table and turns
vLLM's calls into the calls kvoffload's own ``CPUOffloadingManager`` makes,
in the same order, so that a replay gives the same hits either way:

- per-key pins, unpins and store completions are gathered into one
  ``pin``/``unpin``/``insert`` call (the run of same-kind calls one vLLM
  manager operation makes), applied before the next call that differs;
- a store: ``on_store_miss`` names the incoming keys; ``evict(n, protected)``
  pins the stored keys of the store around the inner ``evict(n, incoming)``
  as kvoffload's manager does, and a store that needs no room still gives the
  inner policy its ``evict(0, incoming)`` (ghost lists adapt there); the
  store's ``on_request_access`` of keys already stored becomes an ``access``
  after the eviction (kvoffload's ``touch`` of them);
- a load's ``on_request_access`` becomes ``access`` (after its pins);
- chain hints (``hint_parent``, for the chain-aware policies): the first
  block a store brings after the request's loaded hits, and each new block
  right after an already stored one;
- ``touch`` is ``access``; ``on_request_finished`` adds nothing (kvoffload
  applies recency when blocks are read or offered, not at a request's end).

vLLM's own managers send no queue or session hints: under them the
queue-aware policies act as their inner policy does without hints. Under
``KVOffloadSpec`` with lower tiers (vLLM's tiering manager over one of these
classes), ``KVOffloadConnector`` sends them to this policy (``hint_queued``,
``hint_dequeued``, ``hint_continues``). Every call costs what the inner
policy's does plus O(keys of the call).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, ClassVar

from vllm.v1.kv_offload.base import OffloadKey, ReqContext
from vllm.v1.kv_offload.cpu.policies.base import CachePolicy as VLLMCachePolicy
from vllm.v1.kv_offload.cpu.policies.base import ChunkStatus

from kvoffload.offload.cpu_manager import DEFAULT_CACHE_POLICY
from kvoffload.offload.policies.base import CachePolicy
from kvoffload.offload.policies.registry import POLICIES, make_policy

_ACRONYMS = {"lru": "LRU", "arc": "ARC"}

# Kinds of deferred operations on the inner policy.
_PIN, _UNPIN, _INSERT, _ACCESS, _HINT = "pin", "unpin", "insert", "access", "hint"


def policy_class_name(policy: str) -> str:
    """The vLLM class name of a kvoffload policy: ``chain_arms`` -> ``KVOffloadChainArmsPolicy``."""
    parts = (_ACRONYMS.get(p, p.capitalize()) for p in policy.split("_"))
    return "KVOffload" + "".join(parts) + "Policy"


#: The policies built inside ``policies_built()`` on this thread (None outside it).
_BUILT: ContextVar[list[KVOffloadVLLMPolicy] | None] = ContextVar(
    "kvoffload_policies_built", default=None
)


@contextmanager
def policies_built() -> Iterator[list[KVOffloadVLLMPolicy]]:
    """The ``KVOffloadVLLMPolicy`` objects constructed in this block, on this thread.

    vLLM builds its CPU tier's policy from a class name and keeps the object
    private; a caller that builds the tier inside this block learns which
    object it is from kvoffload's own record instead.
    """
    built: list[KVOffloadVLLMPolicy] = []
    token = _BUILT.set(built)
    try:
        yield built
    finally:
        _BUILT.reset(token)


@dataclass
class _RequestChain:
    """Per request: the last block it loaded from this tier (its chain continues after it)."""

    owner: object
    last_loaded: OffloadKey | None = None


class KVOffloadVLLMPolicy(VLLMCachePolicy):
    """vLLM's ``CachePolicy`` over the kvoffload policy named by ``policy`` (see the module doc).

    Invariants: ``_chunks`` holds every key vLLM's manager has inserted and not
    evicted or removed (stores in flight with ``ref_cnt == -1``); the inner
    policy's resident keys are the keys of ``_chunks`` whose store completed,
    once the deferred operations are applied; its pinned keys are those with
    ``ref_cnt > 0``.
    """

    policy: ClassVar[str] = DEFAULT_CACHE_POLICY

    def __init__(self, cache_capacity: int) -> None:
        super().__init__(cache_capacity)
        self.inner: CachePolicy = make_policy(self.policy, cache_capacity)
        built = _BUILT.get()
        if built is not None:
            built.append(self)
        self._chain_hints = type(self.inner).hint_parent is not CachePolicy.hint_parent
        self._chunks: dict[OffloadKey, ChunkStatus] = {}
        self._resident: set[OffloadKey] = set()  # in the inner policy (once applied)
        self._pinned: set[OffloadKey] = set()
        self._pending: list[tuple[str, list[Any]]] = []
        # The store being prepared: its incoming keys, whether it evicted, and
        # whether its stored chunks are being inserted (ends at the next other call).
        self._incoming: list[OffloadKey] | None = None
        self._store_keys: list[OffloadKey] | None = None
        self._store_access = False  # the last deferred operation is this store's access
        self._evicted = False
        self._inserting = False
        self._queued: dict[str, list[OffloadKey]] = {}  # queue hints, re-announced after clear

    # -- deferred operations -------------------------------------------------------

    def _defer(self, kind: str, key: Any) -> None:
        pending = self._pending
        if pending and pending[-1][0] == kind and kind != _HINT:
            pending[-1][1].append(key)
        else:
            pending.append((kind, [key]))

    def _apply(self, upto: int | None = None) -> None:
        """Apply the deferred operations (the first ``upto`` of them; all by default)."""
        pending = self._pending
        todo = pending if upto is None else pending[:upto]
        inner = self.inner
        for kind, keys in todo:
            if kind == _PIN:
                inner.pin(keys)
            elif kind == _UNPIN:
                inner.unpin(keys)
            elif kind == _INSERT:
                inner.insert(keys)
            elif kind == _ACCESS:
                inner.access(keys)
            else:
                child, parent = keys[0]
                inner.hint_parent(child, parent)
        del pending[: len(todo)]

    def _apply_before_store_access(self) -> None:
        """Apply all but the trailing ``access`` the store being prepared made."""
        if self._store_access:
            self._apply(len(self._pending) - 1)
        else:
            self._apply()

    def _end_store(self) -> None:
        """The store being prepared (if any) is over: the next call is not part of it."""
        if self._store_access and self._incoming and not (self._evicted or self._inserting):
            # vLLM's manager refused the store before asking for victims; kvoffload's
            # manager refuses before the offered keys would be touched.
            self._pending.pop()
        self._incoming = None
        self._store_keys = None
        self._store_access = False
        self._evicted = False
        self._inserting = False

    # -- vLLM's CachePolicy --------------------------------------------------------

    def get(self, key: OffloadKey) -> ChunkStatus | None:
        return self._chunks.get(key)

    def on_store_miss(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> None:
        self._end_store()
        self._incoming = list(keys)

    def on_request_access(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> None:
        keys = list(keys)
        chunks = self._chunks
        if keys and all((c := chunks.get(k)) is not None and c.ref_cnt > 0 for k in keys):
            # A load: every key was just pinned.
            if self._inserting:
                self._end_store()
            self._access(keys)
            state = req_context.get_state(_RequestChain)
            if state is None or state.owner is not self:
                state = _RequestChain(self)
                req_context.set_state(state)
            state.last_loaded = keys[-1]
            return
        # A store's offer: the keys it brings and those already stored, in chain order.
        if self._inserting:
            self._end_store()
        self._store_keys = keys
        if self._chain_hints:
            self._hint_store_chain(keys, req_context)
        stored = [k for k in keys if k in self._resident]
        if stored:
            self._pending.append((_ACCESS, stored))
            self._store_access = True

    def _access(self, keys: list[OffloadKey]) -> None:
        if keys:
            self._pending.append((_ACCESS, keys))

    def _hint_store_chain(self, keys: list[OffloadKey], req_context: ReqContext) -> None:
        resident = self._resident
        state = req_context.get_state(_RequestChain)
        if state is not None and state.owner is self and state.last_loaded is not None:
            # kvoffload's lookup hint: the first block missing after the hits.
            if keys and keys[0] not in self._chunks:
                self._defer(_HINT, (keys[0], state.last_loaded))
            state.last_loaded = None
        prev: OffloadKey | None = None
        for key in keys:
            if prev is not None and key not in self._chunks:
                self._defer(_HINT, (key, prev))
            prev = key if key in resident else None

    def touch(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> None:
        self._end_store()
        self._access([k for k in keys if k in self._resident])

    def on_request_finished(
        self,
        key_groups: Sequence[Sequence[OffloadKey]],
        insertion_only_keys: set[OffloadKey],
        reused_keys: set[OffloadKey],
        req_context: ReqContext,
    ) -> None:
        self._end_store()
        self._apply()

    def evict(
        self, n: int, protected: set[OffloadKey]
    ) -> list[tuple[OffloadKey, ChunkStatus]] | None:
        self._apply_before_store_access()
        inner = self.inner
        resident, pinned = self._resident, self._pinned
        order = self._store_keys or []
        protect = [k for k in order if k in protected and k in resident and k not in pinned]
        if len(protect) < sum(1 for k in protected if k in resident and k not in pinned):
            seen = set(protect)
            protect += [k for k in protected if k in resident and k not in pinned and k not in seen]
        if n > inner.num_evictable() - len(protect):
            # Refused: nothing changes (``_end_store`` drops the store's offer).
            self._end_store()
            return None
        incoming = self._incoming
        if incoming is None:
            incoming = [k for k in order if k not in self._chunks] or list(
                k for k in protected if k not in self._chunks
            )
        if protect:
            inner.pin(protect)
        victims = inner.evict(n, incoming)
        if protect:
            inner.unpin(protect)
        self._evicted = True
        out = []
        for key in victims:
            resident.discard(key)
            out.append((key, self._chunks.pop(key)))
        return out

    def insert(
        self, key: OffloadKey, chunk: ChunkStatus, req_context: ReqContext | None = None
    ) -> None:
        # vLLM 0.32 calls insert(key, chunk): see compat.POLICY_INSERT_TAKES_CONTEXT.
        if not self._inserting:
            if not self._evicted:
                self._apply_before_store_access()
                self.inner.evict(0, self._incoming if self._incoming is not None else [key])
            self._inserting = True
        self._chunks[key] = chunk
        if chunk.ref_cnt >= 0:  # inserted ready (not a store in flight)
            self._ready(key)

    def _ready(self, key: OffloadKey) -> None:
        self._resident.add(key)
        self._defer(_INSERT, key)
        if self._chunks[key].ref_cnt > 0:
            self._pinned.add(key)
            self._defer(_PIN, key)

    def remove(self, key: OffloadKey) -> None:
        # vLLM's managers remove only chunks whose store failed (never stored,
        # so unknown to the inner policy, which has no way to forget a key).
        if key in self._resident:
            raise RuntimeError(f"cannot remove stored chunk {key.hex()}: only a failed store's")
        self._end_store()
        del self._chunks[key]

    def mark_non_evictable(self, key: OffloadKey) -> None:
        self._end_store()
        self._pinned.add(key)
        self._defer(_PIN, key)

    def mark_evictable(self, key: OffloadKey) -> None:
        self._end_store()
        if key in self._resident:
            self._pinned.discard(key)
            self._defer(_UNPIN, key)
        else:
            self._ready(key)

    def clear(self) -> None:
        self.inner.clear()
        self._chunks.clear()
        self._resident.clear()
        self._pinned.clear()
        self._pending.clear()
        self._end_store()
        # The requests still wait: the new policy hears of them again.
        for request_id, keys in self._queued.items():
            self.inner.hint_queued(request_id, keys)

    # -- queue and session hints ------------------------------------------------------
    # vLLM's managers never call these; kvoffload's connector does (under vLLM's
    # tiering manager, for its CPU tier). Pending operations are applied first,
    # so the inner policy sees the hint after everything that came before it.

    def _uses(self, hint: str) -> bool:
        """Whether the inner policy acts on ``hint``; if not, the hint must change nothing here
        either (applying the deferred operations early would split their batches)."""
        return getattr(type(self.inner), hint) is not getattr(CachePolicy, hint)

    def hint_queued(self, request_id: str, keys: Sequence[OffloadKey]) -> None:
        if not self._uses("hint_queued"):
            return
        self._end_store()
        self._apply()
        keys = list(keys)
        self._queued[request_id] = keys
        self.inner.hint_queued(request_id, keys)

    def hint_dequeued(self, request_id: str) -> None:
        if self._queued.pop(request_id, None) is None:
            return
        self._end_store()
        self._apply()
        self.inner.hint_dequeued(request_id)

    def hint_continues(self, keys: Sequence[OffloadKey]) -> None:
        if not self._uses("hint_continues"):
            return
        self._end_store()
        self._apply()
        self.inner.hint_continues(list(keys))


def _make_class(policy: str) -> type[KVOffloadVLLMPolicy]:
    name = policy_class_name(policy)
    doc = f"kvoffload's ``{policy}`` policy as a vLLM ``CachePolicy`` (eviction_policy {name})."
    return type(
        name, (KVOffloadVLLMPolicy,), {"policy": policy, "__doc__": doc, "__module__": __name__}
    )


#: Class name -> class, one per kvoffload policy registered when this module was imported.
POLICY_CLASSES: dict[str, type[KVOffloadVLLMPolicy]] = {
    policy_class_name(p): _make_class(p) for p in sorted(POLICIES)
}
globals().update(POLICY_CLASSES)


class KVOffloadPolicy(KVOffloadVLLMPolicy):
    """kvoffload's default policy (``DEFAULT_CACHE_POLICY``) as a vLLM ``CachePolicy``."""

    policy = DEFAULT_CACHE_POLICY


def __getattr__(name: str) -> type[KVOffloadVLLMPolicy]:
    # A policy registered after this module was imported still gets its class.
    for policy in POLICIES:
        if policy_class_name(policy) == name:
            cls = POLICY_CLASSES[name] = _make_class(policy)
            globals()[name] = cls
            return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
