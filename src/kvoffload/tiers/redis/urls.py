"""Redis / Valkey URLs: which server(s) a URL names, checked once, shown without passwords.

One server: ``redis://``, ``rediss://`` (TLS), ``unix://`` (a socket path),
and ``valkey://`` / ``valkeys://`` (the same, spelled for Valkey). A Redis
Cluster: ``redis+cluster://[user:password@]host:port[,host:port...]``
(``rediss+cluster://`` for TLS; ``valkey+cluster://``/``valkeys+cluster://``
alike); the listed nodes are seeds, database 0 only, no options.

``normalize_url`` is the one check every front end runs (a bad URL is a
one-line ``ValueError`` that never shows the password); ``redact_url`` is
what messages and logs print.
"""

from __future__ import annotations

import urllib.parse
from dataclasses import dataclass

#: Cluster schemes, and whether each means TLS.
CLUSTER_SCHEMES = {
    "redis+cluster": False,
    "rediss+cluster": True,
    "valkey+cluster": False,
    "valkeys+cluster": True,
}
# One-server schemes, and the scheme redis-py knows each by.
_SCHEMES = {
    "redis": "redis",
    "rediss": "rediss",
    "unix": "unix",
    "valkey": "redis",
    "valkeys": "rediss",
}


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


def redact_url(url: str) -> str:
    """``url`` with any password replaced by ``***`` (for messages and logs)."""
    if is_cluster_url(url):
        return redact_cluster_url(url)
    try:
        parts = urllib.parse.urlsplit(url)
    except ValueError:
        return "<unparseable url>"
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.hostname or ""
    port = f":{parts.port}" if parts.port else ""
    return urllib.parse.urlunsplit(parts._replace(netloc=f"{user}:***@{host}{port}"))


def normalize_url(url: str) -> str:
    """Check ``url`` and map ``valkey://`` to ``redis://``; a bad URL is a ``ValueError``."""
    if not isinstance(url, str) or not url:
        raise ValueError("the Redis URL is empty")
    shown = redact_url(url)
    if is_cluster_url(url):
        parse_cluster_url(url)  # raises on a bad one
        return url
    try:
        parts = urllib.parse.urlsplit(url)
        port = parts.port
    except ValueError as e:
        raise ValueError(f"bad Redis URL {shown!r}: {e}") from None
    scheme = _SCHEMES.get(parts.scheme.lower())
    if scheme is None:
        known = ", ".join(f"{s}://" for s in (*_SCHEMES, *CLUSTER_SCHEMES))
        raise ValueError(f"bad Redis URL {shown!r}: the scheme must be one of {known}")
    if scheme == "unix":
        if not parts.path:
            raise ValueError(f"bad Redis URL {shown!r}: a unix:// URL needs a socket path")
    else:
        if not parts.hostname:
            raise ValueError(f"bad Redis URL {shown!r}: no host")
        if port == 0:
            raise ValueError(f"bad Redis URL {shown!r}: port 0")
        db = parts.path.lstrip("/")
        if db and not db.isdigit():
            raise ValueError(f"bad Redis URL {shown!r}: the path must be a database number")
    # Only the scheme changes (urlunsplit would also drop unix://'s empty host).
    return scheme + url[len(parts.scheme) :]
