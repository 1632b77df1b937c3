"""scripts/gpu_check.py runs every step on CPU tensors (``--cpu-smoke``), so a lent GPU's
minutes are not spent finding a typo."""

from tests.vllm_required import need_vllm

need_vllm()

import importlib.util  # noqa: E402
import json  # noqa: E402
from pathlib import Path  # noqa: E402

SCRIPT = Path(__file__).resolve().parents[3] / "scripts" / "gpu_check.py"


def test_gpu_check_cpu_smoke(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    argv = [
        "--cpu-smoke",
        "--out",
        str(tmp_path),
        "--job-gib",
        "0.004",
        "--reps",
        "1",
        "--tokens-per-block",
        "16",
    ]
    assert module.main(argv) == 0
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["worker"]["ok"] and report["worker"]["bytes_verified"] > 0
    (row,) = report["bandwidth"]
    assert row["store_GBps"] > 0 and row["load_GBps"] > 0
