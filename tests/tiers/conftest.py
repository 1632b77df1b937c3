"""Fixtures for the transfer tests: a real redis-server (see tests/conftest_redis.py)."""

from tests.conftest_redis import redis_server, redis_server_factory

__all__ = ["redis_server", "redis_server_factory"]
