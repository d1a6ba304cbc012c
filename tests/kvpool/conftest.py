"""Fixtures for the KV pool tests: a real redis-server on a free loopback port."""
import pytest

from tests.kvpool.redis_server import running_redis


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory):
    with running_redis(tmp_path_factory.mktemp("redis")) as server:
        yield server


@pytest.fixture
def private_redis_server(tmp_path):
    """A server of the test's own (it may be killed and restarted)."""
    with running_redis(tmp_path) as server:
        yield server
