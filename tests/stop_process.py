"""SIGSTOP a child process and return only once the kernel reports it stopped.

kill(SIGSTOP) returns before a process running on another core has stopped, so it can still answer
one more request; under two test workers that window is real (it failed the kvpool and transport
dead-peer tests once each in CI)."""
import os
import signal
import time


def stop_process(pid: int, timeout: float = 5.0) -> None:
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rpartition(")")[2].split()[0] in ("T", "t"):
                return
        time.sleep(0.005)
    raise TimeoutError(f"process {pid} did not stop within {timeout} s of SIGSTOP")
