"""``kvoffload bench offload --suite``: every policy on a fixed set of trace families, held out.

A policy change is judged on traces it was not tuned on. The suite replays
generated families (``rag``, ``chat``, ``agent``, ``mixed``, ``conversation``,
``loop``, ``oneoff``; several seeds each) and every real trace
at hand (the Mooncake synthetic trace when found, and each ``--trace-file``;
a real trace is a family of one) at tiers of 1 / 5 / 10 / 25% of each
trace's unique blocks (loops at 50% too, where their working set is twice the
tier). Each point replays every candidate (the registered policies asked for,
and variants of the default with one class parameter changed: ``--vary``)
exactly as ``kvoffload bench offload`` does, beside vLLM 0.33's own ``lru``,
``arc`` and ``lru`` + ``store_threshold=2`` (``offload_vllm``, never hinted).

Reported, in hit-rate points against the best of vLLM's three at the same
point (``delta``; negative is a loss):

- per trace and size, every candidate's delta;
- per family, each candidate's worst delta (its worst loss) over the
  family's traces and sizes;
- leave one family out: for each family F, the candidate whose worst delta
  over all *other* families is highest (ties: the higher sum of deltas) is
  "chosen"; its worst delta on F is what a choice made without F gets on F.
  A candidate set whose held-out figures sit well below the in-sample ones
  is tuned to the traces, not to the workload.

Invariants: every candidate sees the same traces, sizes and hints; vLLM's
rows are computed once per point; the same suite size and seeds always give
the same traces, so two runs differ only where the code does.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

from kvoffload.bench.policy import vllm_replay as offload_vllm
from kvoffload.bench.policy.replay import (
    Trace,
    belady_hit_rate,
    parse_capacity,
    replay,
)
from kvoffload.bench.policy.traces import (
    LOOP_CAPACITY,
    generate,
    load_trace,
    trace_keys,
    trace_times,
)
from kvoffload.offload import policy_names
from kvoffload.offload.cpu_manager import DEFAULT_CACHE_POLICY
from kvoffload.offload.policies import BUILDING_BLOCKS, CachePolicy

#: Generated families, in report order.
FAMILIES = ("rag", "chat", "agent", "mixed", "conversation", "loop", "oneoff")
CAPACITIES = ("1%", "5%", "10%", "25%")
#: The real trace looked for when no ``--trace-file`` names it (next to the repository).
SHARED_TRACE = "mooncake_synthetic_trace.jsonl"
TRACE_DIR_ENV = "KVOFFLOAD_TRACE_DIR"
#: A candidate: a registered name or a building block's class.
PolicySpec = str | type[CachePolicy]


@dataclass(frozen=True)
class SuiteSize:
    """How many requests each generated trace has, and which seeds make them."""

    requests: int
    seeds: tuple[int, ...]


SIZES: dict[str, SuiteSize] = {
    # A few minutes on two busy cores (vLLM's three rows are most of it).
    "quick": SuiteSize(1500, (1, 2)),
    # Traces of the size the families' shapes were measured at, five seeds.
    "full": SuiteSize(6000, (1, 2, 3, 4, 5)),
}


@dataclass(frozen=True)
class SuiteTrace:
    family: str
    name: str
    keys: Trace
    times: Sequence[float]
    capacities: tuple[str, ...]


@dataclass(frozen=True)
class Variant:
    """The default policy with ``cls.attr = value`` for its replays (``--vary``)."""

    cls: type
    attr: str
    value: float

    @property
    def name(self) -> str:
        return f"{DEFAULT_CACHE_POLICY}[{self.cls.__name__}.{self.attr}={self.value:g}]"


@dataclass
class Point:
    """One trace at one size: Belady, vLLM's best, and each candidate's hit rate."""

    family: str
    trace: str
    label: str
    capacity: int
    belady: float
    vllm: dict[str, float]
    hit: dict[str, float] = field(default_factory=dict)

    @property
    def vllm_best(self) -> float:
        return max(self.vllm.values())

    def delta(self, candidate: str) -> float:
        """``candidate``'s hit rate minus vLLM's best, in points."""
        return 100.0 * (self.hit[candidate] - self.vllm_best)


def default_trace_files() -> list[Path]:
    """The shared Mooncake synthetic trace, where one is found (``$KVOFFLOAD_TRACE_DIR``,
    else ``../shared/traces`` beside the working directory)."""
    env = os.environ.get(TRACE_DIR_ENV)
    dirs = [Path(env)] if env else [Path.cwd().parent / "shared" / "traces"]
    return [d / SHARED_TRACE for d in dirs if (d / SHARED_TRACE).is_file()]


def suite_traces(size: str, trace_files: Sequence[str | Path]) -> list[SuiteTrace]:
    """The generated families at ``size`` (``SIZES``), then each real trace."""
    try:
        spec = SIZES[size]
    except KeyError:
        raise ValueError(f"unknown suite size {size!r}; known: {', '.join(SIZES)}") from None
    out = []
    for fam in FAMILIES:
        caps = (*CAPACITIES, LOOP_CAPACITY) if fam == "loop" else CAPACITIES
        for seed in spec.seeds:
            reqs = generate(fam, spec.requests, seed)
            out.append(SuiteTrace(fam, f"{fam}/{seed}", trace_keys(reqs), trace_times(reqs), caps))
    for path in trace_files:
        reqs = load_trace(path)
        name = Path(path).stem
        out.append(
            SuiteTrace(f"real:{name}", name, trace_keys(reqs), trace_times(reqs), CAPACITIES)
        )
    return out


def parse_variant(spec: str) -> list[Variant]:
    """``Class.attr=v1,v2`` (a policy class of ``kvoffload.offload.policies``) -> variants."""
    from kvoffload.offload import policies

    head, sep, values = spec.partition("=")
    cls_name, dot, attr = head.strip().partition(".")
    if not sep or not dot or not attr or not values.strip():
        raise ValueError(f"--vary {spec!r}: expected Class.attr=v1,v2,...")
    cls = _policy_class(policies, cls_name)
    if not hasattr(cls, attr) or callable(getattr(cls, attr)):
        raise ValueError(f"--vary {spec!r}: {cls_name} has no parameter {attr!r}")
    try:
        nums = [float(v) for v in values.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"--vary {spec!r}: values must be numbers") from None
    return [Variant(cls, attr, v) for v in nums]


def _policy_class(package: ModuleType, name: str) -> type:
    import importlib
    import pkgutil

    pkg_name = package.__name__
    for info in pkgutil.iter_modules(package.__path__):
        mod = importlib.import_module(f"{pkg_name}.{info.name}")
        cls = getattr(mod, name, None)
        if isinstance(cls, type):
            return cls
    raise ValueError(f"--vary: no class {name!r} in {pkg_name}")


@contextmanager
def _applied(variant: Variant | None) -> Iterator[None]:
    """``variant``'s parameter set on its class for the block, then put back."""
    if variant is None:
        yield
        return
    cls, attr = variant.cls, variant.attr
    had = attr in cls.__dict__
    old = cls.__dict__.get(attr)
    value: float = int(variant.value) if isinstance(old, int) else variant.value
    setattr(cls, attr, value)
    try:
        yield
    finally:
        if had:
            setattr(cls, attr, old)
        else:
            delattr(cls, attr)


def run_suite(
    traces: Sequence[SuiteTrace],
    policies: Sequence[str],
    variants: Sequence[Variant] = (),
    lookahead_s: float = 0.0,
    progress: Callable[[str], None] | None = None,
    vllm_rows: Callable[[Trace, int], dict[str, float]] | None = None,
) -> list[Point]:
    """Every candidate at every point. ``vllm_rows(trace, capacity)`` gives the
    baseline's hit rates by row name (default: vLLM's three managers)."""
    resolved = [resolve_policy(p) for p in policies]
    if vllm_rows is None:
        why = offload_vllm.unavailable()
        if why is not None:
            raise RuntimeError(f"the suite judges against vLLM's own policies: {why}")
        vllm_rows = vllm_hit_rates
    look_ms = 1000.0 * lookahead_s
    candidates: list[tuple[str, PolicySpec, Variant | None]] = [
        (p, r, None) for p, r in zip(policies, resolved)
    ]
    candidates += [(v.name, DEFAULT_CACHE_POLICY, v) for v in variants]
    points = []
    for tr in traces:
        unique = len({k for keys in tr.keys for k in keys})
        for label in tr.capacities:
            cap = parse_capacity(label, unique)
            if progress:
                progress(f"{tr.name} @ {label}: vLLM, Belady")
            pt = Point(
                tr.family,
                tr.name,
                label,
                cap,
                belady_hit_rate(tr.keys, cap),
                vllm_rows(tr.keys, cap),
            )
            for name, policy, variant in candidates:
                if progress:
                    progress(f"{tr.name} @ {label}: {name}")
                with _applied(variant):
                    pt.hit[name] = replay(tr.keys, policy, cap, tr.times, look_ms).hit_rate
            points.append(pt)
    return points


def resolve_policy(name: str) -> PolicySpec:
    """A registered name, or the class name of a building block (``BUILDING_BLOCKS``), so
    that the suite can tell whether a block leads somewhere before it becomes a name."""
    if name in policy_names():
        return name
    for cls in BUILDING_BLOCKS:
        if cls.__name__ == name:
            return cls
    known = [*policy_names(), *(c.__name__ for c in BUILDING_BLOCKS)]
    raise ValueError(f"unknown cache policy {name!r}; known: {', '.join(known)}")


def vllm_hit_rates(trace: Trace, capacity: int) -> dict[str, float]:
    """Hit rate of each of vLLM's rows (``offload_vllm.ROWS``) at ``capacity``."""
    blocks = sum(len(k) for k in trace)
    out = {}
    for row, (policy, threshold) in offload_vllm.ROWS.items():
        hits = offload_vllm.replay(trace, policy, capacity, threshold)[0]
        out[row] = hits / blocks if blocks else 0.0
    return out


def steps(traces: Sequence[SuiteTrace], candidates: int) -> int:
    """Progress steps of ``run_suite``: per point one for the baselines, one per candidate."""
    return sum(len(t.capacities) for t in traces) * (1 + candidates)


# -- summaries ---------------------------------------------------------------------------


def _worst_by(
    points: Sequence[Point], candidates: Sequence[str], group: Callable[[Point], str]
) -> dict[str, dict[str, float]]:
    """group -> candidate -> its worst delta (points) over the group's points."""
    out: dict[str, dict[str, float]] = {}
    for pt in points:
        worst = out.setdefault(group(pt), {})
        for c in candidates:
            d = pt.delta(c)
            worst[c] = min(worst.get(c, d), d)
    return out


def worst_by_family(
    points: Sequence[Point], candidates: Sequence[str]
) -> dict[str, dict[str, float]]:
    """family -> candidate -> its worst delta (points) over the family's traces and sizes."""
    return _worst_by(points, candidates, lambda pt: pt.family)


def worst_by_trace(
    points: Sequence[Point], candidates: Sequence[str]
) -> dict[str, dict[str, float]]:
    """trace -> candidate -> its worst delta over the trace's sizes."""
    return _worst_by(points, candidates, lambda pt: pt.trace)


@dataclass(frozen=True)
class HeldOut:
    """Leave-one-family-out: ``chosen`` was picked on every family but ``family``."""

    family: str
    chosen: str
    held_out_worst: float  # chosen's worst delta on the family left out
    in_sample_worst: float  # chosen's worst delta over the families it was picked on
    default_worst: float  # the default's worst delta on the family left out
    best_worst: float  # the best any candidate does there (hindsight)


def leave_one_family_out(
    points: Sequence[Point], candidates: Sequence[str], default: str = DEFAULT_CACHE_POLICY
) -> list[HeldOut]:
    """For each family, the candidate with the highest worst delta over all other
    families (ties: the higher sum of their deltas, then the first listed), judged
    on the family left out. Needs two families or more."""
    fams = list(dict.fromkeys(pt.family for pt in points))
    if len(fams) < 2:
        return []
    out = []
    for held in fams:
        rest = [pt for pt in points if pt.family != held]
        here = [pt for pt in points if pt.family == held]

        def score(c: str, pts: Sequence[Point] = rest) -> tuple[float, float]:
            ds = [pt.delta(c) for pt in pts]
            return (min(ds), sum(ds))

        chosen = max(candidates, key=score)  # max keeps the first of equals
        worst_here = {c: min(pt.delta(c) for pt in here) for c in candidates}
        out.append(
            HeldOut(
                held,
                chosen,
                worst_here[chosen],
                score(chosen)[0],
                worst_here[default] if default in worst_here else float("nan"),
                max(worst_here.values()),
            )
        )
    return out


def report_json(
    points: Sequence[Point], candidates: Sequence[str], lookahead_s: float, size: str
) -> dict[str, object]:
    """One JSON-able object: every point, the per-family worst and the held-out table."""
    return {
        "suite": size,
        "lookahead_s": lookahead_s,
        "default_policy": DEFAULT_CACHE_POLICY,
        "candidates": list(candidates),
        "points": [
            {
                "family": pt.family,
                "trace": pt.trace,
                "label": pt.label,
                "capacity": pt.capacity,
                "belady_hit_rate": pt.belady,
                "vllm": pt.vllm,
                "vllm_best_hit_rate": pt.vllm_best,
                "hit_rate": pt.hit,
                "delta_points": {c: pt.delta(c) for c in candidates},
            }
            for pt in points
        ],
        "worst_by_family": worst_by_family(points, candidates),
        "worst_by_trace": worst_by_trace(points, candidates),
        "leave_one_family_out": [h.__dict__ for h in leave_one_family_out(points, candidates)],
    }
