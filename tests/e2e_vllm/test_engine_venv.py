"""The engine venv is what the suite claims: vLLM's CPU build 0.32, kvoffload's compat accepts
it, torch's CPU build, and none of the CUDA torchvision / torchaudio / torchcodec that break
``from vllm import LLM`` on a CPU machine."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

_PROBE = r"""
import importlib.util, json
import torch
from vllm import LLM  # fails with CUDA torchvision installed
from kvoffload.integrations.vllm import compat
print(json.dumps({
    "vllm": list(compat.check_supported()),
    "torch": torch.__version__,
    "cuda": torch.cuda.is_available(),
    "leftovers": [m for m in ("torchvision", "torchaudio", "torchcodec")
                  if importlib.util.find_spec(m) is not None],
}))
"""


def test_engine_venv_has_the_cpu_build_and_no_cuda_extras(engine_python: Path) -> None:
    proc = subprocess.run(
        [str(engine_python), "-c", _PROBE], capture_output=True, text=True, timeout=300, check=False
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["vllm"] == [0, 32]
    assert report["torch"].startswith("2.13.0")
    assert not report["cuda"]
    assert report["leftovers"] == []
