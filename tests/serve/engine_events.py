"""Driving a batcher engine directly in tests: submit a request with a queue as its sink, collect
its events until the finishing one, and read the generated ids back."""
import queue

from jkv.serving.batcher import EngineRequest


def submit(b, rid, ids, sp, **kw):
    q = queue.Queue()
    b.submit(EngineRequest(rid, list(ids), sp, q.put, **kw))
    return q


def collect(q, timeout=120):
    events = []
    while True:
        ev = q.get(timeout=timeout)
        events.append(ev)
        if ev.finish_reason is not None:
            return events


def token_ids(events):
    return [t for ev in events for t in ev.token_ids]
