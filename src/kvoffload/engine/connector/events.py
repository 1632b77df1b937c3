"""Secondary-tier ``OffloadingEvent``s as router-facing KV events.

:class:`OffloadEventDescriber` is the connector's translator. It follows the
rule of ``kvoffload.events``: per tier (medium) and per KV cache group, the
stream it emits is the *set* of offloaded blocks held. A store of a key the
tier already holds, or a removal of a key it does not, is not announced
again, whatever a manager reports.

Self-describing stores (``self_describing=True``, vLLM 0.33's
``self_describing_kv_events``): a store carries the offloaded block's GPU
block hashes (``block_size_factor`` of them, chained), its parent hash,
tokens, GPU ``block_size``, LoRA and extra keys, and the group's
``kv_cache_spec_kind`` / ``kv_cache_spec_sliding_window``; its removal fans
out to the same hashes. The payload is learnt from the GPU tier's exact
event stream (``observe``, a ``BlockPool`` event listener) while the GPU
holds the blocks, snapshotted per key when a tier first holds it and kept
while any tier holds it (then in a bounded "recently left" map, because a
write-back store to disk may be announced after the CPU dropped the key).
With a ``journal`` (``kvoffload.events.journal``, next to a disk tier), the
disk tier's payloads survive a restart: the restarted engine announces the
disk's blocks described at once. A key whose payload is still unknown is
announced as vLLM's placeholder: its one hash, ``block_size=0``, no tokens;
once the GPU tier holds its blocks again (a hit loads them), every tier
holding it re-announces it described: a removal of the placeholder's hash,
then the self-describing store (a set of hashes stays exact throughout).

Without self-description, stores carry ``block_size=0`` and no tokens (a
router takes them from the GPU tier's events).

With ``block_size_factor`` > 1 every offloaded chunk is announced in an event
of its own (its ``block_size_factor`` GPU block hashes, stored or removed
together): a chunk loads only whole, from a chunk boundary, so a router counts
an offloaded tier in whole chunks (docs/routing.md, "Chunks of several GPU
blocks"); events of one chain run are merged only when a chunk is one block.
``group_idx`` None is group 0 (``kvoffload.events.types``: the wire always
sends the number).

The shared remote tier's events carry ``ownership`` (see
``kvoffload.events``) when the manager names one (``event_ownership``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from kvoffload.events import MEDIUM_DISK, AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from kvoffload.events.journal import JOURNAL_NAME, Payload, PayloadJournal
from kvoffload.offload.base import (
    OffloadingEvent,
    OffloadKey,
    make_offload_key,
    offload_key_block_hash,
    offload_key_group_idx,
)

#: ``kv_cache_spec_kind`` of kvoffload's own engine's one group (vLLM's name).
FULL_ATTENTION = "full_attention"
#: Payloads of keys no tier holds any more, kept for late announcements.
RECENTLY_LEFT = 4096


@dataclass(frozen=True, slots=True)
class GroupSpec:
    """The static description of a KV cache group that its store events carry."""

    kind: str | None = FULL_ATTENTION
    sliding_window: int | None = None


@dataclass(frozen=True, slots=True)
class _BlockMeta:
    """One GPU block's event payload (learnt from the GPU tier's ``BlockStored``)."""

    parent: bytes | None
    tokens: tuple[int, ...]
    extra_keys: tuple[Any, ...] | None
    block_size: int
    lora_id: int | None
    lora_name: str | None


@dataclass(slots=True)
class _Payload:
    """An offloaded block's store payload; ``hashes`` end with the key's own hash."""

    hashes: list[bytes]
    parent: bytes | None
    tokens: list[int]
    extra_keys: list[tuple[Any, ...] | None]
    block_size: int
    lora_id: int | None
    lora_name: str | None


def _payload_tuple(p: _Payload) -> Payload:
    return (p.hashes, p.parent, p.tokens, p.extra_keys, p.block_size, p.lora_id, p.lora_name)


def _payload_from(t: Payload) -> _Payload:
    hashes, parent, tokens, extra, block_size, lora_id, lora_name = t
    return _Payload(
        [bytes(h) for h in hashes],
        None if parent is None else bytes(parent),
        list(tokens),
        [None if e is None else tuple(e) for e in extra],
        int(block_size),
        lora_id,
        lora_name,
    )


@dataclass(slots=True)
class _Held:
    """Which tiers hold a key, and its payload (None: placeholder)."""

    payload: _Payload | None
    media: set[str] = field(default_factory=set)


class OffloadEventDescriber:
    """Translates ``OffloadingEvent``s into KV events (module docstring).

    Invariant: ``_held`` has an entry exactly for the keys some tier holds
    (as announced), so memory is bounded by the tiers' holdings plus
    ``RECENTLY_LEFT`` payloads and the GPU tier's cached blocks.
    """

    def __init__(
        self,
        block_size_factor: int = 1,
        self_describing: bool = False,
        group_specs: Mapping[int, GroupSpec] | None = None,
        ownership: Mapping[str, str] | None = None,
        journal: PayloadJournal | None = None,
    ) -> None:
        if block_size_factor <= 0:
            raise ValueError(f"block_size_factor must be positive, got {block_size_factor}")
        self.factor = block_size_factor
        self.self_describing = self_describing
        self.group_specs: dict[int, GroupSpec] = dict(group_specs or {0: GroupSpec()})
        #: medium -> ``ownership`` its events carry (the shared remote tier's id).
        self.ownership: dict[str, str] = dict(ownership or {})
        self._gpu: dict[bytes, _BlockMeta] = {}
        self._gpu_left: set[bytes] = set()
        self._held: dict[OffloadKey, _Held] = {}
        self._left: OrderedDict[OffloadKey, _Payload] = OrderedDict()
        # Held keys announced as placeholders, and those whose payload the GPU
        # tier has just shown (re-announced described at the next translation).
        self._placeholders: set[OffloadKey] = set()
        self._to_describe: set[OffloadKey] = set()
        #: Payloads of the disk tier's blocks across restarts (None: not kept).
        self.journal = journal
        self._journal_compacted = False

    # -- the GPU tier's exact stream --------------------------------------------

    def observe(self, event: KVEvent) -> None:
        """A GPU-tier event (``BlockPool.event_listeners``): learn or forget payloads."""
        if not self.self_describing:
            return
        if isinstance(event, BlockStored):
            # The block pool's events carry its own hashes: bytes (ints come only
            # from events decoded off the wire, which never reach this listener).
            parent = cast("bytes | None", event.parent_block_hash)
            bs = event.block_size
            extras = event.extra_keys or []
            for i, h in enumerate(cast("list[bytes]", event.block_hashes)):
                self._gpu[h] = _BlockMeta(
                    parent,
                    tuple(event.token_ids[i * bs : (i + 1) * bs]),
                    extras[i] if i < len(extras) else None,
                    bs,
                    event.lora_id,
                    event.lora_name,
                )
                self._gpu_left.discard(h)
                if self._placeholders:
                    key = make_offload_key(h, event.group_idx or 0)
                    if key in self._placeholders:
                        self._to_describe.add(key)
                parent = h
        elif isinstance(event, BlockRemoved):
            # Forgotten only after the next translation: a store of these blocks
            # may be announced in the same step, after the GPU dropped them.
            self._gpu_left.update(cast("list[bytes]", event.block_hashes))
        elif isinstance(event, AllBlocksCleared):
            self._gpu_left.update(self._gpu)

    def _from_gpu(self, key: OffloadKey) -> _Payload | None:
        chain: list[bytes] = []
        metas: list[_BlockMeta] = []
        h: bytes | None = offload_key_block_hash(key)
        for _ in range(self.factor):
            meta = self._gpu.get(h) if h is not None else None
            if h is None or meta is None:
                return None
            chain.append(h)
            metas.append(meta)
            h = meta.parent
        chain.reverse()
        metas.reverse()
        first = metas[0]
        return _Payload(
            chain,
            first.parent,
            [t for m in metas for t in m.tokens],
            [m.extra_keys for m in metas],
            first.block_size,
            first.lora_id,
            first.lora_name,
        )

    # -- translation -------------------------------------------------------------

    def translate(self, events: Iterable[OffloadingEvent]) -> list[KVEvent]:
        """KV events for ``events`` (in order), announcing only changes of each tier's set."""
        out: list[KVEvent] = []
        emptied: list[OffloadKey] = []
        if self._to_describe:
            self._describe_placeholders(out)
        for ev in events:
            medium = ev.medium
            if ev.removed:
                by_group: dict[int, list[bytes | int]] = {}
                for key in ev.keys:
                    held = self._held.get(key)
                    if held is None or medium not in held.media:
                        continue
                    held.media.discard(medium)
                    if medium == MEDIUM_DISK and self.journal is not None:
                        self.journal.delete(key)
                    if not held.media:
                        emptied.append(key)
                    hashes = held.payload.hashes if held.payload else [offload_key_block_hash(key)]
                    if self.factor > 1:  # one unit per event, as its store
                        out.append(self._removed(list(hashes), medium, offload_key_group_idx(key)))
                        continue
                    by_group.setdefault(offload_key_group_idx(key), []).extend(hashes)
                for group, group_hashes in by_group.items():
                    out.append(self._removed(group_hashes, medium, group))
                continue
            for key in ev.keys:
                held = self._held.get(key)
                if held is None:
                    payload = self._left.pop(key, None)
                    if payload is None and self.self_describing:
                        payload = self._from_gpu(key)
                    if payload is None and self.self_describing and self.journal is not None:
                        kept = self.journal.get(key)
                        payload = None if kept is None else _payload_from(kept)
                    held = self._held[key] = _Held(payload)
                    if payload is None:
                        self._placeholders.add(key)
                if medium in held.media:
                    continue
                held.media.add(medium)
                self._journal_put(key, held.payload, medium)
                group = offload_key_group_idx(key)
                # A chunk of several GPU blocks loads only whole: its own event, never
                # merged with the next chunk's, so each offloaded store is one unit.
                if self.factor > 1 or not self._extends(
                    out, held.payload, medium, group, offload_key_block_hash(key)
                ):
                    out.append(self._stored(key, held.payload, medium))
        for key in emptied:
            held = self._held.get(key)
            if held is not None and not held.media:
                del self._held[key]
                self._placeholders.discard(key)
                if held.payload is not None:
                    self._left[key] = held.payload
        while len(self._left) > RECENTLY_LEFT:
            self._left.popitem(last=False)
        for h in self._gpu_left:
            self._gpu.pop(h, None)
        self._gpu_left.clear()
        if self.journal is not None:
            if not self._journal_compacted:
                # The first translation carries the disk tier's start-up announcement:
                # payloads of blocks it no longer holds go.
                self._journal_compacted = True
                self.journal.keep_only({k for k, h in self._held.items() if MEDIUM_DISK in h.media})
            self.journal.flush()
        return out

    def keep_payloads_in(self, directory: str | None) -> None:
        """Keep the disk tier's payloads in ``directory`` (its own; None: not kept).

        Only with self-describing events: placeholders need no journal.
        """
        if directory is not None and self.self_describing and self.journal is None:
            self.journal = PayloadJournal(Path(directory) / JOURNAL_NAME)

    def _journal_put(self, key: OffloadKey, payload: _Payload | None, medium: str) -> None:
        if payload is not None and medium == MEDIUM_DISK and self.journal is not None:
            self.journal.put(key, _payload_tuple(payload))

    def _describe_placeholders(self, out: list[KVEvent]) -> None:
        """Re-announce placeholder keys whose payload the GPU tier now shows."""
        for key in self._to_describe:
            held = self._held.get(key)
            if held is None or held.payload is not None:
                continue
            payload = self._from_gpu(key)
            if payload is None:
                continue
            self._placeholders.discard(key)
            group = offload_key_group_idx(key)
            for medium in sorted(held.media):
                out.append(self._removed([offload_key_block_hash(key)], medium, group))
                out.append(self._stored(key, payload, medium))
                self._journal_put(key, payload, medium)
            held.payload = payload
        self._to_describe.clear()

    @staticmethod
    def _extends(
        out: list[KVEvent], payload: _Payload | None, medium: str, group: int, key_hash: bytes
    ) -> bool:
        """Append ``payload`` to the last event when it continues that event's chain.

        One event per chain run, as the GPU tier sends them: fewer, larger
        events for a router to apply.
        """
        if not out:
            return False
        last = out[-1]
        if payload is None:
            # Placeholders of one manager event travel together, as they always did.
            if (
                isinstance(last, BlockStored)
                and last.medium == medium
                and (last.group_idx or 0) == group
                and last.block_size == 0
                and not last.token_ids
            ):
                last.block_hashes.append(key_hash)
                return True
            return False
        if not (
            isinstance(last, BlockStored)
            and last.medium == medium
            and (last.group_idx or 0) == group
            and last.block_size == payload.block_size
            and last.token_ids
            and last.block_hashes[-1] == payload.parent
            and last.lora_name == payload.lora_name
            and last.lora_id == payload.lora_id
            and last.extra_keys is not None
        ):
            return False
        last.block_hashes.extend(payload.hashes)
        last.token_ids.extend(payload.tokens)
        last.extra_keys.extend(payload.extra_keys)
        return True

    def _stored(self, key: OffloadKey, payload: _Payload | None, medium: str) -> BlockStored:
        group = offload_key_group_idx(key) or None  # None: group 0, as the wire sends it
        spec = self.group_specs.get(group or 0) if self.self_describing else None
        if payload is None:
            event = BlockStored(
                block_hashes=[offload_key_block_hash(key)],
                parent_block_hash=None,
                token_ids=[],
                block_size=0,
                lora_id=None,
                medium=medium,
                group_idx=group,
            )
        else:
            event = BlockStored(
                block_hashes=list(payload.hashes),
                parent_block_hash=payload.parent,
                token_ids=list(payload.tokens),
                block_size=payload.block_size,
                lora_id=payload.lora_id,
                medium=medium,
                lora_name=payload.lora_name,
                extra_keys=list(payload.extra_keys),
                group_idx=group,
            )
        if spec is not None:
            event.kv_cache_spec_kind = spec.kind
            event.kv_cache_spec_sliding_window = spec.sliding_window
        event.ownership = self.ownership.get(medium)
        return event

    def _removed(self, hashes: list[bytes | int], medium: str, group: int) -> BlockRemoved:
        return BlockRemoved(
            block_hashes=hashes,
            medium=medium,
            group_idx=group or None,
            ownership=self.ownership.get(medium),
        )

    def reset(self) -> None:
        """Forget every payload (a tier reset announces its removals first)."""
        self._held.clear()
        self._left.clear()
        self._placeholders.clear()
        self._to_describe.clear()


def tier_ownership(manager: object) -> dict[str, str]:
    """medium -> ``event_ownership`` of the manager's lower tiers that name one."""
    out: dict[str, str] = {}
    for tier in getattr(manager, "lower", ()) or ():
        owner = getattr(tier, "event_ownership", None)
        if owner:
            out[tier.medium] = owner
    return out


def offloading_events_to_kv_events(events: Iterable[OffloadingEvent]) -> list[KVEvent]:
    """Stateless translation: ``BlockStored`` / ``BlockRemoved`` with the tier as ``medium``.

    Stored events carry ``block_size=0`` and no tokens or parent: a router
    already has those from the GPU tier's event for the same hashes. Every
    event is passed on (the manager's own stream); the connector uses
    :class:`OffloadEventDescriber`, which also keeps each tier's set exact.
    """
    out: list[KVEvent] = []
    for ev in events:
        if not ev.keys:
            continue
        by_group: dict[int, list[bytes | int]] = {}
        for k in ev.keys:
            by_group.setdefault(offload_key_group_idx(k), []).append(offload_key_block_hash(k))
        for group, hashes in by_group.items():
            if ev.removed:
                out.append(
                    BlockRemoved(block_hashes=hashes, medium=ev.medium, group_idx=group or None)
                )
            else:
                out.append(
                    BlockStored(
                        block_hashes=hashes,
                        parent_block_hash=None,
                        token_ids=[],
                        block_size=0,
                        lora_id=None,
                        medium=ev.medium,
                        group_idx=group or None,
                    )
                )
    return out
