"""Offload changes nothing: compare two runs' sampled logits rows and tokens bit for bit.

``kvoffload run --verify`` serves the workload once with offload off and once
with the chosen store mode, records every sampled logits row
(``EngineConfig.record_logits``) and compares them here. Rows are compared
as raw bytes (so ``-0.0`` vs ``0.0`` or two NaN payloads count as
different): "no difference" means the offloaded KV gave the very same bits.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvoffload.engine.llm_engine import RequestOutput


@dataclass
class RecordedRequest:
    """What one request produced: its tokens and the logits row behind each."""

    tokens: list[int]
    logits: torch.Tensor | None  # [len(tokens), vocab]


@dataclass
class Recorder:
    """An ``on_output`` callback that keeps each request's tokens and logits rows."""

    outputs: dict[str, RecordedRequest] = field(default_factory=dict)

    def __call__(self, out: RequestOutput) -> None:
        self.outputs[out.req_id] = RecordedRequest(list(out.output_token_ids), out.logits)


@dataclass
class VerifyReport:
    rows_total: int  # sampled logits rows of the reference run
    rows_differing: int
    tokens_total: int
    tokens_differing: int
    requests_missing: int  # in one run but not the other
    max_abs_diff: float  # over rows present in both runs (0.0 when identical)

    @property
    def identical(self) -> bool:
        return self.rows_differing == 0 and self.tokens_differing == 0

    def line(self) -> str:
        return (
            f"verify: {self.rows_differing} of {self.rows_total} logits rows differ, "
            f"{self.tokens_differing} tokens differ"
        )

    def as_dict(self) -> dict[str, object]:
        return {**self.__dict__, "identical": self.identical}


def _row_bytes(t: torch.Tensor) -> torch.Tensor:
    """``[rows, vocab]`` of any dtype as ``[rows, bytes]`` uint8, for a bitwise compare."""
    t = t.detach().contiguous()
    return t.view(torch.uint8).reshape(t.shape[0], -1)


def compare(
    reference: dict[str, RecordedRequest], other: dict[str, RecordedRequest]
) -> VerifyReport:
    """Every logits row and token of ``other`` against ``reference``, request by request.

    A row or token present in one run only counts as differing.
    """
    rows_total = rows_diff = tokens_total = tokens_diff = missing = 0
    max_abs = 0.0
    for req_id in reference.keys() | other.keys():
        ref, got = reference.get(req_id), other.get(req_id)
        if ref is None or got is None:
            missing += 1
            only = ref or got
            assert only is not None
            n = len(only.tokens)
            rows_diff += n
            tokens_diff += n
            if ref is not None:
                rows_total += n
                tokens_total += n
            continue
        n_ref, n_got = len(ref.tokens), len(got.tokens)
        tokens_total += n_ref
        common = min(n_ref, n_got)
        tokens_diff += sum(a != b for a, b in zip(ref.tokens, got.tokens)) + abs(n_ref - n_got)
        ref_rows = 0 if ref.logits is None else ref.logits.shape[0]
        got_rows = 0 if got.logits is None else got.logits.shape[0]
        rows_total += ref_rows
        common = min(ref_rows, got_rows)
        rows_diff += abs(ref_rows - got_rows)
        if common:
            assert ref.logits is not None and got.logits is not None
            a, b = ref.logits[:common], got.logits[:common]
            if a.shape != b.shape or a.dtype != b.dtype:
                rows_diff += common
                continue
            differs = (_row_bytes(a) != _row_bytes(b)).any(dim=1)
            rows_diff += int(differs.sum())
            if bool(differs.any()):
                delta = (
                    (a[differs].double() - b[differs].double()).abs().nan_to_num(nan=float("inf"))
                )
                max_abs = max(max_abs, float(delta.max()))
    return VerifyReport(rows_total, rows_diff, tokens_total, tokens_diff, missing, max_abs)
