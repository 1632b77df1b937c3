"""Where the remote tier's keys go: one Redis server, or the masters of a Redis Cluster.

A ``Links`` object routes a batch of keys to ``Target``s (one server, or
each cluster master owning some of the keys) and runs one pipeline per
target. Each target has its own ``Breaker`` (``breaker``): a target that
fails to answer is skipped (its keys are misses, its stores fail) until it
answers again, so in a cluster one dead master costs only its own keys:
the other masters keep serving. (The cluster's seed connection has a
breaker but no prober.)

Cluster URLs (``urls``): the listed nodes are seeds: the cluster's slot map
is read from them (redis-py's ``RedisCluster``) and refreshed when a node
answers MOVED. Keys are routed by their hash slot, so the store's hash tags
decide which keys share a node.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.exceptions import RedisClusterException
from redis.retry import Retry

from kvoffload.tiers.redis.breaker import OUTAGE_ERRORS, Breaker
from kvoffload.tiers.redis.probe import ping_on_fresh_connection
from kvoffload.tiers.redis.urls import parse_cluster_url

logger = logging.getLogger(__name__)

#: A pipeline reply standing for "the target was skipped or did not answer".
DOWN: Any = object()
# Slot-map refreshes after MOVED replies: at most one per this many seconds.
_REFRESH_EVERY_S = 1.0


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
    """How a store reaches its server(s) at ``url``; subclasses route keys.

    ``shown_url`` is the URL for messages (no password); every socket call is
    bounded by ``timeout_s``; a target's breaker waits ``retry_s`` after a
    failure, doubling up to ``max_retry_s``, and warns on ``log``.
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
        self._timeout_s = timeout_s
        self._retry = (retry_s, max_retry_s)
        self._log = log
        self._open(url)

    def _open(self, url: str) -> None:
        """Make the clients for ``url`` (at construction; nothing is sent yet)."""
        raise NotImplementedError

    def _breaker(self, name: str, shown: str, client: redis.Redis | None = None) -> Breaker:
        """A breaker with these links' retry and log; with ``client``, probed by a PING."""
        probe = None if client is None else ping_on_fresh_connection(client)
        return Breaker(name, shown, *self._retry, self._log, probe=probe)

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

    def _open(self, url: str) -> None:
        client = redis.Redis.from_url(url, **_client_kwargs(self._timeout_s))
        self._target = Target(client, self._breaker(url, self.shown_url, client))

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

    def _open(self, url: str) -> None:
        self._parsed = parse_cluster_url(url)
        self._seeds = self._breaker("seeds", self.shown_url)
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
                    t = Target(client, self._breaker(node.name, shown, client))
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
