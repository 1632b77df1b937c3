"""``kvoffload bench route`` at a small size: two engine processes, a Redis and Dynamo's indexer.

Checks the bench runs end to end and what it reports holds together; the
router-beats-round-robin target is a measurement (README), not asserted on
a dozen requests.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvoffload.cli.main import main
from tests.conftest_redis import find_server_binary
from tests.router.conftest import need_dynamo


def test_route_bench_small(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    need_dynamo()
    if find_server_binary() is None:
        pytest.skip("redis-server not installed")
    plot = tmp_path / "route.png"
    argv = ["bench", "route", "--instances", "2", "--requests", "10", "--routers"]
    argv += ["kv,round_robin", "--plot", str(plot), "--json"]
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    rows = report["results"]
    assert {(r["workload"], r["router"]) for r in rows} == {
        (w, r) for w in ("chat", "mooncake") for r in ("kv", "round_robin")
    }
    for r in rows:
        assert r["requests"] == 10
        assert sum(r["requests_per_instance"]) == 10
        hits = r["hit_rate_gpu"] + r["hit_rate_cpu"] + r["hit_rate_redis"]
        assert 0.0 <= hits <= 1.0
        assert 0 < r["prefill_tokens_computed"] <= r["prompt_tokens"]
        assert 0.0 <= r["sent_to_longest_prefix"] <= 1.0
    # The indexer was asked for every request: later chat turns find their
    # conversation's earlier blocks on some instance.
    chat = [r for r in rows if r["workload"] == "chat"]
    assert all(r["requests_with_holder"] > 0 for r in chat)
    assert report["prefill_vs_round_robin"]["chat/2/round_robin"] == 1.0
    assert plot.stat().st_size > 0
