"""A vLLM engine's kvoffload tier identity and a tier's metric label.

``tier_identity`` is kvoffload's tier fingerprint for a vLLM engine (model @
revision, KV dtype, cache layout, group geometry, bytes per row, hash
function and seed, and the parallel layout: world size and the TP / PP / PCP
/ DCP sizes, or "agnostic" where vLLM certifies the row's bytes as the same
under any topology). The rank is not part of it: a row holds every rank's
shard.
"""

from __future__ import annotations

import hashlib
import urllib.parse
from collections.abc import Mapping
from typing import TYPE_CHECKING

from kvoffload.integrations.vllm.groups.group_slots import group_layout_fingerprint

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import OffloadingSpec


def _quote(value: object) -> str:
    return urllib.parse.quote(str(value), safe="/:@.-_+,")


def _engine_facts() -> tuple[str | None, str]:
    """(model revision, prefix-caching hash algorithm) from vLLM's current config, if any."""
    try:
        from vllm.config import get_current_vllm_config_or_none

        cfg = get_current_vllm_config_or_none()
    except ImportError:  # pragma: no cover - both supported releases have it
        cfg = None
    if cfg is None:
        return None, "sha256"
    revision = cfg.model_config.revision if cfg.model_config else None
    algo = str(cfg.cache_config.prefix_caching_hash_algo or "sha256")
    return (str(revision) if revision else None), algo


def is_parallel_agnostic(spec: OffloadingSpec) -> bool:
    """Whether vLLM certifies a row's bytes as the same under any parallel layout.

    As vLLM's fs tier decides: the parallel config says the concatenated
    shards are topology-free (``is_parallelism_agnostic``), or the layout is
    replicated (one copy of an MLA latent for all ranks).
    """
    config = spec.config
    return bool(config.parallel.is_parallelism_agnostic or config.replicated_layout)


def tier_identity(spec: OffloadingSpec, row_bytes: int, model_revision: str | None = None) -> str:
    """kvoffload's tier fingerprint for a vLLM engine, as one ``k=v;...`` string.

    Fields: ``format``; ``model`` (name @ revision: ``model_revision``, else
    vLLM's current model config's revision, else "unknown"); ``dtype`` (KV
    cache dtype); ``kv_layout`` (vLLM's KV cache layout) and ``canonical``
    (the canonical byte format, or "direct"); ``groups`` (per KV cache group:
    kind and window, tokens per block, layer count, bytes per block and a
    digest of the layer names: ``group_slots.group_layout_fingerprint``);
    ``tokens_per_hash``, ``blocks_per_chunk`` and ``row_bytes`` (bytes per
    offloaded chunk, every rank's shard and padding); ``hash_fn`` and
    ``hash_seed`` (vLLM's prefix-caching hash and its ``NONE_HASH`` seed:
    "random" when vLLM draws it per process); ``parallel`` ("agnostic" when
    vLLM certifies it, else world size and TP / PP / PCP / DCP sizes, and
    "replicated" for a single-copy layout). It parses with
    ``kvoffload.tiers.identity.parse_fingerprint``.
    """
    from kvoffload.hashing.block_hash import none_hash_seed_is_random, resolve_none_hash_seed

    config = spec.config
    revision, algo = _engine_facts()
    revision = model_revision or revision or "unknown"
    seed = "random" if none_hash_seed_is_random(algo) else resolve_none_hash_seed(algo)
    if len(seed) > 32:
        # A long seed (an operator's PYTHONHASHSEED) is recorded as a digest.
        seed = "sha256:" + hashlib.sha256(seed.encode()).hexdigest()[:16]
    groups = group_layout_fingerprint(config)
    canonical = "direct"
    if config.canonical_layout:
        canonical = f"canonical:{config.kv_cache_layout}"
    p = config.parallel
    if is_parallel_agnostic(spec):
        parallel = "agnostic"
    else:
        parallel = (
            f"world{p.world_size}-tp{p.tp_size}-pp{p.pp_size}-pcp{p.pcp_size}-dcp{p.dcp_size}"
        )
    if config.replicated_layout:
        parallel += "-replicated"
    values = {
        "format": "vllm-row-v1",
        "model": f"{config.model.name}@{revision}",
        "dtype": config.model.dtype,
        "kv_layout": config.kv_cache_layout or "default",
        "canonical": canonical,
        "groups": groups,
        "tokens_per_hash": config.cache.tokens_per_hash,
        "blocks_per_chunk": config.cache.blocks_per_chunk,
        "row_bytes": row_bytes,
        "hash_fn": algo,
        "hash_seed": seed,
        "parallel": parallel,
    }
    return ";".join(f"{k}={_quote(v)}" for k, v in values.items())


def identity_digest(identity: str) -> str:
    return hashlib.sha256(identity.encode()).hexdigest()[:16]


def tier_label_of(spec: OffloadingSpec, tier_type: str) -> str:
    """vLLM's label for this tier ("<index + 1>:<type>", as its tiering metrics spell it).

    A tier is not told its index: it is the n-th ``secondary_tiers`` entry of
    its type, n counting the tiers of that type built for this spec so far
    (vLLM builds them in order).
    """
    configs = getattr(spec, "secondary_tier_configs", None) or []
    claims: list[str] = spec.__dict__.setdefault("_kvoffload_tier_claims", [])
    before = claims.count(tier_type)
    claims.append(tier_type)
    matches = [
        i
        for i, cfg in enumerate(configs)
        if isinstance(cfg, Mapping) and cfg.get("type") == tier_type
    ]
    if before < len(matches):
        return f"{matches[before] + 1}:{tier_type}"
    return f"?:{tier_type}"
