"""Argparse value types shared by every ``kvoffload`` command.

Each factory returns a callable for ``add_argument(type=...)`` that either
returns a checked value or raises ``argparse.ArgumentTypeError`` with a
message naming what was expected, so a bad value ends in argparse's one-line
error (exit 2) before any work starts. Upper bounds exist so that an absurd
value (``--requests 100000000``, ``--sizes 1TiB``) is refused up front
instead of exhausting memory later.

This module imports nothing heavy: ``--help`` must stay fast.
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

# Generous caps for counts that size a Python-side structure (requests, ops):
# beyond them a run would take hours or exhaust memory, not measure anything.
MAX_COUNT = 10_000_000
# Human byte sizes: nothing this project allocates in one piece is larger.
MAX_BYTES = 1 << 40
_T = TypeVar("_T")


def _fail(message: str) -> argparse.ArgumentTypeError:
    return argparse.ArgumentTypeError(message)


def positive_int(maximum: int = MAX_COUNT, minimum: int = 1) -> Callable[[str], int]:
    """An integer in ``[minimum, maximum]`` (decimal; ``1_000`` allowed, ``1e3`` not)."""

    def parse(text: str) -> int:
        try:
            value = int(text.strip())
        except ValueError:
            raise _fail(f"expected an integer, got {text!r}") from None
        if value < minimum:
            what = "positive" if minimum == 1 else f">= {minimum:,}"
            raise _fail(f"must be {what}, got {value}")
        if value > maximum:
            raise _fail(f"{value:,} is too large (at most {maximum:,})")
        return value

    parse.__name__ = "integer"  # argparse names the type in some messages
    return parse


def any_int(maximum: int = 2**63 - 1, minimum: int = -(2**63)) -> Callable[[str], int]:
    """An integer in ``[minimum, maximum]`` (seeds, sequence numbers)."""
    return positive_int(maximum=maximum, minimum=minimum)


def finite_float(
    minimum: float = 0.0, maximum: float = 1e9, allow_min: bool = False
) -> Callable[[str], float]:
    """A finite float above ``minimum`` (or equal when ``allow_min``), at most ``maximum``.

    NaN and infinities are refused: every comparison with NaN is false, so a
    NaN slips through range checks and turns results into nonsense.
    """

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise _fail(f"expected a number, got {text!r}") from None
        if not math.isfinite(value):
            raise _fail(f"expected a finite number, got {text!r}")
        low_ok = value >= minimum if allow_min else value > minimum
        if not low_ok:
            sign = ">=" if allow_min else ">"
            raise _fail(f"expected a number {sign} {minimum:g}, got {value:g}")
        if value > maximum:
            raise _fail(f"{value:g} is too large (at most {maximum:g})")
        return value

    parse.__name__ = "number"
    return parse


def non_empty_path(text: str) -> str:
    """A path that is not empty or blank (``--disk-dir ''`` must not mean 'no tier')."""
    if not text or not text.strip():
        raise _fail("expected a path, got an empty string")
    if "\0" in text:
        raise _fail(f"not a path: {text!r}")
    return text


def _existing(text: str, is_kind: Callable[[str], bool], kind: str) -> str:
    text = non_empty_path(text)
    if not os.path.exists(text):
        raise _fail(f"{text!r} does not exist")
    if not is_kind(text):
        raise _fail(f"{text!r} is not a {kind}")
    return text


def existing_file(text: str) -> str:
    """A path to an existing regular file."""
    return _existing(text, os.path.isfile, "file")


def existing_dir(text: str) -> str:
    """A path to an existing directory."""
    return _existing(text, os.path.isdir, "directory")


def redis_url(text: str) -> str:
    """A Redis URL as the Redis tier accepts it (``kvoffload.tiers.redis.store.normalize_url``).

    ``redis://``, ``rediss://``, ``valkey://``, ``unix://`` or a
    ``redis+cluster://h1:p1,h2:p2`` seed list; the database number, when given,
    is checked on connect against what the server has.
    """
    if not text or not text.strip():
        raise _fail("expected a Redis URL such as redis://127.0.0.1:6379/0, got an empty string")
    # Imported here: redis-py is not needed for --help or any other flag.
    from kvoffload.tiers.redis.store import normalize_url

    try:
        return normalize_url(text)
    except ValueError as exc:
        raise _fail(str(exc)) from None


def zmq_endpoint(text: str) -> str:
    """A ZMQ endpoint ``transport://address`` (tcp, ipc, inproc)."""
    if not text or "://" not in text:
        raise _fail(f"not a ZMQ endpoint: {text!r} (expected e.g. tcp://127.0.0.1:5557)")
    transport, _, address = text.partition("://")
    if transport not in ("tcp", "ipc", "inproc") or not address:
        raise _fail(f"not a ZMQ endpoint: {text!r} (expected tcp://, ipc:// or inproc://)")
    return text


def byte_size(maximum: int = MAX_BYTES) -> Callable[[str], int]:
    """A human byte size (``256MiB``, ``1.5GB``, ``4096``), positive and at most ``maximum``."""

    def parse(text: str) -> int:
        from kvoffload.transfer.sizing import parse_bytes

        try:
            value = parse_bytes(text)
        except ValueError as exc:
            raise _fail(str(exc)) from None
        if value > maximum:
            raise _fail(f"{text!r} is too large (at most {_human(maximum)})")
        return value

    parse.__name__ = "byte size"
    return parse


def _items(text: str, what: str) -> list[str]:
    """The comma-separated items of ``text``, stripped; none may be empty."""
    items = [s.strip() for s in text.split(",")]
    if not text.strip() or any(not s for s in items):
        raise _fail(f"expected comma-separated {what}, got {text!r}")
    return items


def _list_of(one: Callable[[str], _T], what: str) -> Callable[[str], list[_T]]:
    """A comma-separated, non-empty list, each item parsed by ``one``."""

    def parse(text: str) -> list[_T]:
        return [one(s) for s in _items(text, what)]

    parse.__name__ = what
    return parse


def byte_size_list(maximum: int = MAX_BYTES) -> Callable[[str], list[int]]:
    """A comma-separated, non-empty list of byte sizes."""
    return _list_of(byte_size(maximum), "byte sizes")


def int_list(maximum: int = MAX_COUNT) -> Callable[[str], list[int]]:
    """A comma-separated, non-empty list of positive integers."""
    return _list_of(positive_int(maximum), "integers")


def name_list(text: str) -> list[str]:
    """A comma-separated, non-empty list of names (no empty items)."""
    return _items(text, "names")


def _human(n: int) -> str:
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale}{unit}"
    return f"{n:,} bytes"


def available_memory() -> int | None:
    """Bytes of memory the OS says are available now (None when it cannot tell)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def check_fits_in_memory(what: str, nbytes: int, fraction: float = 0.9) -> None:
    """``ValueError`` when ``nbytes`` exceeds ``fraction`` of the available memory.

    Called before allocating, so a too-large tier is a clear refusal rather than
    an allocator error (or the OOM killer) halfway through start-up.
    """
    avail = available_memory()
    if avail is None:
        return
    if nbytes > fraction * avail:
        raise ValueError(
            f"{what} needs {_approx(nbytes)} but only {_approx(avail)} of memory is "
            "available; use smaller sizes"
        )


def _approx(n: int) -> str:
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:,.1f} {unit}"
    return f"{n} B"


def output_dir(text: str) -> Path:
    """A directory to write into: non-empty, and not an existing non-directory."""
    text = non_empty_path(text)
    if os.path.exists(text) and not os.path.isdir(text):
        raise _fail(f"{text!r} exists and is not a directory")
    return Path(text)


def zmq_connect_endpoint(text: str) -> str:
    """A ZMQ endpoint to connect to; a ``tcp://`` host must resolve (ZMQ would retry for ever)."""
    text = zmq_endpoint(text)
    transport, _, address = text.partition("://")
    if transport == "tcp":
        host, sep, port = address.rpartition(":")
        if not sep or not port.isdigit() or not 0 < int(port) < 65536:
            raise _fail(f"not a ZMQ endpoint: {text!r} (expected tcp://host:port)")
        host = host.strip("[]")
        if host in ("*", ""):
            raise _fail(f"cannot connect to {text!r}: give a host, not a wildcard")
        import socket

        try:
            socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
        except (OSError, UnicodeError) as exc:
            raise _fail(f"cannot resolve the host of {text!r} ({exc})") from None
    return text
