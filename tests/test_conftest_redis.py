"""The test helpers' port choice: a port bound later must not be one ``bind(0)`` can hand out."""

import socket

from tests.conftest_redis import _ephemeral_low, free_port


def test_free_port_is_below_the_ephemeral_range_and_free_everywhere() -> None:
    low = _ephemeral_low()
    for _ in range(20):
        port = free_port()
        assert 1024 <= port < low
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("0.0.0.0", port))  # still free on every interface, as the events bind "*"


def test_an_ephemeral_bind_never_lands_on_it() -> None:
    ports = {free_port() for _ in range(20)}
    for _ in range(200):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            assert s.getsockname()[1] not in ports
