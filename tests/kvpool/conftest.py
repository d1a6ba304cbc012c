"""Fixtures for the KV pool tests: a real redis-server on a free loopback port."""
import pytest

from tests.kvpool.redis_server import MISSING_REASON, REDIS_SERVER, RedisServer


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory):
    if REDIS_SERVER is None:
        pytest.skip(MISSING_REASON)
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()


@pytest.fixture
def private_redis_server(tmp_path):
    """A server of the test's own (it may be killed and restarted)."""
    if REDIS_SERVER is None:
        pytest.skip(MISSING_REASON)
    server = RedisServer(tmp_path).start()
    yield server
    server.stop()
