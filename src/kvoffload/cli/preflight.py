"""Checks an engine configuration against the machine before anything is allocated.

A GPU or CPU tier too large for memory is refused in one line here, instead of
surfacing as an allocator error (or the OOM killer) during start-up.
"""

from __future__ import annotations

from kvoffload.cli.argtypes import check_fits_in_memory
from kvoffload.engine.config import EngineConfig


def kv_bytes_per_block(config: EngineConfig) -> int:
    """Bytes of one KV block of the configured model (all layers, K and V)."""
    from kvoffload.engine.model_runner import _model_config, kv_geometry

    return int(kv_geometry(_model_config(config), config.block_size).bytes_per_block)


def engine_memory_bytes(config: EngineConfig) -> int:
    """Bytes the engine's KV tiers take in memory: the GPU tier and, with offload, the CPU tier."""
    per_block = kv_bytes_per_block(config)
    total = config.num_gpu_blocks * per_block
    if config.offload_enabled:
        total += (
            config.cpu_bytes
            if config.cpu_bytes is not None
            else (config.num_cpu_blocks * per_block)
        )
    return total


def check_engine_memory(config: EngineConfig) -> None:
    """``ValueError`` naming the sizes when the KV tiers would not fit in available memory."""
    what = (
        f"the KV cache ({config.num_gpu_blocks:,} GPU blocks of {config.block_size:,} tokens"
        + (
            f" + a CPU tier of {config.cpu_bytes:,} bytes"
            if config.offload_enabled and config.cpu_bytes is not None
            else f" + {config.num_cpu_blocks:,} CPU blocks"
            if config.offload_enabled
            else ""
        )
        + ")"
    )
    check_fits_in_memory(what, engine_memory_bytes(config))


def check_redis_reachable(url: str, timeout_s: float = 3.0) -> None:
    """``ValueError`` in one line when the Redis at ``url`` cannot be used at all.

    Unreachable, refusing the credentials, or without the database asked for:
    each is a mistake in the command line, so it is refused at start-up (an
    outage later in a run only costs misses). A server that accepts the
    connection and does not answer in time is not refused: the tier starts in
    an outage, with one warning, and recovers when the server answers.
    Cluster URLs are left to the cluster client.
    """
    if "+cluster" in url.split("://", 1)[0]:
        return
    import redis

    from kvoffload.tiers.redis.store import redact_url

    shown = redact_url(url)
    try:
        client = redis.Redis.from_url(
            url, socket_connect_timeout=timeout_s, socket_timeout=timeout_s
        )
    except (ValueError, redis.RedisError) as exc:
        raise ValueError(f"bad Redis URL {shown}: {exc}") from None
    from urllib.parse import urlsplit

    has_password = urlsplit(url).password is not None
    try:
        client.ping()
    except redis.AuthenticationError as exc:
        if not has_password:  # redis-py's HELLO error says "credentials" though none were given
            raise ValueError(
                f"Redis at {shown} needs a password: give it in the URL "
                "(redis://:PASSWORD@host:port/db)"
            ) from None
        raise ValueError(f"Redis at {shown} rejected the credentials ({exc})") from None
    except redis.TimeoutError:
        # Accepted the connection but does not answer (overloaded, paused, a proxy
        # without a backend): the tier starts in an outage and warns once itself.
        return
    except redis.ConnectionError as exc:
        raise ValueError(f"cannot reach Redis at {shown} ({exc})") from None
    except redis.ResponseError as exc:
        text = str(exc)
        if "NOAUTH" in text or "AUTH" in text.upper().split(" ")[0]:
            raise ValueError(
                f"Redis at {shown} needs a password: give it in the URL "
                "(redis://:PASSWORD@host:port/db)"
            ) from None
        raise ValueError(f"Redis at {shown} refused the connection ({text})") from None
    except redis.RedisError as exc:
        raise ValueError(f"Redis at {shown} is not usable ({exc})") from None
    finally:
        client.close()


def check_engine_config(config: EngineConfig) -> None:
    """Every start-up check: memory for the KV tiers, and a reachable Redis when one is given."""
    check_engine_memory(config)
    if config.redis_url is not None and config.offload_enabled:
        check_redis_reachable(config.redis_url)
