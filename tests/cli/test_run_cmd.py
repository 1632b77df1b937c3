import json
import subprocess
import sys

from kvoffload.cli.main import main

KEYS = {
    "requests",
    "hit_rate_gpu",
    "hit_rate_cpu",
    "prefill_tokens_computed",
    "prefill_tokens_total",
    "ttft_p50_s",
    "ttft_p99_s",
}


def test_kvoffload_run_subprocess_json() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "kvoffload.cli", "run", "--requests", "16", "--json"],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary.keys() >= KEYS
    assert summary["requests"] == 16
    assert 0 < summary["prefill_tokens_computed"] <= summary["prefill_tokens_total"]
    assert 0 <= summary["hit_rate_gpu"] <= 1 and 0 <= summary["hit_rate_cpu"] <= 1


def test_run_prints_table(capsys) -> None:
    assert main(["run", "--requests", "8"]) == 0
    out = capsys.readouterr().out
    assert "prefix hit rate, CPU tier" in out and "TTFT p99" in out


def test_bad_flag_values_are_clear_errors(capsys) -> None:
    for argv in (
        ["run", "--gpu-blocks", "0"],
        ["run", "--cpu-bytes", "lots"],
        ["run", "--store-mode", "sometimes"],
    ):
        try:
            rc = main(argv)
        except SystemExit as exc:  # argparse rejects it with a message naming the flag
            rc = exc.code
        assert rc not in (0, None)
    err = capsys.readouterr().err
    assert "--gpu-blocks" in err and "--cpu-bytes" in err and "--store-mode" in err


def test_unknown_policy_is_a_clear_error(capsys) -> None:
    assert main(["run", "--requests", "2", "--policy", "mru"]) == 2
    assert "mru" in capsys.readouterr().err


def test_bench_serve_compares_configurations(tmp_path, capsys) -> None:
    rc = main(
        [
            "bench",
            "serve",
            "--requests",
            "24",
            "--policies",
            "lru",
            "--cpu-blocks",
            "1024",
            "--out",
            str(tmp_path),
            "--json",
        ]
    )
    assert rc == 0
    report = json.loads(capsys.readouterr().out)
    by_label = {r["label"]: r for r in report["results"]}
    default = report["settings"]["default_policy"]
    eager = f"eager/{default}*"  # the default policy's row, marked
    assert {"off", eager, "lazy", "eager/lru"} <= by_label.keys()
    assert by_label["off"]["hit_rate_cpu"] == 0
    assert by_label[eager]["hit_rate_cpu"] > 0
    assert by_label[eager]["prefill_tokens_computed"] < by_label["off"]["prefill_tokens_computed"]
    assert (tmp_path / "serve.png").stat().st_size > 0
    assert "| off |" in (tmp_path / "serve.md").read_text()


def test_run_sends_the_session_hint_for_every_turn_but_a_conversations_last(
    monkeypatch, capsys
) -> None:
    from kvoffload.engine.connector.scheduler import OffloadingConnectorScheduler
    from kvoffload.engine.demo.serving import demo_workload
    from kvoffload.engine.demo.workload import continuing_request_ids, generate_trace
    from kvoffload.engine.llm_engine import LLMEngine

    sent: dict[str, bool] = {}
    vocab: list[int] = []
    continued: list[int] = []
    real_add = LLMEngine.add_request
    real_continues = OffloadingConnectorScheduler.request_continues

    def add_request(self, prompt, sampling=None, req_id=None, continues=False, **kw):  # type: ignore[no-untyped-def]
        sent[req_id] = continues
        vocab.append(self.runner.vocab_size)
        return real_add(self, prompt, sampling, req_id, continues, **kw)

    def request_continues(self, block_hashes):  # type: ignore[no-untyped-def]
        continued.append(len(block_hashes))
        return real_continues(self, block_hashes)

    monkeypatch.setattr(LLMEngine, "add_request", add_request)
    monkeypatch.setattr(OffloadingConnectorScheduler, "request_continues", request_continues)
    assert main(["run", "--requests", "24", "--json"]) == 0
    capsys.readouterr()
    trace = list(generate_trace(demo_workload(vocab[0], num_requests=24)))
    expected = continuing_request_ids(trace)
    assert expected and len(expected) < len(trace)
    assert {r for r, c in sent.items() if c} == expected
    assert len(continued) == len(expected)  # each reached the connector when it finished
