"""Two ``kvoffload run``s through one Mooncake master: the second serves the first's prefixes.

The first run stores its KV in the pool (a holder process contributes the
memory; both runs are pure clients); the second, with ``--verify``, serves
the same workload with offload off and then with the Mooncake tier, and its
logits must be bitwise equal while some blocks come from the store.
"""

from __future__ import annotations

import json

import pytest

from tests.tiers.mooncake.required import need_mooncake

need_mooncake()

from kvoffload.cli.main import main  # noqa: E402
from tests.tiers.mooncake.cluster import LoopbackMooncake  # noqa: E402


def run(capsys: pytest.CaptureFixture[str], url: str, *extra: str) -> dict:  # type: ignore[type-arg]
    args = ["run", "--requests", "6", "--cpu-blocks", "16", "--json", "--mooncake-url", url]
    assert main([*args, *extra]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])  # type: ignore[no-any-return]


def test_the_second_run_hits_the_first_runs_blocks_bitwise_equal(
    mooncake: LoopbackMooncake, capsys: pytest.CaptureFixture[str]
) -> None:
    first = run(capsys, mooncake.url, "--mooncake-namespace", "two-runs")
    assert first["hit_rate_lower"] == 0 and first["blocks_stored"] > 0  # a fresh namespace
    second = run(capsys, mooncake.url, "--mooncake-namespace", "two-runs", "--verify")
    assert second["verify"]["identical"] and second["verify"]["rows_total"] > 0
    off, on = second["results"]
    assert off["label"] == "off" and on["hit_rate_lower"] > 0 and on["blocks_loaded"] > 0
    assert on["prefill_tokens_computed"] < off["prefill_tokens_computed"]
