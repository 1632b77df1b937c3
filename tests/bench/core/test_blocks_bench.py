import json

from kvoffload.bench.core.blocks import bench, make_workload
from kvoffload.cli.main import main


def test_bench_blocks_reports_both_queues_doing_the_same_work() -> None:
    report = bench(2_000, 3_000, seed=1, baseline_seconds=60)
    assert report["intrusive_link_ops"] == report["list_link_ops"] > 0
    assert report["intrusive_mops"] > 0 and report["list_mops"] > 0


def test_workload_is_seeded() -> None:
    assert make_workload(100, 3) == make_workload(100, 3)
    assert make_workload(100, 3) != make_workload(100, 4)


def test_cli_json(capsys) -> None:
    assert main(["bench", "blocks", "--blocks", "500", "--ops", "500", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert {"intrusive_mops", "list_mops", "speedup"} <= out.keys()


def test_cli_bad_value(capsys) -> None:
    assert main(["bench", "blocks", "--blocks", "0"]) == 2
    assert "must be positive" in capsys.readouterr().err
