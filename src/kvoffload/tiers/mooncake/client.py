"""The Mooncake Store client as this tier uses it: a typed adapter, the URL, the return codes.

``MooncakeClient`` is the subset of ``mooncake.store.MooncakeDistributedStore``
the tier calls (the wheel ships no type information); ``open_client`` builds
and sets one up. The wheel is imported only there, so configuring (and
checking) a Mooncake tier needs no wheel.

Return codes (0.3.x): a batch call answers per key, ``>= 0`` for success
(bytes read for gets) and a negative code otherwise. ``OBJECT_NOT_FOUND``
(-704) is a plain miss; ``RPC_FAIL`` (-900..) means the master did not answer
and ``TRANSFER_FAIL`` (-800..) that the segment holding the bytes did not:
both trip the tier's breaker (``probe``). A get of a value shorter than the
buffers given also answers -800: the store tells the two apart by the
object's size (``get_size``). ``BUFFER_TOO_SMALL`` (-600) is a
value larger than ours (a foreign or torn value: dropped). ``NO_SPACE``
(-200) is a put refused because no segment has room.

Loopback: the transfer engine advertises the address in
``MC_TCP_BIND_ADDRESS`` (else its first non-loopback interface). When the
master is on a loopback address and the variable is unset, ``open_client``
sets it to 127.0.0.1, so a single-host setup never leaves the host.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import urllib.parse
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

SCHEME = "mooncakestore"
PROTOCOLS = ("tcp", "rdma")

OBJECT_NOT_FOUND = -704
OBJECT_HAS_LEASE = -706
BUFFER_TOO_SMALL = -600
NO_SPACE = -200


def is_down_code(code: int) -> bool:
    """A code that says the master (RPC, -900s) or a segment holder (transfer, -800s) is gone."""
    return -1000 < code <= -800


class MooncakeClient(Protocol):
    """The calls of ``MooncakeDistributedStore`` this tier makes (all answer per key)."""

    def register_buffer(self, buffer_ptr: int, size: int) -> int: ...

    def unregister_buffer(self, buffer_ptr: int) -> int: ...

    def batch_put_from_multi_buffers(
        self, keys: list[str], all_buffer_ptrs: list[list[int]], all_sizes: list[list[int]]
    ) -> list[int]: ...

    def batch_get_into_multi_buffers(
        self, keys: list[str], all_buffer_ptrs: list[list[int]], all_sizes: list[list[int]]
    ) -> list[int]: ...

    def batch_upsert_from(
        self, keys: list[str], buffer_ptrs: list[int], sizes: list[int]
    ) -> list[int]: ...

    def batch_is_exist(self, keys: list[str]) -> list[int]: ...

    def get_size(self, key: str) -> int: ...

    def batch_remove(self, keys: list[str], force: bool = False) -> list[int]: ...

    def remove_by_regex(self, regex_pattern: str, force: bool = False) -> int: ...

    def close(self) -> int: ...


@dataclass(frozen=True)
class MasterAddress:
    """``mooncakestore://HOST:PORT`` parsed: the master's RPC address."""

    host: str
    port: int

    @property
    def addr(self) -> str:
        """``host:port`` as ``setup`` takes it (IPv6 hosts in brackets)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    @property
    def is_loopback(self) -> bool:
        if self.host == "localhost":
            return True
        try:
            return ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            return False


def parse_master_url(url: str) -> MasterAddress:
    """``mooncakestore://HOST:PORT`` (the master); anything else is a one-line ``ValueError``."""
    if not isinstance(url, str) or not url.strip():
        raise ValueError(f"expected a URL such as {SCHEME}://127.0.0.1:50051, got {url!r}")
    try:
        parts = urllib.parse.urlsplit(url.strip())
        port = parts.port
    except ValueError as exc:
        raise ValueError(f"bad Mooncake URL {url!r}: {exc}") from None
    if parts.scheme.lower() != SCHEME:
        raise ValueError(f"bad Mooncake URL {url!r}: the scheme must be {SCHEME}://")
    if not parts.hostname:
        raise ValueError(f"bad Mooncake URL {url!r}: no host")
    if not port:
        raise ValueError(f"bad Mooncake URL {url!r}: no port (the master's RPC port, e.g. 50051)")
    if parts.path.strip("/") or parts.query or parts.username or parts.password:
        raise ValueError(f"bad Mooncake URL {url!r}: only {SCHEME}://HOST:PORT is understood")
    return MasterAddress(parts.hostname, port)


def check_metadata(value: str) -> str:
    """``P2PHANDSHAKE`` or an ``http://`` / ``etcd://`` metadata server; else ``ValueError``."""
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"expected P2PHANDSHAKE or an http:// / etcd:// URL, got {value!r}")
    value = value.strip()
    if value.upper() == "P2PHANDSHAKE":
        return "P2PHANDSHAKE"
    scheme = value.partition("://")[0].lower()
    if scheme not in ("http", "etcd") or "://" not in value:
        raise ValueError(f"expected P2PHANDSHAKE or an http:// / etcd:// URL, got {value!r}")
    return value


def check_protocol(value: str) -> str:
    if not isinstance(value, str) or value.strip().lower() not in PROTOCOLS:
        raise ValueError(f"must be one of {', '.join(PROTOCOLS)}, got {value!r}")
    return value.strip().lower()


def local_hostname(master: MasterAddress) -> str:
    """The address other processes reach this one's segment at.

    ``MC_TCP_BIND_ADDRESS`` when set; 127.0.0.1 beside a loopback master; else
    the host's name (what Mooncake's own clients use).
    """
    bound = os.environ.get("MC_TCP_BIND_ADDRESS")
    if bound:
        return bound
    if master.is_loopback:
        return "127.0.0.1"
    return socket.gethostname()


class MooncakeUnavailable(RuntimeError):
    """The wheel cannot be imported, or ``setup`` failed (the message says which)."""


def import_store_class() -> Any:
    """``MooncakeDistributedStore``, or ``MooncakeUnavailable`` naming the missing piece."""
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as exc:
        raise MooncakeUnavailable(
            f"the Mooncake tier needs the mooncake wheel ({exc}); "
            "pip install 'kvoffload[mooncake]' (and libibverbs1, even for TCP)"
        ) from None
    return MooncakeDistributedStore


def open_client(
    master: MasterAddress,
    *,
    metadata: str = "P2PHANDSHAKE",
    protocol: str = "tcp",
    segment_bytes: int = 0,
    local_buffer_bytes: int = 16 << 20,
    rdma_devices: str = "",
) -> MooncakeClient:
    """A client set up against ``master``, contributing ``segment_bytes`` (0: a pure client)."""
    hostname = local_hostname(master)
    if master.is_loopback and not os.environ.get("MC_TCP_BIND_ADDRESS"):
        os.environ["MC_TCP_BIND_ADDRESS"] = hostname
    store_cls = import_store_class()
    client = store_cls()
    rc = client.setup(
        hostname, metadata, segment_bytes, local_buffer_bytes, protocol, rdma_devices, master.addr
    )
    if rc != 0:
        raise MooncakeUnavailable(
            f"Mooncake setup against {SCHEME}://{master.addr} failed (code {rc}): "
            "is the master running, and the metadata server right?"
        )
    adapted: MooncakeClient = client
    return adapted


def codes(values: Sequence[int] | int, n: int) -> list[int]:
    """A batch call's answer as ``n`` codes (a single int answers for every key)."""
    if isinstance(values, int):
        return [values] * n
    out = [int(v) for v in values]
    if len(out) != n:
        raise RuntimeError(f"Mooncake answered {len(out)} codes for {n} keys")
    return out
