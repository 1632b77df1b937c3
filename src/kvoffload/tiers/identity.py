"""A tier's identity: everything that decides a stored slot's bytes, as one fingerprint.

``tier_fingerprint`` names everything that decides a stored slot's bytes;
the stores fold it into their manifest (disk) and namespace (remote), so
engines whose KV differs never read each other's blocks.
"""

from __future__ import annotations

import urllib.parse

from kvoffload.transfer.layout import KVLayout

#: Bump when the serialised form of a slot (or the fingerprint's fields) changes.
SLOT_FORMAT_VERSION = 2

#: The fingerprint's fields, in order; ``tier_fingerprint`` documents each.
FINGERPRINT_FIELDS = (
    "format",
    "model",
    "layers",
    "kv_heads",
    "head_size",
    "block_size",
    "dtype",
    "kv_quant",
    "layout",
    "block_size_factor",
    "hash_fn",
    "hash_seed",
    "tp_rank",
    "tp_size",
)


def _field(value: object) -> str:
    # Values never contain the separators, so the string parses back unambiguously.
    return urllib.parse.quote(str(value), safe="/:@.-_+,")


def tier_fingerprint(
    layout: KVLayout,
    block_size_factor: int = 1,
    *,
    model_id: str = "",
    hash_fn: str = "",
    hash_seed: str | None = "",
    kv_quant: str = "none",
    tp_rank: int = 0,
    tp_size: int = 1,
) -> str:
    """Everything that decides a stored slot's bytes, as one stable ``k=v;...`` string.

    Fields (``FINGERPRINT_FIELDS``): ``format`` (this serialisation's version),
    ``model`` (the model's identity: a weights+config digest, the random
    model's config and seed, or a name and revision; see
    ``kvoffload.engine.model_identity``), the KV geometry (``layers``,
    ``kv_heads``, ``head_size``, ``block_size`` in tokens per GPU block),
    ``dtype`` (the KV cache dtype), ``kv_quant`` (KV quantisation, "none"
    when the cache holds ``dtype`` values as computed), ``layout`` (how a slot
    is laid out: ``KVLayout.kind``) and ``block_size_factor`` (GPU blocks per
    slot), ``hash_fn`` and ``hash_seed`` (the block-hash function and the
    seed of its chain: "random" when the seed is per process), and
    ``tp_rank``/``tp_size`` (each tensor-parallel rank stores its own heads).
    Two engines share a persistent tier's blocks only when every field is equal.
    """
    if tp_size < 1 or not 0 <= tp_rank < tp_size:
        raise ValueError(f"tensor-parallel rank {tp_rank} of {tp_size} is not valid")
    g = layout.geometry
    values = {
        "format": f"slot-v{SLOT_FORMAT_VERSION}",
        "model": model_id or "unknown",
        "layers": g.num_layers,
        "kv_heads": g.num_kv_heads,
        "head_size": g.head_size,
        "block_size": g.block_size,
        "dtype": str(g.dtype).removeprefix("torch."),
        "kv_quant": kv_quant or "none",
        "layout": layout.kind,
        "block_size_factor": block_size_factor,
        "hash_fn": hash_fn or "unknown",
        "hash_seed": "random" if hash_seed is None else hash_seed,
        "tp_rank": tp_rank,
        "tp_size": tp_size,
    }
    return ";".join(f"{k}={_field(values[k])}" for k in FINGERPRINT_FIELDS)


def parse_fingerprint(fingerprint: str) -> dict[str, str]:
    """The fields of a ``k=v;...`` fingerprint (values decoded); other strings give {}."""
    out: dict[str, str] = {}
    for part in fingerprint.split(";"):
        k, sep, v = part.partition("=")
        if not sep or not k:
            return {}
        out[k] = urllib.parse.unquote(v)
    return out


def fingerprint_diff(have: str, want: str) -> list[str]:
    """Per differing field, ``"field: 'have' vs 'want'"``; the whole strings when unparseable."""
    a, b = parse_fingerprint(have), parse_fingerprint(want)
    if not a or not b:
        return [] if have == want else [f"fingerprint: {have!r} vs {want!r}"]
    keys = [*b, *(k for k in a if k not in b)]
    return [f"{k}: {a.get(k)!r} vs {b.get(k)!r}" for k in keys if a.get(k) != b.get(k)]
