"""Drive running vLLM OpenAI servers with real clients; run with the engine venv's Python.

``python openai_drive.py PLAN.json OUT.json``: for each server of the plan
(``{"servers": [{"name", "base_url", "model"}], "prompts": [[token ids]],
"max_tokens", "bench": {...}}``), in order:

1. the ``openai`` package's client sends every prompt (token ids) to
   ``/v1/completions``, one at a time, streaming, greedy, and joins the
   streamed text;
2. vLLM's own benchmark client (``vllm.benchmarks.serve``, what ``vllm bench
   serve`` runs) sends its ``prefix_repetition`` dataset, with its detailed
   results (generated texts) kept.

Writes ``{name: {"texts": [...], "bench": {"completed", "failed",
"generated_texts"}}}``. The test process never imports vLLM or ``openai``:
they live in the engine venv.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from typing import Any


def stream_completions(
    base_url: str, model: str, prompts: list[list[int]], max_tokens: int
) -> list[str]:
    import openai

    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", timeout=600)
    texts = []
    for prompt in prompts:
        stream = client.completions.create(
            model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True
        )
        texts.append("".join(chunk.choices[0].text for chunk in stream if chunk.choices))
    return texts


def bench_serve(base_url: str, model: str, bench: dict[str, Any]) -> dict[str, Any]:
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    with tempfile.TemporaryDirectory() as out:
        args = parser.parse_args(
            [
                "--base-url", base_url, "--model", model,
                "--dataset-name", "prefix_repetition",
                "--num-prompts", str(bench["num_prompts"]),
                "--prefix-repetition-prefix-len", str(bench["prefix_len"]),
                "--prefix-repetition-suffix-len", str(bench["suffix_len"]),
                "--prefix-repetition-num-prefixes", str(bench["num_prefixes"]),
                "--prefix-repetition-output-len", str(bench["output_len"]),
                "--seed", "0", "--ignore-eos", "--temperature", "0", "--disable-tqdm",
                "--save-result", "--save-detailed", "--result-dir", out,
                "--result-filename", "bench.json",
            ]
        )  # fmt: skip
        main(args)
        result = json.loads((Path(out) / "bench.json").read_text())
    return {k: result.get(k) for k in ("completed", "failed", "generated_texts", "errors")}


def drive(plan: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for server in plan["servers"]:
        url, model = server["base_url"], server["model"]
        out[server["name"]] = {
            "texts": stream_completions(url, model, plan["prompts"], plan["max_tokens"]),
            "bench": bench_serve(url, model, plan["bench"]),
        }
    return out


if __name__ == "__main__":
    plan_path, out_path = sys.argv[1:3]
    result = drive(json.loads(Path(plan_path).read_text()))
    Path(out_path).write_text(json.dumps(result))
