"""Where the remote tier's keys go: one Redis server, or the nodes of a Redis Cluster.

A ``Links`` object routes a batch of keys to ``Target``s (one server, or
each cluster master owning some of the keys) and runs one pipeline per
target. Each target has its own ``Breaker``: a target that fails to answer
is skipped (its keys are misses, its stores fail) for ``retry_interval_s``,
then one call tries it again, the wait doubling per failure up to
``max_retry_interval_s`` (so callers pay at most one timeout per wait).
Meanwhile a ``Prober`` (``probe``) sends one PING on a fresh connection
every ``PROBE_INTERVAL_S`` off the callers' threads and reopens the target
at the first answer, so a short outage ends within about a second of the
server's return however long the back-off has grown. (The cluster's seed
connection has no prober.) In a cluster, one dead master therefore costs
only its own keys: the other masters keep serving.

Cluster URLs: ``redis+cluster://[user:password@]host:port[,host:port...]``
(``rediss+cluster://`` for TLS; ``valkey+cluster://``/``valkeys+cluster://``
alike). The listed nodes are seeds: the cluster's slot map is read from
them (redis-py's ``RedisCluster``) and refreshed when a node answers MOVED.
Keys are routed by their hash slot, so the store's hash tags decide which
keys share a node.
"""

from __future__ import annotations

import logging
import threading
import time
import urllib.parse
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import redis
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.exceptions import RedisClusterException
from redis.retry import Retry

from kvoffload.tiers.redis.probe import PROBE_INTERVAL_S, Prober, ping_on_fresh_connection

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: Errors that mean "the target did not answer" (not "the target refused").
OUTAGE_ERRORS: tuple[type[BaseException], ...] = (
    redis.ConnectionError,
    redis.TimeoutError,
    OSError,
    RedisClusterException,
)
CLUSTER_SCHEMES = {
    "redis+cluster": False,
    "rediss+cluster": True,
    "valkey+cluster": False,
    "valkeys+cluster": True,
}
#: A pipeline reply standing for "the target was skipped or did not answer".
DOWN: Any = object()
# Slot-map refreshes after MOVED replies: at most one per this many seconds.
_REFRESH_EVERY_S = 1.0


def is_cluster_url(url: str) -> bool:
    return url.partition("://")[0].lower() in CLUSTER_SCHEMES


@dataclass(frozen=True)
class ClusterURL:
    seeds: list[tuple[str, int]]
    username: str | None
    password: str | None
    tls: bool


def redact_cluster_url(url: str) -> str:
    scheme, sep, rest = url.partition("://")
    netloc, slash, path = rest.partition("/")
    auth, at, hosts = netloc.rpartition("@")
    if not at or ":" not in auth:
        return url
    user = auth.split(":", 1)[0]
    return f"{scheme}{sep}{user}:***@{hosts}{slash}{path}"


def parse_cluster_url(url: str) -> ClusterURL:
    """The seed nodes and credentials of a cluster URL; a bad one is a ``ValueError``."""
    shown = redact_cluster_url(url)
    scheme, _, rest = url.partition("://")
    tls = CLUSTER_SCHEMES.get(scheme.lower())
    if tls is None:
        raise ValueError(f"bad Redis Cluster URL {shown!r}: unknown scheme")
    rest, q, _ = rest.partition("?")
    netloc, _, path = rest.partition("/")
    if q:
        raise ValueError(f"bad Redis Cluster URL {shown!r}: options (?...) are not supported")
    if path not in ("", "0"):
        raise ValueError(f"bad Redis Cluster URL {shown!r}: a cluster has only database 0")
    auth, at, hosts = netloc.rpartition("@")
    username = password = None
    if at:
        user, colon, pw = auth.partition(":")
        username = urllib.parse.unquote(user) or None
        password = urllib.parse.unquote(pw) if colon else None
    seeds: list[tuple[str, int]] = []
    for item in hosts.split(","):
        if not item:
            raise ValueError(f"bad Redis Cluster URL {shown!r}: an empty seed node")
        try:
            parts = urllib.parse.urlsplit(f"//{item}")
            host, port = parts.hostname, parts.port
        except ValueError as e:
            raise ValueError(f"bad Redis Cluster URL {shown!r}: {e}") from None
        if not host:
            raise ValueError(f"bad Redis Cluster URL {shown!r}: seed {item!r} has no host")
        if port == 0:
            raise ValueError(f"bad Redis Cluster URL {shown!r}: port 0")
        seeds.append((host, port or 6379))
    return ClusterURL(seeds, username, password, tls)


class Breaker:
    """The outage state of one target; see the module docstring."""

    def __init__(
        self,
        name: str,
        shown: str,
        retry_interval_s: float,
        max_retry_interval_s: float,
        log: logging.Logger = logger,
        probe: Callable[[], None] | None = None,
        probe_interval_s: float = PROBE_INTERVAL_S,
    ) -> None:
        self.name = name
        self.log = log
        self.shown = shown
        self.retry_interval_s = retry_interval_s
        self.max_retry_interval_s = max(max_retry_interval_s, retry_interval_s)
        self.outages = 0
        self.calls_skipped = 0
        self._interval = retry_interval_s
        self._down_until = 0.0
        self._down_since: float | None = None
        self._lock = threading.Lock()
        # With a probe, a down target is also reopened as soon as it answers a PING.
        self.prober = (
            None
            if probe is None
            else Prober(
                name,
                probe,
                self.mark_up,
                min(probe_interval_s, max(retry_interval_s, 0.01)),
                self.max_retry_interval_s,
            )
        )

    @property
    def up(self) -> bool:
        return self._down_since is None

    def mark_down(self, err: BaseException) -> None:
        with self._lock:
            if self._down_since is None:
                self._interval = self.retry_interval_s
            else:
                self._interval = min(2 * self._interval, self.max_retry_interval_s)
            self._down_until = time.monotonic() + self._interval
            first = self._down_since is None
            if first:
                self._down_since = time.monotonic()
                self.outages += 1
        if self.prober is not None:
            self.prober.start()
        if not first:
            return
        retry = (
            f"next try in {self.retry_interval_s:.1f}s, backing off to "
            f"{self.max_retry_interval_s:.1f}s"
        )
        if self.prober is not None:
            retry += f"; probed every {self.prober.interval_s:.1f}s"
        self.log.warning(
            "Redis tier at %s is unreachable (%s: %s); its loads are misses and its "
            "stores fail until it is back (%s)",
            self.shown,
            type(err).__name__,
            # The text, not the exception: a handler that keeps records (pytest's
            # does) would keep its traceback's frames, and the buffers they hold, alive.
            str(err),
            retry,
        )

    def mark_up(self) -> None:
        if self._down_since is None:
            return
        with self._lock:
            if self._down_since is None:
                return
            down_for = time.monotonic() - self._down_since
            self._down_since = None
        self.log.warning(
            "Redis tier at %s is back after %.1fs (%d calls skipped meanwhile)",
            self.shown,
            down_for,
            self.calls_skipped,
        )

    def probe_now(self) -> None:
        with self._lock:
            self._down_until = 0.0

    def close(self) -> None:
        if self.prober is not None:
            self.prober.close()

    def guarded(self, fn: Callable[[], T], fallback: T) -> T:
        """``fn()``, or ``fallback`` while down or when the target does not answer."""
        if self._down_since is not None and time.monotonic() < self._down_until:
            self.calls_skipped += 1
            return fallback
        try:
            out = fn()
        except OUTAGE_ERRORS as e:
            self.mark_down(e)
            return fallback
        self.mark_up()
        return out


@dataclass
class Target:
    """One server that answers for some keys, with its own breaker."""

    client: redis.Redis
    breaker: Breaker
    extra: dict[str, Any] = field(default_factory=dict)


def _client_kwargs(timeout_s: float) -> dict[str, Any]:
    return {
        "socket_timeout": timeout_s,
        "socket_connect_timeout": timeout_s,
        # One immediate retry for a stale pooled connection; never for a timeout
        # (a server that swallows packets must cost one timeout, not two).
        "retry": Retry(NoBackoff(), 1, supported_errors=(redis.ConnectionError,)),
        "health_check_interval": 0,
    }


class Links:
    """How a store reaches its server(s); subclasses route keys."""

    shown_url: str

    def route(self, rkeys: Sequence[bytes]) -> list[tuple[Target, list[int]]]:
        raise NotImplementedError

    def targets(self) -> list[Target]:
        raise NotImplementedError

    def check(self) -> None:
        """Ping every target now; rejected credentials raise (``redis.AuthenticationError``
        or a NOAUTH/WRONGPASS ``redis.ResponseError``), silence is an outage."""
        for t in self.targets():
            try:
                t.client.ping()
            except redis.AuthenticationError:
                raise
            except OUTAGE_ERRORS as e:
                t.breaker.mark_down(e)
            else:
                t.breaker.mark_up()

    def moved(self) -> None:
        """A target answered MOVED/ASK: the slot map changed."""

    def breakers(self) -> list[Breaker]:
        """Every breaker this object has made so far."""
        return [t.breaker for t in self.targets()]

    def set_retry(self, retry_s: float, max_retry_s: float) -> None:
        for b in self.breakers():
            b.retry_interval_s = retry_s
            b.max_retry_interval_s = max(max_retry_s, retry_s)

    @property
    def available(self) -> bool:
        return any(t.breaker.up for t in self.targets())

    @property
    def outages(self) -> int:
        return sum(t.breaker.outages for t in self.targets())

    @property
    def calls_skipped(self) -> int:
        return sum(t.breaker.calls_skipped for t in self.targets())

    def each(
        self, rkeys: Sequence[bytes], add: Callable[[Any, int], None], reply_count: int = 1
    ) -> list[Any]:
        """Per key, the reply of the command(s) ``add(pipe, i)`` queued for it, else ``DOWN``.

        With ``reply_count`` > 1 (``add`` queues that many commands per key)
        each element is the list of those replies.
        """
        out: list[Any] = [DOWN] * len(rkeys)
        for target, idx in self.route(rkeys):

            def send(client: redis.Redis = target.client, idx: list[int] = idx) -> list[Any]:
                pipe = client.pipeline(transaction=False)
                for i in idx:
                    add(pipe, i)
                return pipe.execute(raise_on_error=False)

            replies = target.breaker.guarded(send, None)
            if replies is None:
                continue
            for n, i in enumerate(idx):
                if reply_count == 1:
                    out[i] = replies[n]
                else:
                    out[i] = replies[n * reply_count : (n + 1) * reply_count]
        return out

    def close(self) -> None:
        raise NotImplementedError


class StandaloneLinks(Links):
    """One server (``redis://``, ``rediss://``, ``unix://``)."""

    def __init__(
        self,
        url: str,
        shown_url: str,
        timeout_s: float,
        retry_s: float,
        max_retry_s: float,
        log: logging.Logger = logger,
    ) -> None:
        self.shown_url = shown_url
        client = redis.Redis.from_url(url, **_client_kwargs(timeout_s))
        breaker = Breaker(
            url, shown_url, retry_s, max_retry_s, log, probe=ping_on_fresh_connection(client)
        )
        self._target = Target(client, breaker)

    def route(self, rkeys: Sequence[bytes]) -> list[tuple[Target, list[int]]]:
        return [(self._target, list(range(len(rkeys))))] if rkeys else []

    def targets(self) -> list[Target]:
        return [self._target]

    def close(self) -> None:
        self._target.breaker.close()
        self._target.client.close()


class ClusterLinks(Links):
    """The masters of a Redis Cluster, reached through per-node pipelines.

    The slot map comes from redis-py's ``RedisCluster`` (built from the seed
    nodes on first use, retried per the seeds' breaker while none answers).
    """

    def __init__(
        self,
        url: str,
        shown_url: str,
        timeout_s: float,
        retry_s: float,
        max_retry_s: float,
        log: logging.Logger = logger,
    ) -> None:
        self.shown_url = shown_url
        self._parsed = parse_cluster_url(url)
        self._timeout_s = timeout_s
        self._retry = (retry_s, max_retry_s)
        self._log = log
        self._seeds = Breaker("seeds", shown_url, retry_s, max_retry_s, log)
        self._lock = threading.Lock()
        self._cluster: RedisCluster | None = None
        self._targets: dict[str, Target] = {}
        self._last_refresh = 0.0

    def _kwargs(self) -> dict[str, Any]:
        kw = _client_kwargs(self._timeout_s)
        if self._parsed.username:
            kw["username"] = self._parsed.username
        if self._parsed.password is not None:
            kw["password"] = self._parsed.password
        if self._parsed.tls:
            kw["ssl"] = True
        return kw

    def _connect(self) -> RedisCluster:
        return RedisCluster(
            startup_nodes=[ClusterNode(h, p) for h, p in self._parsed.seeds],
            require_full_coverage=False,
            **self._kwargs(),
        )

    def cluster(self) -> RedisCluster | None:
        """The cluster client, connecting first if needed (None while no seed answers)."""
        if self._cluster is not None:
            return self._cluster
        with self._lock:
            if self._cluster is None:
                self._cluster = self._seeds.guarded(self._connect, None)
            return self._cluster

    def _target(self, node: ClusterNode) -> Target:
        t = self._targets.get(node.name)
        if t is None:
            with self._lock:
                t = self._targets.get(node.name)
                if t is None:
                    client = redis.Redis(host=node.host, port=node.port, **self._kwargs())
                    shown = f"{self.shown_url} (node {node.name})"
                    breaker = Breaker(
                        node.name,
                        shown,
                        *self._retry,
                        self._log,
                        probe=ping_on_fresh_connection(client),
                    )
                    t = Target(client, breaker)
                    self._targets[node.name] = t
        return t

    def route(self, rkeys: Sequence[bytes]) -> list[tuple[Target, list[int]]]:
        cluster = self.cluster()
        if cluster is None or not rkeys:
            return []
        groups: dict[str, tuple[Target, list[int]]] = {}
        for i, k in enumerate(rkeys):
            try:
                node = cluster.get_node_from_key(k)
            except (RedisClusterException, redis.RedisError, IndexError):
                node = None
            if node is None:  # a slot no master serves now: a miss
                continue
            entry = groups.get(node.name)
            if entry is None:
                entry = groups[node.name] = (self._target(node), [])
            entry[1].append(i)
        return list(groups.values())

    def targets(self) -> list[Target]:
        cluster = self.cluster()
        if cluster is not None:
            for node in cluster.get_primaries():
                self._target(node)
        return list(self._targets.values())

    @property
    def available(self) -> bool:
        return self._cluster is not None and any(t.breaker.up for t in self._targets.values())

    @property
    def outages(self) -> int:
        return self._seeds.outages + sum(t.breaker.outages for t in self._targets.values())

    @property
    def calls_skipped(self) -> int:
        return self._seeds.calls_skipped + sum(
            t.breaker.calls_skipped for t in self._targets.values()
        )

    def check(self) -> None:
        self._seeds.probe_now()
        if self._cluster is None:
            with self._lock:
                try:
                    self._cluster = self._connect()
                except redis.AuthenticationError:
                    raise
                except OUTAGE_ERRORS as e:
                    if "AUTH" in str(e) or "WRONGPASS" in str(e):
                        raise redis.AuthenticationError(str(e)) from e
                    self._seeds.mark_down(e)
                    return
        super().check()

    def breakers(self) -> list[Breaker]:
        return [self._seeds, *(t.breaker for t in self._targets.values())]

    def set_retry(self, retry_s: float, max_retry_s: float) -> None:
        self._retry = (retry_s, max(max_retry_s, retry_s))
        super().set_retry(retry_s, max_retry_s)

    def moved(self) -> None:
        now = time.monotonic()
        if now - self._last_refresh < _REFRESH_EVERY_S or self._cluster is None:
            return
        self._last_refresh = now
        cluster = self._cluster
        self._seeds.guarded(cluster.nodes_manager.initialize, None)

    def close(self) -> None:
        for t in self._targets.values():
            t.breaker.close()
            t.client.close()
        if self._cluster is not None:
            self._cluster.close()
