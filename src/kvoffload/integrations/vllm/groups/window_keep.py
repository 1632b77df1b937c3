"""Keep the sliding-window chunks that a hit at an earlier chunk boundary needs.

vLLM's offloading scheduler stores every chunk of a full-attention group but,
under its default ``prefix_cache_retention_interval=0``, only the
window-sized tail of a sliding-window (or Mamba) group that ends at the
request's own last prompt boundary (and at a GPU prefix-cache junction). A
later request whose shared prefix ends *earlier* than the earlier prompt
finds every full-attention chunk of that prefix in the tier but not the
window before its end, so it loads nothing.

``WindowKeep`` adds *reachable boundaries* to vLLM's own store mask
(``_reachable_store_block_mask``: vLLM's group manager turns a boundary into
the blocks a hit ending there needs, so the window arithmetic stays vLLM's):

- **junctions** (``sliding_window_keep: true``): a lookup whose
  full-attention prefix hit ends before the request's keys do shows a point
  where two prompts diverged. The last full-attention key before it is
  remembered (a bounded LRU of ``MAX_JUNCTIONS`` keys), and any request whose
  chunks reach that key keeps the window ending there, so the next request
  that diverges at the same place hits. The divergent request itself stores
  it, at the cost of one window per junction.
- **every** (``sliding_window_keep_every: N`` tokens, a multiple of the
  offloaded chunk): also the window ending at every N-th token, so a first
  divergence hits too, at most N tokens short; it costs a window every N
  tokens of every request (``window / N`` of a full-attention group's bytes).

By default (neither key set, or ``sliding_window_keep: "auto"``) both are on,
with ``every`` from ``default_every`` (``DEFAULT_EVERY_WINDOWS`` windows, in
whole chunks), wherever the CPU tier values the extra windows as entries like
any other chunk: kvoffload's chunk-unit policy (one CPU slot class, no lower
tiers) holds a window only where a known boundary (a prompt's end, a place a
lookup or a store showed prompts parting) reaches it, and evicts the others
first, so an extra window no lookup used goes before any chunk a hit needs,
and a chunk's keys of every group are still kept or dropped together. Where
the tier cannot tell them apart (several slot classes, each with its own
policy; lower tiers under vLLM's tiering manager, whose CPU tier ranks keys
one by one) the default is off (``auto_off_reason`` says why, logged once)
and stores are exactly vLLM's. ``sliding_window_keep: false`` turns it off.

Invariants: a boundary only *adds* blocks to vLLM's mask (a superset of
vLLM's stores; hits at least vLLM's); a group vLLM stores densely (mask
``None``) is left alone. The store mask has no request argument, so the
request is read from the calling frame's ``req_status`` (vLLM 0.32 and 0.33
both name it so in ``_build_store_jobs``); where it is not found the mask
is vLLM's, unchanged.
"""

from __future__ import annotations

import logging
import sys
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from kvoffload.integrations.vllm import compat
from kvoffload.integrations.vllm.scheduler.connector_build import current_build
from kvoffload.integrations.vllm.settings import KVOffloadConfigError
from kvoffload.offload import CPUOffloadingManager
from kvoffload.offload.chunk_units import uses_chunk_units
from kvoffload.tiers.config import parse_bool

logger = logging.getLogger(__name__)

KEEP_KEY = "sliding_window_keep"
EVERY_KEY = "sliding_window_keep_every"
#: Junction keys remembered (a 16-byte-ish key each: a few MiB at most).
MAX_JUNCTIONS = 1 << 16
#: The default ``every``: this many windows (``kvoffload bench hybrid --windows``).
DEFAULT_EVERY_WINDOWS = 16


def default_every(window_tokens: int, chunk_tokens: int) -> int:
    """The default ``every`` in tokens: ``DEFAULT_EVERY_WINDOWS`` windows of the widest
    windowed group, rounded up to whole offloaded chunks (a window per that many tokens
    costs about ``1 / DEFAULT_EVERY_WINDOWS`` of a full-attention group's bytes)."""
    if window_tokens <= 0 or chunk_tokens <= 0:
        return 0
    span = DEFAULT_EVERY_WINDOWS * max(window_tokens, chunk_tokens)
    return -(-span // chunk_tokens) * chunk_tokens


def check_reachable(extra: Mapping[str, Any]) -> None:
    """Refuse the window-keep keys where nothing would act on them.

    Only ``KVOffloadConnector`` reaches vLLM's scheduler to add stores; behind
    vLLM's stock ``OffloadingConnector`` the keys would be accepted and ignored.
    """
    config = WindowKeepConfig.from_extra_config(extra)
    if current_build() is None and config.enabled and not config.auto:
        raise KVOffloadConfigError(
            f"kv_connector_extra_config[{KEEP_KEY!r}] / [{EVERY_KEY!r}]: extra sliding-window "
            "stores need KVOffloadConnector (vLLM's OffloadingConnector cannot add them)"
        )


@dataclass(frozen=True)
class WindowKeepConfig:
    """``junctions``: keep windows at learned divergence points; ``every``: also every N tokens
    (0: none; None: ``default_every`` of the model's windows); ``auto``: the default, on only
    where the CPU tier values the extra windows (``auto_off_reason``)."""

    junctions: bool = False
    every: int | None = 0
    auto: bool = False

    @property
    def enabled(self) -> bool:
        return self.junctions or self.every is None or self.every > 0

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any]) -> WindowKeepConfig:
        """Read the two keys; a bad value is a ``KVOffloadConfigError`` naming the key.

        Neither key, or ``sliding_window_keep: "auto"``: the default, junctions and a window
        every ``default_every`` tokens (or the ``every`` given). ``sliding_window_keep_every``
        alone: that window and no junctions, wherever the tier is (as it always meant)."""
        junctions = False
        raw = extra.get(KEEP_KEY)
        every = _every(extra)
        if (raw is None and every is None) or (
            isinstance(raw, str) and raw.strip().lower() == "auto"
        ):
            return cls(junctions=True, every=every, auto=True)
        if raw is not None:
            if isinstance(raw, str) and raw.strip().lower() in ("junctions", "on"):
                junctions = True
            elif isinstance(raw, str) and raw.strip().lower() == "off":
                junctions = False
            else:
                try:
                    junctions = parse_bool(raw)
                except (ValueError, TypeError):
                    raise KVOffloadConfigError(
                        f"kv_connector_extra_config[{KEEP_KEY!r}]: expected true, false, 'auto' or "
                        f"'junctions', got {raw!r}"
                    ) from None
        return cls(junctions=junctions, every=every or 0)


def _every(extra: Mapping[str, Any]) -> int | None:
    """``sliding_window_keep_every`` in tokens, None when not given."""
    every = extra.get(EVERY_KEY)
    if every is None:
        return None
    if isinstance(every, bool) or not isinstance(every, int) or every < 0:
        raise KVOffloadConfigError(
            f"kv_connector_extra_config[{EVERY_KEY!r}]: expected a number of tokens >= 0, "
            f"got {every!r}"
        )
    return every


@dataclass
class WindowKeepStats:
    """What keeping cost: junctions learned and chunks (of non-dense groups) made storable
    beyond vLLM's mask (offered to the tier; already-stored ones are not stored again)."""

    junctions: int = 0
    extra_chunks: int = 0


class JunctionSet:
    """A bounded set of full-attention offload keys at which prompts diverged (LRU order)."""

    def __init__(self, capacity: int = MAX_JUNCTIONS) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._keys: OrderedDict[bytes, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, key: object) -> bool:
        return key in self._keys

    def add(self, key: bytes) -> bool:
        """Remember ``key`` (most recent); True if it was new."""
        if key in self._keys:
            self._keys.move_to_end(key)
            return False
        self._keys[key] = None
        if len(self._keys) > self.capacity:
            self._keys.popitem(last=False)
        return True


class WindowKeep:
    """Wraps one vLLM ``OffloadingConnectorScheduler``'s lookup and store mask (``install``)."""

    def __init__(self, config: WindowKeepConfig, capacity: int = MAX_JUNCTIONS) -> None:
        self.config = config
        self.junctions = JunctionSet(capacity)
        self.stats = WindowKeepStats()
        self._sched: Any = None
        self._warned = False

    # -- wiring ------------------------------------------------------------------

    def install(self, sched: Any) -> None:
        """Wrap ``sched``'s ``_maximal_prefix_lookup`` and ``_reachable_store_block_mask``
        (instance attributes: the class, and every other scheduler, stay vLLM's)."""
        if not self.config.enabled:
            return
        align = getattr(sched.config, "alignment_tokens", None)
        every = self.config.every or 0
        if every and align and every % align:
            raise KVOffloadConfigError(
                f"kv_connector_extra_config[{EVERY_KEY!r}]: {every} tokens is not "
                f"a multiple of the offloaded chunk ({align} tokens)"
            )
        self._sched = sched
        lookup = sched._maximal_prefix_lookup
        mask = sched._reachable_store_block_mask

        def maximal_prefix_lookup(
            keys: Iterable[bytes], req_context: Any, req: Any, group_config: Any, start: int
        ) -> int | None:
            listed = list(keys)
            hit = lookup(listed, req_context, req, group_config, start)
            # The next key missed: the prompts part here. A deferred lookup (None)
            # says nothing yet; a full hit is no divergence.
            if not self.config.junctions or hit is None:
                return hit
            if 0 < hit < len(listed) and self.junctions.add(listed[hit - 1]):
                self.stats.junctions += 1
            return hit

        def reachable_store_block_mask(
            group_config: Any,
            start_chunk_idx: int,
            end_chunk_idx: int,
            final_segment_end_chunk_idx: int | None,
            reachable_boundaries: tuple[int, ...],
        ) -> list[bool] | None:
            base = mask(
                group_config,
                start_chunk_idx,
                end_chunk_idx,
                final_segment_end_chunk_idx,
                reachable_boundaries,
            )
            if base is None:
                return None  # dense: vLLM stores every block of the range
            req_status = sys._getframe(1).f_locals.get("req_status")
            if req_status is None:
                self._warn_once()
                return base
            extra = self.boundaries(req_status, group_config, start_chunk_idx, end_chunk_idx)
            if not extra:
                return base
            wider = mask(
                group_config,
                start_chunk_idx,
                end_chunk_idx,
                final_segment_end_chunk_idx,
                tuple(reachable_boundaries) + extra,
            )
            if wider is None:
                return None
            merged = [a or b for a, b in zip(base, wider)]
            per_chunk = sched.config.blocks_per_chunk
            self.stats.extra_chunks += sum(
                any(merged[i : i + per_chunk]) and not any(base[i : i + per_chunk])
                for i in range(0, len(merged), per_chunk)
            )
            return merged

        sched._maximal_prefix_lookup = maximal_prefix_lookup
        sched._reachable_store_block_mask = reachable_store_block_mask

    def _warn_once(self) -> None:
        if not self._warned:
            self._warned = True
            logger.warning(
                "kvoffload: %s is on but this vLLM's store path names no req_status; "
                "storing sliding-window chunks as vLLM does",
                KEEP_KEY,
            )

    # -- decisions -----------------------------------------------------------------

    def boundaries(
        self, req_status: Any, group_config: Any, start_chunk_idx: int, end_chunk_idx: int
    ) -> tuple[int, ...]:
        """Token positions whose window the store of chunks ``[start, end)`` of ``group_config``
        keeps: junction keys among the request's full-attention chunks, and multiples of
        ``every``, in ``(start, end + window]`` tokens (a boundary past the range can still
        need blocks inside it)."""
        sched = self._sched
        tpc = group_config.tokens_per_chunk
        window = getattr(group_config.kv_cache_spec, "sliding_window", 0) or tpc
        lo, hi = start_chunk_idx * tpc, end_chunk_idx * tpc + window
        found: list[int] = []
        if self.config.junctions and len(self.junctions):
            for idx in sched._full_attention_groups:
                fa_config = sched.config.kv_group_configs[idx]
                keys = req_status.group_states[idx].offload_keys
                fa_tpc = fa_config.tokens_per_chunk
                first = max(0, lo // fa_tpc)
                last = min(len(keys), hi // fa_tpc)
                for j in range(first, last):
                    if keys[j] in self.junctions:
                        found.append((j + 1) * fa_tpc)
        every = self.config.every or 0
        if every:
            b = (lo // every + 1) * every
            while b <= hi:
                found.append(b)
                b += every
        return tuple(sorted(set(found)))


def install_window_keep(sched: Any, extra: Mapping[str, Any]) -> WindowKeep | None:
    """Install ``WindowKeep`` on a vLLM offloading scheduler as the extra config asks; None
    when it is off (nothing wrapped). The default (``auto``) is resolved against ``sched``:
    off where ``auto_off_reason`` gives a reason (logged), else junctions and ``every``."""
    config = WindowKeepConfig.from_extra_config(extra)
    if config.auto:
        reason = auto_off_reason(sched)
        if reason is not None:
            logger.info("kvoffload: extra sliding-window stores off by default: %s", reason)
            return None
        if config.every is None:
            config = replace(config, every=default_every(widest_window(sched), align_of(sched)))
    if not config.enabled:
        return None
    keep = WindowKeep(config)
    keep.install(sched)
    return keep


def align_of(sched: Any) -> int:
    """The offloaded chunk of the full-attention groups, in tokens (0: vLLM names none)."""
    return int(getattr(sched.config, "alignment_tokens", None) or 0)


def widest_window(sched: Any) -> int:
    """The widest windowed group's window in tokens (its chunks' span when vLLM gives only
    ``sliding_window_size_in_chunks``); 0 without one."""
    widest = 0
    for g in sched.config.kv_group_configs:
        spec = getattr(g, "kv_cache_spec", None)
        window = getattr(spec, "sliding_window", None) or getattr(
            spec, "attention_chunk_size", None
        )
        if not window:
            _, chunks = compat.group_window_chunks(g)
            window = chunks * g.tokens_per_chunk if chunks else 0
        widest = max(widest, int(window))
    return widest


def auto_off_reason(sched: Any) -> str | None:
    """Why the default leaves vLLM's stores alone on this scheduler; None where it is on.

    On needs a group vLLM stores sparsely (a window at chunk boundaries) and a CPU tier
    whose policy ranks whole chunks and evicts windows no known boundary reaches first
    (kvoffload's chunk-unit layer: one slot class, no lower tiers). Elsewhere an extra
    window would compete with the chunks hits need on equal terms."""
    if not getattr(sched, "_sliding_window_groups", ()):
        return "no sliding-window group"
    if not align_of(sched) or not widest_window(sched):
        return "vLLM stores every sliding-window chunk of this layout"
    cpu = getattr(getattr(sched, "manager", None), "cpu", None)
    if not isinstance(cpu, CPUOffloadingManager):
        return (
            "the CPU tier is vLLM's under its tiering manager (lower tiers) or several slot "
            "classes: its policy ranks keys one by one, so extra windows would compete with "
            "the chunks hits need"
        )
    if not uses_chunk_units(cpu.group_layout):
        return "the CPU tier does not rank chunks as units"
    return None
