import json

import pytest

from kvoffload.bench.mooncake import read_mooncake_trace, replay_mooncake
from kvoffload.cli.main import main


def write_trace(path, rows) -> None:
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")


def shared_prefix_trace(n: int = 60) -> list[dict]:
    rows = []
    for i in range(n):
        conv = i % 6
        turn = i // 6
        ids = [1000 + k for k in range(4)] + [conv * 100 + k for k in range(2 + turn)]
        rows.append(
            {
                "timestamp": i * 10,
                "input_length": 512 * len(ids),
                "output_length": 32,
                "hash_ids": ids,
            }
        )
    return rows


def test_read_trace_and_errors(tmp_path) -> None:
    p = tmp_path / "t.jsonl"
    write_trace(p, shared_prefix_trace(3))
    reqs = list(read_mooncake_trace(p))
    assert len(reqs) == 3 and reqs[0].hash_ids[:4] == [1000, 1001, 1002, 1003]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 5}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:1"):
        list(read_mooncake_trace(bad))


def test_cpu_tier_adds_hits_beyond_a_small_gpu_tier(tmp_path) -> None:
    p = tmp_path / "t.jsonl"
    write_trace(p, shared_prefix_trace())
    reqs = list(read_mooncake_trace(p))
    gpu_only = replay_mooncake(reqs, num_gpu_blocks=16, num_cpu_blocks=None, hold_requests=1)
    with_cpu = replay_mooncake(reqs, num_gpu_blocks=16, num_cpu_blocks=200, hold_requests=1)
    assert with_cpu.hit_rate_cpu > 0
    assert with_cpu.hit_rate_gpu + with_cpu.hit_rate_cpu > gpu_only.hit_rate_gpu
    # a huge GPU tier gets every repeated block without a CPU tier
    big = replay_mooncake(reqs, num_gpu_blocks=10_000, num_cpu_blocks=None)
    assert big.hit_rate_gpu >= with_cpu.hit_rate_gpu + with_cpu.hit_rate_cpu - 1e-9


def test_bench_serve_mooncake_cli(tmp_path, capsys) -> None:
    p = tmp_path / "t.jsonl"
    write_trace(p, shared_prefix_trace())
    rc = main(
        [
            "bench",
            "serve",
            "--mooncake",
            str(p),
            "--gpu-blocks",
            "12",
            "--cpu-blocks",
            "200",
            "--policies",
            "lru",
            "--json",
        ]
    )
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert out["results"]["cpu/lru"]["hit_rate_cpu"] > 0
