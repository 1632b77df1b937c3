"""``connector_build``: what KVOffloadConnector hands the spec vLLM builds inside it."""

from tests.vllm_required import need_vllm

need_vllm()

import threading  # noqa: E402
from pathlib import Path  # noqa: E402

from kvoffload.integrations.vllm.groups.group_kinds import describe_groups  # noqa: E402
from kvoffload.integrations.vllm.scheduler.connector_build import connector_build, current_build  # noqa: E402
from tests.integrations.vllm_rig import VLLMRig, kv_cache_config  # noqa: E402


def test_the_build_is_seen_only_within_its_span_and_thread() -> None:
    config = kv_cache_config(12)
    assert current_build() is None
    seen_elsewhere: list[object] = []
    with connector_build(config) as build:
        assert current_build() is build
        assert build.groups == describe_groups(config) and build.groups
        with connector_build(config) as inner:
            assert current_build() is inner
        assert current_build() is build  # nesting restores the outer build
        other = threading.Thread(target=lambda: seen_elsewhere.append(current_build()))
        other.start()
        other.join()
    assert seen_elsewhere == [None]  # another engine built on another thread
    assert current_build() is None


def test_the_spec_built_under_kvoffload_connector_knows_the_groups(tmp_path: Path) -> None:
    rig = VLLMRig.build(tmp_path, extra_config={"cpu_bytes": "1MiB"})
    spec = rig.worker_connector.connector_worker.spec
    assert spec.group_descriptions == describe_groups(kv_cache_config(12))
    assert current_build() is None  # nothing outlives the constructor
    rig.shutdown()
