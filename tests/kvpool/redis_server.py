"""A real redis-server child process for the KV pool tests (started per test or module)."""
import contextlib
import shutil
import signal
import socket
import subprocess
import time

import pytest

REDIS_SERVER = shutil.which("redis-server")
MISSING_REASON = "redis-server binary not found: install it with `apt-get install -y redis-server`"
needs_redis_server = pytest.mark.skipif(REDIS_SERVER is None, reason=MISSING_REASON)


def free_port() -> int:
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """A redis-server child process bound to 127.0.0.1 with its files in a temp dir."""

    def __init__(self, workdir, port: int | None = None, maxmemory: str = "64mb"):
        self.workdir = workdir
        self.port = port or free_port()
        self.maxmemory = maxmemory
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> "RedisServer":
        self.proc = subprocess.Popen(
            [REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.workdir),
             "--save", "", "--appendonly", "no", "--maxmemory", self.maxmemory,
             "--maxmemory-policy", "allkeys-lru", "--protected-mode", "yes"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode} on port {self.port}")
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port), 0.2) as s:
                s.sendall(b"PING\r\n")
                if s.recv(16).startswith(b"+PONG"):
                    return self
            time.sleep(0.02)
        raise RuntimeError(f"redis-server did not answer PING on port {self.port} within 10 s")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.proc = None


@contextlib.contextmanager
def running_redis(workdir, **kwargs):
    """A started RedisServer in `workdir` for a fixture to yield (skips the test when the binary is
    missing); stopped afterwards, resumed first if a failed test left it SIGSTOPped."""
    if REDIS_SERVER is None:
        pytest.skip(MISSING_REASON)
    server = RedisServer(workdir, **kwargs).start()
    try:
        yield server
    finally:
        if server.proc is not None and server.proc.poll() is None:
            server.proc.send_signal(signal.SIGCONT)
        server.stop()
