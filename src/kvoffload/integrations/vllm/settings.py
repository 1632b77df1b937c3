"""``kv_connector_extra_config`` for kvoffload inside vLLM: parsed and checked at start-up.

kvoffload's keys:

- ``cpu_bytes``: the CPU tier's budget, an int or a size such as "64GiB";
- ``cache_policy``: the CPU tier's eviction policy (kvoffload's names);
- ``disk_dir`` / ``disk_bytes``: a disk tier below the CPU tier;
- ``redis_url``: a shared Redis/Valkey tier below that (what ``--redis-url``
  takes: ``redis://``, ``rediss://``, ``valkey://``, ``unix://``,
  ``redis+cluster://host:port,host:port``);
- ``mooncake_url`` (``mooncakestore://HOST:PORT``) and the other
  ``mooncake_*`` keys (``kvoffload.tiers.mooncake.settings``): a Mooncake
  Store tier instead of Redis (``KVOffloadMooncakeTier``);
- ``sliding_window_keep`` / ``sliding_window_keep_every``: KVOffloadConnector
  keeps the sliding-window chunks a hit at an earlier boundary needs
  (``kvoffload.integrations.vllm.groups.window_keep``; on by default where the
  CPU tier is kvoffload's chunk-unit policy);
- ``write_through``: accepted; the lower tiers run under vLLM's tiering
  manager, which writes every block down to every lower tier as soon as it
  reaches the CPU tier (write-through) whatever the value.

vLLM's own keys keep vLLM's meaning: ``cpu_bytes_to_use`` (= ``cpu_bytes``),
``eviction_policy`` (= ``cache_policy``), ``block_size`` / ``blocks_per_chunk``
(tokens / GPU blocks per offloaded block, read by vLLM itself),
``store_threshold`` and ``max_tracker_size`` (store a block only once it has
been offered that many times), and the connector's ``spec_name``,
``spec_module_path``, ``offload_prompt_only``, ``self_describing_kv_events``,
``sync_load_budget_bytes``, and with lower tiers vLLM's tiering keys
``tier_poll_interval_s`` and ``cache_policy_module_path`` (the CPU tier's
``eviction_policy`` is then that module's vLLM ``CachePolicy`` class, as
vLLM's factory resolves it). Anything else is an error naming the key, raised
before the engine serves: a typo must not silently run without offloading.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvoffload.offload.cpu_manager import DEFAULT_CACHE_POLICY
from kvoffload.offload.policies import policy_names
from kvoffload.tiers.config import (
    MOONCAKE_KEYS,
    TierConfig,
    TierConfigError,
    parse_bool,
    parse_redis_url,
)
from kvoffload.transfer.sizing import parse_bytes

KVOFFLOAD_KEYS: tuple[str, ...] = (
    "cpu_bytes",
    "cache_policy",
    "disk_dir",
    "disk_bytes",
    "redis_url",
    *MOONCAKE_KEYS,
    "write_through",
    # KVOffloadConnector's extra sliding-window stores (window_keep.py).
    "sliding_window_keep",
    "sliding_window_keep_every",
)
#: Keys vLLM's offloading connector or CPU spec reads; accepted with vLLM's meaning.
VLLM_KEYS: tuple[str, ...] = (
    "spec_name",
    "spec_module_path",
    "cpu_bytes_to_use",
    "eviction_policy",
    "block_size",
    "blocks_per_chunk",
    "store_threshold",
    "max_tracker_size",
    "offload_prompt_only",
    "self_describing_kv_events",
    "sync_load_budget_bytes",
    "canonical_layout",
    "tier_poll_interval_s",
    "cache_policy_module_path",
)
#: vLLM CPU-spec keys kvoffload cannot honour; named in the error instead of ignored.
UNSUPPORTED_KEYS: dict[str, str] = {}

#: ``secondary_tiers`` entries name kvoffload's tier classes in this module (vLLM imports it).
TIERS_MODULE = "kvoffload.integrations.vllm"


class KVOffloadConfigError(ValueError):
    """A bad ``kv_connector_extra_config``; the message is one line naming the key."""


@dataclass(frozen=True)
class KVOffloadSettings:
    """The checked extra config."""

    cpu_bytes: int
    cache_policy: str = DEFAULT_CACHE_POLICY
    disk_dir: str | None = None
    disk_bytes: int | None = None
    redis_url: str | None = None
    #: The Mooncake tier's keys as given (checked), ``mooncake_url`` among them; () when none.
    mooncake: tuple[tuple[str, Any], ...] = ()
    write_through: bool = False
    store_threshold: int = 0
    max_tracker_size: int = 64_000
    #: vLLM's tiering: pause between its tier-poll rounds (0.33; None: vLLM's default).
    tier_poll_interval_s: float | None = None
    #: A vLLM ``CachePolicy`` module for the CPU tier (lower tiers only) and its class name.
    cache_policy_module_path: str | None = None
    vllm_eviction_policy: str | None = None

    @property
    def has_lower_tiers(self) -> bool:
        return self.disk_dir is not None or self.redis_url is not None or bool(self.mooncake)

    def secondary_tiers(self) -> list[dict[str, Any]]:
        """The lower tiers as vLLM ``secondary_tiers`` entries: disk first, then Redis."""
        # vLLM's tiering writes every block down as it reaches the CPU tier, so the
        # tiers are write-through whatever ``write_through`` says (docs/vllm.md).
        out: list[dict[str, Any]] = []
        if self.disk_dir is not None:
            out.append(
                {
                    "type": "KVOffloadDiskTier",
                    "module_path": TIERS_MODULE,
                    "disk_dir": self.disk_dir,
                    "disk_bytes": self.disk_bytes,
                }
            )
        if self.redis_url is not None:
            out.append(
                {
                    "type": "KVOffloadRedisTier",
                    "module_path": TIERS_MODULE,
                    "redis_url": self.redis_url,
                }
            )
        if self.mooncake:
            out.append(
                {
                    "type": "KVOffloadMooncakeTier",
                    "module_path": TIERS_MODULE,
                    **dict(self.mooncake),
                }
            )
        return out

    def tier_config(self, *, enable_events: bool = True, num_threads: int = 2) -> TierConfig | None:
        """The lower tiers these settings name, as one ``TierConfig`` (None: CPU tier only)."""
        if not self.has_lower_tiers:
            return None
        return TierConfig(
            disk_dir=self.disk_dir,
            disk_bytes=self.disk_bytes,
            redis_url=self.redis_url,
            **dict(self.mooncake),
            write_mode="write_through" if self.write_through else "write_back",
            enable_events=enable_events,
            num_threads=num_threads,
            where="kv_connector_extra_config",
        )


def _fail(key: str, why: str) -> KVOffloadConfigError:
    return KVOffloadConfigError(f"kv_connector_extra_config[{key!r}]: {why}")


def _size(key: str, value: Any) -> int:
    try:
        return parse_bytes(value)
    except ValueError as exc:
        raise _fail(key, str(exc)) from None


def _bool(key: str, value: Any) -> bool:
    try:
        return parse_bool(value)
    except ValueError as exc:
        raise _fail(key, str(exc)) from None


def _nonneg_int(key: str, value: Any) -> int:
    try:
        n = int(value)
    except (TypeError, ValueError):
        raise _fail(key, f"expected an int, got {value!r}") from None
    if isinstance(value, bool) or n < 0 or (isinstance(value, float) and value != n):
        raise _fail(key, f"expected an int >= 0, got {value!r}")
    return n


def _one_of(config: Mapping[str, Any], ours: str, theirs: str) -> tuple[str, Any] | None:
    if ours in config and theirs in config:
        raise _fail(theirs, f"give {ours!r} or vLLM's {theirs!r}, not both")
    if ours in config:
        return ours, config[ours]
    if theirs in config:
        return theirs, config[theirs]
    return None


def _check_keys(config: Mapping[str, Any]) -> None:
    known = set(KVOFFLOAD_KEYS) | set(VLLM_KEYS)
    for key in config:
        if key in UNSUPPORTED_KEYS:
            raise _fail(key, UNSUPPORTED_KEYS[key])
        if key not in known:
            raise _fail(
                key,
                "unknown key; kvoffload takes "
                + ", ".join(KVOFFLOAD_KEYS)
                + " and vLLM's "
                + ", ".join(VLLM_KEYS),
            )


def _policy(config: Mapping[str, Any]) -> tuple[str, str | None, str | None]:
    """``(cache_policy, cache_policy_module_path, vLLM policy class name)``."""
    policy = _one_of(config, "cache_policy", "eviction_policy")
    cache_policy = DEFAULT_CACHE_POLICY
    module_path = config.get("cache_policy_module_path")
    vllm_policy = None
    if module_path is not None:
        if not isinstance(module_path, str) or not module_path.strip():
            raise _fail("cache_policy_module_path", f"expected a module path, got {module_path!r}")
        if not any(k in config for k in ("disk_dir", "redis_url", "mooncake_url")):
            raise _fail(
                "cache_policy_module_path",
                "vLLM policy modules drive vLLM's CPU tier, used with disk_dir or redis_url; "
                "without them set cache_policy to one of kvoffload's policies",
            )
        if policy is None or policy[0] != "eviction_policy" or not isinstance(policy[1], str):
            raise _fail(
                "cache_policy_module_path", "needs eviction_policy: the policy's class name"
            )
        vllm_policy = policy[1]
        policy = None
    if policy is not None:
        key, value = policy
        names = policy_names()
        if not isinstance(value, str) or value not in names:
            raise _fail(key, f"unknown policy {value!r}; known: {', '.join(names)}")
        cache_policy = value
    return cache_policy, module_path, vllm_policy


def _lower_tiers(config: Mapping[str, Any]) -> tuple[str | None, int | None, str | None]:
    """``(disk_dir, disk_bytes, redis_url)``, each None where not configured."""
    disk_dir = config.get("disk_dir")
    if disk_dir is not None and (not isinstance(disk_dir, str) or not disk_dir.strip()):
        raise _fail("disk_dir", f"expected a directory path, got {disk_dir!r}")
    disk_bytes = None
    if "disk_bytes" in config:
        if disk_dir is None:
            raise _fail("disk_bytes", "needs disk_dir")
        disk_bytes = _size("disk_bytes", config["disk_bytes"])
    elif disk_dir is not None:
        raise _fail("disk_bytes", 'missing: the disk tier\'s budget, e.g. "500GiB"')
    redis_url = config.get("redis_url")
    if redis_url is not None:
        # What the CLI's --redis-url accepts: valkey://, rediss://, unix://, cluster seed lists.
        try:
            redis_url = parse_redis_url(redis_url, where="kv_connector_extra_config")
        except TierConfigError as exc:
            raise KVOffloadConfigError(str(exc)) from None
    return disk_dir, disk_bytes, redis_url


def _mooncake(config: Mapping[str, Any], redis_url: str | None) -> tuple[tuple[str, Any], ...]:
    """The Mooncake keys given, checked (``tiers.mooncake.settings``); () when none."""
    given = {k: config[k] for k in MOONCAKE_KEYS if k in config}
    if not given:
        return ()
    from kvoffload.tiers.mooncake import settings

    if "mooncake_url" not in given:
        raise _fail(next(iter(given)), "needs mooncake_url (the Mooncake master)")
    if redis_url is not None:
        raise _fail("mooncake_url", "give redis_url or mooncake_url: both are the remote tier")
    try:
        checked = settings.check(given)
    except settings.MooncakeSettingError as exc:
        raise _fail(exc.key, exc.why) from None
    return tuple((k, checked[k]) for k in given)


def _check_vllm_keys(config: Mapping[str, Any]) -> None:
    """vLLM's own keys that kvoffload passes on: checked here so a bad one fails in one line."""
    for key in ("offload_prompt_only", "self_describing_kv_events"):
        if key in config:
            _bool(key, config[key])
    if "canonical_layout" in config and _bool("canonical_layout", config["canonical_layout"]):
        raise _fail("canonical_layout", "kvoffload stores each worker's pages as they are")
    for key in ("block_size", "blocks_per_chunk"):
        if key in config and _nonneg_int(key, config[key]) == 0:
            raise _fail(key, "must be positive")
    if "sync_load_budget_bytes" in config:
        _nonneg_int("sync_load_budget_bytes", config["sync_load_budget_bytes"])


def _poll_interval(config: Mapping[str, Any]) -> float | None:
    poll = config.get("tier_poll_interval_s")
    if poll is None:
        return None
    try:
        return float(poll)
    except (TypeError, ValueError):
        raise _fail("tier_poll_interval_s", f"expected seconds, got {poll!r}") from None


def parse_settings(config: Mapping[str, Any]) -> KVOffloadSettings:
    """Check ``config`` (``kv_connector_extra_config``); ``KVOffloadConfigError`` names the key.

    Keys are checked in a fixed order (unknown keys, CPU budget, policy, lower
    tiers, write-through, vLLM's keys, store threshold, poll interval): with
    several bad keys the message names the first in that order.
    """
    _check_keys(config)
    cpu = _one_of(config, "cpu_bytes", "cpu_bytes_to_use")
    if cpu is None:
        raise _fail("cpu_bytes", 'missing: the CPU tier\'s budget, e.g. "64GiB"')
    cpu_bytes = _size(*cpu)
    cache_policy, module_path, vllm_policy = _policy(config)
    disk_dir, disk_bytes, redis_url = _lower_tiers(config)
    mooncake = _mooncake(config, redis_url)
    write_through = _bool("write_through", config.get("write_through", False))
    if write_through and disk_dir is None and redis_url is None and not mooncake:
        raise _fail("write_through", "needs a lower tier (disk_dir, redis_url or mooncake_url)")
    _check_vllm_keys(config)
    store_threshold = _nonneg_int("store_threshold", config.get("store_threshold", 0))
    max_tracker_size = _nonneg_int("max_tracker_size", config.get("max_tracker_size", 64_000))
    if max_tracker_size == 0:
        raise _fail("max_tracker_size", "must be positive")
    return KVOffloadSettings(
        cpu_bytes=cpu_bytes,
        cache_policy=cache_policy,
        disk_dir=disk_dir,
        disk_bytes=disk_bytes,
        redis_url=redis_url,
        mooncake=mooncake,
        write_through=write_through,
        store_threshold=store_threshold,
        max_tracker_size=max_tracker_size,
        tier_poll_interval_s=_poll_interval(config),
        cache_policy_module_path=module_path,
        vllm_eviction_policy=vllm_policy,
    )
