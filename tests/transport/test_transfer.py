"""Transfer state machine and blocking helpers (pure Python)."""
from __future__ import annotations

import threading

import pytest

from transport import OpTimeout, PeerDeadError, Transfer, TransferState, wait_all


def test_state_machine_first_terminal_transition_wins():
    t = Transfer("write", "p", 10)
    assert t.state is TransferState.CONNECTING and not t.done() and t.elapsed is None
    assert t.start() and t.state is TransferState.TRANSFERRING
    seen = []
    t.add_done_callback(lambda tr: seen.append(tr.state))
    assert t.complete("v")
    assert not t.fail(PeerDeadError("late")) and t.state is TransferState.COMPLETE
    assert t.result() == "v" and seen == [TransferState.COMPLETE] and t.elapsed >= 0
    t.add_done_callback(lambda tr: seen.append("after"))
    assert seen[-1] == "after"


def test_failed_while_queued_is_never_started():
    t = Transfer("call", "p", 0)
    assert t.fail(OpTimeout("expired"))
    assert not t.start() and t.state is TransferState.FAILED and t.reason == "expired"
    with pytest.raises(OpTimeout, match="expired"):
        t.result()


def test_wait_timeout_does_not_change_state_and_wait_all_reports_first_error():
    t = Transfer("write", "p", 1)
    with pytest.raises(OpTimeout, match="not done"):
        t.wait(0.01)
    assert t.state is TransferState.CONNECTING
    ok, bad = Transfer("write", "p", 1), Transfer("write", "p", 1)
    threading.Timer(0.05, ok.complete).start()
    threading.Timer(0.05, lambda: bad.fail(PeerDeadError("gone"))).start()
    with pytest.raises(PeerDeadError, match="gone"):
        wait_all([ok, bad], timeout=2)
    assert ok.state is TransferState.COMPLETE
    import time
    time.sleep(0.01)  # let the Timer threads exit before the leak check
