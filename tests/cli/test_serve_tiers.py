"""A small CPU tier with disk or Redis behind it beats the CPU tier alone, in one run."""

import json

from kvoffload.cli.main import main


def serve_report(capsys, *extra: str) -> dict[str, dict]:
    argv = [
        "bench",
        "serve",
        "--requests",
        "40",
        "--policies",
        "lru",
        "--cpu-blocks",
        "24",
        "--json",
        *extra,
    ]
    assert main(argv) == 0
    return {r["label"]: r for r in json.loads(capsys.readouterr().out)["results"]}


def total_hit(r: dict) -> float:
    return r["hit_rate_gpu"] + r["hit_rate_cpu"] + r["hit_rate_lower"]


def test_disk_tier_behind_a_small_cpu_tier(tmp_path, capsys) -> None:
    rows = serve_report(capsys, "--disk-dir", str(tmp_path / "disk"), "--out", str(tmp_path))
    cpu_only, tiered = rows["eager"], rows["eager+disk"]
    assert tiered["hit_rate_lower"] > 0
    assert total_hit(tiered) > total_hit(cpu_only)
    assert tiered["prefill_tokens_computed"] < cpu_only["prefill_tokens_computed"]


def test_redis_tier_behind_a_small_cpu_tier(tmp_path, capsys, redis_server) -> None:
    rows = serve_report(capsys, "--redis-url", redis_server.url, "--out", str(tmp_path))
    cpu_only, tiered = rows["eager"], rows["eager+redis"]
    assert tiered["hit_rate_lower"] > 0
    assert total_hit(tiered) > total_hit(cpu_only)
    assert tiered["prefill_tokens_computed"] < cpu_only["prefill_tokens_computed"]
