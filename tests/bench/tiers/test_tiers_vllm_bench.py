"""``bench tiers-vllm`` end to end on a tiny workload: one JSON object, figures for both tiers."""

from __future__ import annotations

from tests.vllm_required import need_vllm

need_vllm()

import argparse  # noqa: E402
import json  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

from kvoffload.bench.tiers import vllm_fs as tiers_vllm  # noqa: E402


def test_tiny_run_prints_one_json_object(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    parser = argparse.ArgumentParser()
    tiers_vllm.add_arguments(parser)
    args = parser.parse_args(
        [
            "--json",
            "--block-sizes",
            "256KiB",
            "--total",
            "2MiB",
            "--budget",
            "1MiB",
            "--dir",
            str(tmp_path),
        ]
    )
    assert tiers_vllm.run(args) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    (size,) = out["sizes"]
    assert size["block_bytes"] == 256 << 10
    for which in ("kvoffload", "vllm_fs"):
        fig = size[which]
        assert fig["write_mb_s"] > 0 and fig["read_mb_s"] > 0 and fig["read_misses"] == 0
    use = out["disk_use"]
    assert use["written_bytes"] == 2 * use["budget_bytes"]
    # kvoffload stays at its budget (plus its index); vLLM's fs tier holds everything written.
    assert use["bytes_in_use"]["kvoffload"] < 1.05 * use["budget_bytes"]
    assert use["bytes_in_use"]["vllm_fs"] >= use["written_bytes"]
    assert list(tmp_path.iterdir()) == []
