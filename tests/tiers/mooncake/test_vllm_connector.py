"""``KVOffloadConnector`` with ``mooncake_url``: vLLM 0.33's real scheduler, the Mooncake tier.

vLLM's scheduler and worker-side connector run in one process
(``tests.integrations.vllm_rig``); the fake model writes a pattern derived
from each block's hash, so every loaded block is checked byte for byte. A
prompt pushed out of the GPU and CPU tiers comes back from the Mooncake
Store; a second engine (its own scheduler and CPU tier, same master and
namespace) serves the first one's prompt from it.
"""

from __future__ import annotations

from tests.tiers.mooncake.required import need_mooncake
from tests.vllm_required import need_vllm

need_vllm()
need_mooncake()

from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import pytest  # noqa: E402

from kvoffload.integrations.vllm import KVOffloadConfigError, KVOffloadMooncakeTier  # noqa: E402
from kvoffload.integrations.vllm.settings import parse_settings  # noqa: E402
from tests.integrations.vllm_rig import BLOCK_SIZE, VLLMRig  # noqa: E402
from tests.tiers.mooncake.cluster import LoopbackMooncake  # noqa: E402

PROMPT = list(range(1, 81))  # 5 full blocks
PROMPT_BLOCKS = len(PROMPT) // BLOCK_SIZE
BLOCK_BYTES = 2 * 2048  # two layers of 16 tokens x 2 heads x 16 x fp16 x (K, V)


def flood(rig: VLLMRig, n: int = 3) -> None:
    for i in range(n):
        rig.add([1000 + 100 * i + j for j in range(len(PROMPT))], req_id=f"flood{i}")
    rig.run()


def extra(url: str) -> dict[str, Any]:
    return {"cpu_bytes": 6 * BLOCK_BYTES, "mooncake_url": url, "mooncake_namespace": "conn"}


def test_prompt_comes_back_from_mooncake_then_serves_a_second_engine(
    tmp_path: Path, mooncake: LoopbackMooncake
) -> None:
    rig = VLLMRig.build(tmp_path, extra_config=extra(mooncake.url))
    try:
        (tier,) = rig.manager.secondary_tiers
        assert isinstance(tier, KVOffloadMooncakeTier)
        rig.add(PROMPT, req_id="first")
        rig.run()
        flood(rig)
        rig.add([*PROMPT, 5, 6], req_id="again")
        rig.run()
        promoted = rig.manager.promotions_by_tier
        assert set(promoted) == {0} and 0 < promoted[0] <= PROMPT_BLOCKS
        assert rig.mismatches == [] and rig.bytes_verified > 0
    finally:
        rig.shutdown()
    other = VLLMRig.build(tmp_path, extra_config=extra(mooncake.url))
    try:
        other.add([*PROMPT, 7, 8], req_id="elsewhere")
        other.run()
        assert other.manager.promotions_by_tier.get(0, 0) > 0  # the first engine's blocks
        assert other.mismatches == [] and other.blocks_verified > 0
    finally:
        other.shutdown()


@pytest.mark.parametrize(
    ("config", "key"),
    [
        ({"mooncake_url": "mooncakestore://h"}, "mooncake_url"),
        ({"mooncake_protocol": "tcp"}, "mooncake_protocol"),
        ({"mooncake_url": "mooncakestore://h:1", "redis_url": "redis://h:1"}, "mooncake_url"),
        ({"mooncake_url": "mooncakestore://h:1", "mooncake_segment_bytes": "x"}, "segment"),
    ],
)
def test_bad_mooncake_settings_are_one_line(config: dict[str, Any], key: str) -> None:
    with pytest.raises(KVOffloadConfigError) as info:
        parse_settings({"cpu_bytes": "1MiB", **config})
    assert key in str(info.value) and "\n" not in str(info.value)
