"""Driving a batcher engine directly in tests: start a paged engine, submit a request with a queue
as its sink, collect its events until the finishing one, and read the generated ids back."""
import queue

from jkv.serving.batcher import BatcherConfig, EngineRequest


def start_paged(model, metrics=None, defaults: dict | None = None, **config):
    """A started `PagedBatcher` with `BatcherConfig(**defaults, **config)` (config wins)."""
    from jkv.serving.paged_batcher import PagedBatcher

    b = PagedBatcher(model, BatcherConfig(**{**(defaults or {}), **config}), metrics)
    b.start()
    return b


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
