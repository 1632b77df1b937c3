"""Every failure a user can cause ends in one line on stderr and exit status 2.

A table of bad invocations across every command (``run``, ``bench *``,
``events``) runs in-process through ``kvoffload.cli.main.main`` (fast); a
handful more run as real subprocesses (the console entry, a real second
process holding a disk directory). Environments the cases need (a truncated
checkpoint, a locked or foreign disk directory, a Redis that wants a password)
are built by fixtures; ``@name@`` placeholders in an argv are replaced by them.
"""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvoffload.cli.main import main
from tests.conftest_redis import RedisServer, find_server_binary, free_port

BIG = str(10**12)

# (id, argv). Values that must be refused by the argument parser or before any work.
INT_FLAGS_RUN = (
    "--block-size",
    "--gpu-blocks",
    "--max-num-seqs",
    "--max-num-batched-tokens",
    "--cpu-blocks",
    "--disk-blocks",
    "--requests",
    "--concurrency",
)
BAD_INTS = ("x", "0", "-1", "nan", "", "1.5")

CASES: list[tuple[str, list[str]]] = []


def case(name: str, *argv: str) -> None:
    CASES.append((name, list(argv)))


# -- top level -------------------------------------------------------------------------
case("no command")
case("unknown command", "serve")
case("bench without name", "bench")
case("unknown bench", "bench", "nope")
case("unknown flag", "run", "--nope")
case("stray positional", "run", "extra")

# -- run: every integer flag x every bad value ----------------------------------------------
for flag in INT_FLAGS_RUN:
    for value in BAD_INTS:
        case(f"run {flag} {value!r}", "run", flag, value)
case("run --gpu-blocks 1", "run", "--gpu-blocks", "1")
case("run --gpu-blocks 1e9", "run", "--gpu-blocks", "1000000000")
case("run --gpu-blocks 2**40", "run", "--gpu-blocks", str(2**40))
case("run --cpu-blocks 1e12", "run", "--cpu-blocks", BIG)
case("run --cpu-blocks 1e9 (memory)", "run", "--cpu-blocks", "1000000000")
case("run --block-size 1e6", "run", "--block-size", "1000000")
case("run --block-size 60000 (memory)", "run", "--block-size", "60000")
case("run --requests 1e8", "run", "--requests", "100000000")
case("run --concurrency 1e9", "run", "--concurrency", "1000000000")
for value in ("x", "0", "-5MiB", "nan", "inf", "1.5B", "5XB", "", "1000TiB", "1TiB"):
    case(f"run --cpu-bytes {value!r}", "run", "--cpu-bytes", value)
for value in ("x", "-1", "1.5", str(2**40)):
    case(f"run --seed {value!r}", "run", "--seed", value)
case("run --kv-layout bogus", "run", "--kv-layout", "bogus")
case("run --hash-fn bogus", "run", "--hash-fn", "bogus")
case("run --store-mode bogus", "run", "--store-mode", "bogus")
case("run --policy bogus", "run", "--policy", "bogus", "--requests", "1")
case("run --model missing", "run", "--model", "/nonexistent/model")
case("run --model ''", "run", "--model", "")
case("run --model is a file", "run", "--model", "@file@")
case("run --model without config", "run", "--model", "@empty_dir@")
case("run --model garbage config", "run", "--model", "@garbage_config_model@")
case("run --model no weights", "run", "--model", "@config_only_model@")
case("run --model truncated safetensors", "run", "--model", "@truncated_model@")
case("run --model garbage safetensors", "run", "--model", "@garbage_weights_model@")
case("run --disk-dir ''", "run", "--disk-dir", "")
case("run --disk-dir blank", "run", "--disk-dir", "   ")
case("run --disk-dir is a file", "run", "--disk-dir", "@file@", "--requests", "1")
case("run --disk-dir under a file", "run", "--disk-dir", "@file@/sub", "--requests", "1")
case("run --disk-dir in /proc", "run", "--disk-dir", "/proc/kvoffload-test", "--requests", "1")
case("run --disk-dir garbage manifest", "run", "--disk-dir", "@garbage_manifest_dir@")
case("run --disk-dir foreign manifest", "run", "--disk-dir", "@foreign_manifest_dir@")
case("run --disk-dir locked", "run", "--disk-dir", "@locked_dir@", "--requests", "1")
case("run --disk-blocks 1e12", "run", "--disk-dir", "@empty_dir@/d", "--disk-blocks", BIG)
case("run --redis-url ''", "run", "--redis-url", "")
case("run --redis-url http", "run", "--redis-url", "http://127.0.0.1:6379/0")
case("run --redis-url no host", "run", "--redis-url", "redis://")
case("run --redis-url bad port", "run", "--redis-url", "redis://127.0.0.1:99999/0")
case("run --redis-url bad db", "run", "--redis-url", "redis://127.0.0.1:6379/x")
case("run --redis-url refused", "run", "--redis-url", "@refused_redis@", "--requests", "1")
case("run --redis-url password", "run", "--redis-url", "@password_redis@", "--requests", "1")
case("run --redis-url wrong password", "run", "--redis-url", "@wrong_password_redis@")
case("run --redis-url db 999", "run", "--redis-url", "@db999_redis@", "--requests", "1")
case("run --events-endpoint garbage", "run", "--events-endpoint", "garbage")
case("run --events-endpoint ''", "run", "--events-endpoint", "")
case("run --events-endpoint bad host", "run", "--events-endpoint", "tcp://no.such.host.invalid:1")
case("run --events-replay-endpoint garbage", "run", "--events-replay-endpoint", "x")

# -- bench blocks ------------------------------------------------------------------------------
for flag in ("--blocks", "--ops"):
    for value in ("x", "0", "-1", "nan", BIG):
        case(f"blocks {flag} {value}", "bench", "blocks", flag, value)
for value in ("-1", "nan", "inf", "0", "x", "1e9"):
    case(f"blocks --baseline-seconds {value}", "bench", "blocks", "--baseline-seconds", value)
case("blocks --seed x", "bench", "blocks", "--seed", "x")

# -- bench offload -----------------------------------------------------------------------------
OFF = ("bench", "offload", "--no-vllm")
for value in ("x", "0", "-1", BIG):
    case(f"offload --requests {value}", *OFF, "--requests", value)
case("offload --seed x", *OFF, "--seed", "x")
case("offload --zipf nan", *OFF, "--zipf", "nan")
case("offload --trace missing", *OFF, "--trace", "/nonexistent.jsonl")
case("offload --trace dir", *OFF, "--trace", "@empty_dir@")
case("offload --trace garbage", *OFF, "--trace", "@garbage_trace@")
case("offload --trace empty", *OFF, "--trace", "@empty_trace@")
case("offload --generate bogus", *OFF, "--generate", "bogus")
for value in ("x", "0", "-5%", "nan%", "5%x"):
    case(f"offload --capacity {value}", *OFF, "--requests", "20", "--capacity", value)
case("offload --policies bogus", *OFF, "--requests", "20", "--policies", "bogus")
case("offload --policies comma", *OFF, "--requests", "20", "--policies", ",")
case("offload --out file", *OFF, "--out", "@file@")

# -- bench transfer ----------------------------------------------------------------------------
TR = ("bench", "transfer", "--quick")
for value in ("x", "0", "", ",", "1TiB", "1000", "-1KiB", "nan"):
    case(f"transfer --sizes {value!r}", *TR, "--sizes", value)
for flag in ("--blocks", "--layers", "--kv-heads", "--head-size", "--repeats", "--threads"):
    case(f"transfer {flag} 0", *TR, flag, "0")
    case(f"transfer {flag} x", *TR, flag, "x")
case("transfer --blocks 1e12", *TR, "--blocks", BIG)
case("transfer --dtype bogus", *TR, "--dtype", "bogus")
case("transfer --device bogus", *TR, "--device", "bogus")
case("transfer --layout bogus", *TR, "--layout", "bogus")
case("transfer --pattern bogus", *TR, "--pattern", "bogus")
case("transfer --seed -1", *TR, "--seed", "-1")

# -- bench serve -------------------------------------------------------------------------------
SV = ("bench", "serve")
for value in ("x", "0", "-1", "100000000"):
    case(f"serve --requests {value}", *SV, "--requests", value)
case("serve --concurrency 0", *SV, "--concurrency", "0")
case("serve --gpu-blocks 1e9", *SV, "--gpu-blocks", "1000000000")
case("serve --cpu-bytes 1000TiB", *SV, "--cpu-bytes", "1000TiB")
case("serve --block-size 0", *SV, "--block-size", "0")
case("serve --policies bogus", *SV, "--policies", "bogus")
case("serve --policies comma", *SV, "--policies", ",")
case("serve --policy bogus", *SV, "--policy", "bogus")
case("serve --redis-url ''", *SV, "--redis-url", "")
case("serve --disk-dir ''", *SV, "--disk-dir", "")
case("serve --out file", *SV, "--out", "@file@")
case("serve --mooncake missing", *SV, "--mooncake", "/nonexistent.jsonl")
case("serve --mooncake ''", *SV, "--mooncake", "")
case("serve --mooncake garbage", *SV, "--mooncake", "@garbage_trace@")
case("serve --mooncake empty", *SV, "--mooncake", "@empty_trace@")
case("serve --mooncake --gpu-blocks 1e9", *SV, "--mooncake", "@trace@", "--gpu-blocks", BIG)
case("serve --mooncake --policy bogus", *SV, "--mooncake", "@trace@", "--policy", "bogus")
case("serve --mooncake --policies bogus", *SV, "--mooncake", "@trace@", "--policies", "x,y")
case("serve --mooncake --redis-url", *SV, "--mooncake", "@trace@", "--redis-url", "@refused_redis@")
case("serve --mooncake --disk-dir", *SV, "--mooncake", "@trace@", "--disk-dir", "@empty_dir@")
case("serve --mooncake --model", *SV, "--mooncake", "@trace@", "--model", "@empty_dir@")
case("serve --mooncake --events", *SV, "--mooncake", "@trace@", "--events-endpoint", "tcp://*:1")
case("serve --mooncake --cpu-bytes", *SV, "--mooncake", "@trace@", "--cpu-bytes", "1GiB")

# -- bench tiers -------------------------------------------------------------------------------
TI = ("bench", "tiers", "--skip-redis")
for value in ("x", "0", "", ",", "2GiB", "nan"):
    case(f"tiers --block-sizes {value!r}", *TI, "--block-sizes", value)
for value in ("x", "0", "1000TiB", "-1"):
    case(f"tiers --total {value}", *TI, "--total", value)
case("tiers --total 1TiB (memory)", *TI, "--total", "1TiB")
case("tiers --batch 0", *TI, "--batch", "0")
case("tiers --io-threads 0", *TI, "--io-threads", "0")
case("tiers --io-threads 1e6", *TI, "--io-threads", "1000000")
case("tiers --disk-dir ''", *TI, "--disk-dir", "")
case(
    "tiers --disk-dir file",
    *TI,
    "--disk-dir",
    "@file@",
    "--block-sizes",
    "64KiB",
    "--total",
    "1MiB",
)
case("tiers --redis-url ''", "bench", "tiers", "--skip-disk", "--redis-url", "")
case(
    "tiers --redis-url refused",
    *("bench", "tiers", "--skip-disk", "--block-sizes", "64KiB", "--total", "1MiB"),
    *("--redis-url", "@refused_redis@"),
)
case(
    "tiers --redis-url password",
    *("bench", "tiers", "--skip-disk", "--block-sizes", "64KiB", "--total", "1MiB"),
    *("--redis-url", "@password_redis@"),
)

# -- bench threads -----------------------------------------------------------------------------
for flag in ("--requests", "--busy", "--repeat"):
    case(f"threads {flag} 0", "bench", "threads", flag, "0")
    case(f"threads {flag} x", "bench", "threads", flag, "x")
case("threads --env garbage", "bench", "threads", "--env", "garbage")

# -- events ------------------------------------------------------------------------------------
for value in ("nan", "-1", "0", "inf", "x", ""):
    case(f"events --timeout {value!r}", "events", "--timeout", value)
for value in ("0", "x", "-3"):
    case(f"events --max-batches {value}", "events", "--max-batches", value)
for value in ("-1", "x", str(2**64)):
    case(
        f"events --from-seq {value}",
        "events",
        "--from-seq",
        value,
        "--replay-endpoint",
        "tcp://127.0.0.1:1",
    )
case("events --from-seq without replay", "events", "--from-seq", "5", "--timeout", "1")
case("events --endpoint garbage", "events", "--endpoint", "garbage")
case("events --endpoint ''", "events", "--endpoint", "")
case("events --endpoint udp", "events", "--endpoint", "udp://127.0.0.1:1")
case("events --replay-endpoint garbage", "events", "--replay-endpoint", "garbage", "--timeout", "1")
case(
    "events --endpoint bad host",
    "events",
    "--endpoint",
    "tcp://no.such.host.invalid:1",
    "--timeout",
    "1",
)


# -- environments --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    root = tmp_path_factory.mktemp("bad-input")
    places: dict[str, str] = {}
    f = root / "a-file"
    f.write_text("not a directory\n")
    places["file"] = str(f)
    (root / "empty").mkdir()
    places["empty_dir"] = str(root / "empty")

    from kvoffload.engine.checkpoint import save_model
    from kvoffload.engine.model import build_model
    from kvoffload.engine.model_config import ModelConfig

    good = save_model(
        build_model(ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16)),
        root / "good-model",
    )  # fmt: skip
    weights = (good / "model.safetensors").read_bytes()
    config = (good / "config.json").read_text()
    for name, cfg, data in (
        ("garbage_config_model", "{not json", None),
        ("config_only_model", config, None),
        ("truncated_model", config, weights[: len(weights) // 2]),
        ("garbage_weights_model", config, b"\x07garbage" * 100),
    ):
        d = root / name
        d.mkdir()
        (d / "config.json").write_text(cfg)
        if data is not None:
            (d / "model.safetensors").write_bytes(data)
        places[name] = str(d)

    for name, manifest in (
        ("garbage_manifest_dir", "\x00\x01garbage{"),
        ("foreign_manifest_dir", json.dumps({"format": "someone-else", "version": 99})),
    ):
        d = root / name
        d.mkdir()
        (d / "manifest.json").write_text(manifest)
        places[name] = str(d)

    locked = root / "locked"
    locked.mkdir()
    # A second process holds the directory's lock, as a running engine would.
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import fcntl, os, sys, time\n"
            f"fd = os.open({str(locked / '.lock')!r}, os.O_RDWR | os.O_CREAT, 0o644)\n"
            "fcntl.flock(fd, fcntl.LOCK_EX)\n"
            "print('locked', flush=True)\n"
            "time.sleep(600)\n",
        ],
        stdout=subprocess.PIPE,
    )
    assert holder.stdout is not None
    assert holder.stdout.readline().strip() == b"locked"
    places["locked_dir"] = str(locked)

    trace = root / "trace.jsonl"
    trace.write_text(
        "\n".join(
            json.dumps(
                {"timestamp": i, "input_length": 1024, "output_length": 8, "hash_ids": [0, 1, i]}
            )
            for i in range(2, 12)
        )
        + "\n"
    )
    places["trace"] = str(trace)
    (root / "garbage.jsonl").write_text('{"timestamp": 1}\nnot json at all\n')
    places["garbage_trace"] = str(root / "garbage.jsonl")
    (root / "empty.jsonl").write_text("")
    places["empty_trace"] = str(root / "empty.jsonl")

    places["refused_redis"] = f"redis://127.0.0.1:{free_port()}/0"
    servers: list[RedisServer] = []
    binary = find_server_binary()
    if binary is not None:
        (root / "redis").mkdir()
        pw = RedisServer(binary, root / "redis").start()
        servers.append(pw)
        import redis

        # Started open (the helper waits on a PING), then made to want a password.
        client = redis.Redis(host="127.0.0.1", port=pw.port)
        client.config_set("requirepass", "x")
        client.close()
        places["password_redis"] = f"redis://127.0.0.1:{pw.port}/0"
        places["wrong_password_redis"] = f"redis://:wrong@127.0.0.1:{pw.port}/0"
        (root / "redis2").mkdir()
        plain = RedisServer(binary, root / "redis2").start()
        servers.append(plain)
        places["db999_redis"] = f"redis://127.0.0.1:{plain.port}/999"
    try:
        yield places
    finally:
        holder.kill()
        holder.wait()
        for s in servers:
            s.kill()


def _fill(argv: list[str], places: dict[str, str]) -> list[str]:
    out = []
    for a in argv:
        for name, value in places.items():
            a = a.replace(f"@{name}@", value)
        if "@" in a and a.count("@") >= 2 and a.split("@")[1].endswith(("redis", "_dir")):
            pytest.skip(f"environment {a} not available (no redis-server?)")
        out.append(a)
    return out


def _assert_one_line(code: object, err: str, argv: list[str]) -> None:
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, f"{argv}: exit {code!r}, stderr: {err!r}"
    assert len(lines) == 1, f"{argv}: {len(lines)} lines on stderr:\n{err}"
    assert lines[0].startswith("kvoffload: error: "), lines[0]
    assert "Traceback" not in err
    print(lines[0])  # shown with pytest -rP: the message itself is worth reading


def test_the_table_is_large() -> None:
    assert len(CASES) >= 150
    assert len({name for name, _ in CASES}) == len(CASES)


@pytest.mark.parametrize(("name", "argv"), CASES, ids=[name for name, _ in CASES])
def test_bad_invocation_is_one_line(
    name: str,
    argv: list[str],
    env: dict[str, str],
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.chdir(tmp_path)  # bench outputs (bench-serve/ ...) land in a temp dir
    monkeypatch.delenv("KVOFFLOAD_DEBUG", raising=False)
    argv = _fill(argv, env)
    try:
        code: object = main(argv)
    except SystemExit as exc:
        code = exc.code
    _assert_one_line(code, capsys.readouterr().err, argv)


def test_unexpected_errors_are_one_line_with_a_debug_hint(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import kvoffload.bench.core.blocks as blocks

    def boom(*_: object) -> dict[str, object]:
        raise KeyError("surprise\nsecond line")

    monkeypatch.setattr(blocks, "bench", boom)
    monkeypatch.delenv("KVOFFLOAD_DEBUG", raising=False)
    code = main(["bench", "blocks"])
    err = capsys.readouterr().err
    _assert_one_line(code, err, ["bench", "blocks"])

    class Strange(Exception):
        pass

    def strange(*_: object) -> dict[str, object]:
        raise Strange("odd")

    monkeypatch.setattr(blocks, "bench", strange)
    code = main(["bench", "blocks"])
    err = capsys.readouterr().err
    _assert_one_line(code, err, ["bench", "blocks"])
    assert "Strange" in err and "KVOFFLOAD_DEBUG=1" in err
    monkeypatch.setenv("KVOFFLOAD_DEBUG", "1")
    with pytest.raises(Strange):
        main(["bench", "blocks"])


SUBPROCESS_CASES = [
    ["run", "--gpu-blocks", "1000000000"],
    ["run", "--redis-url", ""],
    ["run", "--disk-dir", "@locked_dir@", "--requests", "1"],
    ["run", "--model", "@truncated_model@"],
    ["events", "--timeout", "nan"],
    ["bench", "blocks", "--baseline-seconds", "-1"],
    ["bench", "transfer", "--sizes", "1TiB"],
]


@pytest.mark.parametrize("argv", SUBPROCESS_CASES, ids=[" ".join(a) for a in SUBPROCESS_CASES])
def test_bad_invocation_as_a_process(argv: list[str], env: dict[str, str]) -> None:
    argv = _fill(argv, env)
    environ = {k: v for k, v in os.environ.items() if k != "KVOFFLOAD_DEBUG"}
    proc = subprocess.run(
        [sys.executable, "-m", "kvoffload.cli.main", *argv],
        capture_output=True,
        text=True,
        timeout=120,
        env=environ,
    )
    _assert_one_line(proc.returncode, proc.stderr, argv)


def test_lock_holder_really_holds(env: dict[str, str]) -> None:
    fd = os.open(Path(env["locked_dir"]) / ".lock", os.O_RDWR)
    try:
        with pytest.raises(BlockingIOError):
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        os.close(fd)


NAMED = [
    (["run", "--disk-dir", "@locked_dir@", "--requests", "1"], "in use by another process"),
    (["run", "--disk-dir", "@garbage_manifest_dir@"], "manifest"),
    (["run", "--model", "@truncated_model@"], "not a valid safetensors file"),
    (["run", "--redis-url", "@refused_redis@"], "cannot reach Redis"),
    (["run", "--redis-url", "@password_redis@"], "needs a password"),
    (["run", "--redis-url", "@db999_redis@"], "DB index is out of range"),
    (["bench", "tiers", "--skip-disk", "--redis-url", "@password_redis@"], "needs a password"),
    (["bench", "tiers", "--skip-redis", "--disk-dir", "@file@"], "is not a directory"),
    (["run", "--gpu-blocks", "1000000000"], "of memory is available"),
]


@pytest.mark.parametrize(("argv", "words"), NAMED, ids=[w for _, w in NAMED])
def test_the_line_names_the_problem(
    argv: list[str], words: str, env: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    argv = _fill(argv, env)
    assert main(argv) == 2
    err = capsys.readouterr().err
    _assert_one_line(2, err, argv)
    assert words in err


def test_allocator_errors_read_as_out_of_memory(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import kvoffload.bench.core.blocks as blocks

    def oom(*_: object) -> dict[str, object]:
        raise RuntimeError(
            "DefaultCPUAllocator: can't allocate memory: you tried to allocate 1099511627776 bytes"
        )

    monkeypatch.setattr(blocks, "bench", oom)
    assert main(["bench", "blocks"]) == 2
    err = capsys.readouterr().err
    _assert_one_line(2, err, ["bench", "blocks"])
    assert "out of memory" in err and "unexpected" not in err
