"""The hybrid replay's per-group hit logic (vLLM's fixed point) and its unit-layer rows."""

import argparse
import json

import pytest

from kvoffload.bench.policy import hybrid_replay as hr
from kvoffload.offload import OffloadKey
from tests.offload.keyutil import key


class _Set(hr._Side):
    """A tier that holds exactly ``held``."""

    def __init__(self, held: set[OffloadKey]) -> None:
        self.held = held

    def prefix(self, keys):  # type: ignore[no-untyped-def]
        n = 0
        for k in keys:
            if k not in self.held:
                break
            n += 1
        return n

    def has(self, k: OffloadKey) -> bool:
        return k in self.held


def _keys(n: int, groups: int) -> list[list[OffloadKey]]:
    return [[key(i, g) for i in range(n)] for g in range(groups)]


def test_hit_is_the_fixed_point_over_groups() -> None:
    keys = _keys(10, 2)
    full = set(keys[0])
    # The window group holds chunks 2-3 and 6: a 2-chunk window fits at 4, not at 7.
    held = full | {key(i, 1) for i in (2, 3, 6)}
    assert hr.hit_chunks(_Set(held), keys, [None, 2], 9) == 4
    # Full attention stops at 3: the window must end there (chunks 1-2), it has only 2.
    held = set(keys[0][:3]) | {key(i, 1) for i in (2, 3, 6)}
    assert hr.hit_chunks(_Set(held), keys, [None, 2], 9) == 0
    # A run from the chain's head needs no full window.
    held = set(keys[0][:1]) | {key(0, 1)}
    assert hr.hit_chunks(_Set(held), keys, [None, 4], 9) == 1


def test_units_beat_per_key_on_long_prompts() -> None:
    t = 256
    layout = hr.layouts(t)["4g-w1024"]
    prompts = hr.long_prompts(60, 8192, t, seed=1)
    unique = len({c for p in prompts for c in p}) * len(layout)
    slots = unique // 8
    units = hr.replay(hr._Ours(slots, layout), "u", prompts, layout)
    per_key = hr.replay(hr._Ours(slots, None), "k", prompts, layout)
    assert units.hit_rate > per_key.hit_rate
    assert units.tokens == per_key.tokens == sum(len(p) for p in prompts) * t


def test_json_report_without_vllm(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    hr.add_arguments(parser)
    args = parser.parse_args(
        [
            "--requests=8",
            "--prompt-tokens=2048",
            "--tokens-per-chunk=256",
            "--layouts=2g-w128",
            "--mooncake=",
            "--capacity=0.3",
            "--no-vllm",
            "--json",
        ]
    )
    assert hr.run(args) == 0
    report = json.loads(capsys.readouterr().out)
    (point,) = report["points"]
    assert set(point["rows"]) == {r for r in hr.ROWS if not r.startswith("vllm:")}
    assert [g["slot_bytes"] for g in point["groups"]] == [256 * 4096] * 2
