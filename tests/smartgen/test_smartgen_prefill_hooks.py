"""The prefill worker's observer hooks (`PrefillWorker.on_*`): the serving wrapper counts requests
queued, freed by the decode worker, KV bytes per path and failed fetches through them alone."""
import threading

import pytest

from jkv.disagg.decode_worker import DecodeWorker
from jkv.kvbuffers.fetch import FetchCall
from jkv.serving.disagg_prefill import ServingPrefillWorker
from jkv.serving.metrics import PrefillMetrics
from jkv.transfer.plan import TransferConfig
from tests.smartgen.smartgen_cases import SECRET, make_requests
from transport import RemoteError


def _sample(metrics, name, labels=None):
    return metrics.registry.get_sample_value(name, labels or {})


def test_serving_prefill_worker_counts_through_the_hooks(model, selectors, prompts):
    metrics = PrefillMetrics()
    worker = ServingPrefillWorker(model, selectors["oracle"], "prefill-0", secret=SECRET, metrics=metrics)
    address = worker.listen()
    runner = threading.Thread(target=worker.run, daemon=True)
    runner.start()
    decode = DecodeWorker(model, selectors["oracle"], TransferConfig(mode="partial", kr_fraction=0.3, max_blocks=16),
                          secret=SECRET)
    try:
        decode.connect([address])
        outs = decode.generate(make_requests(prompts))
        assert all(o.finish_reason == "length" for o in outs)
        n = len(prompts)
        assert _sample(metrics, "jkv_prefill_requests_total", {"outcome": "prefilled"}) == n
        assert _sample(metrics, "jkv_kv_freed_requests_total", {"reason": "decode"}) == n  # on_free_requested
        assert _sample(metrics, "jkv_kv_freed_requests_total", {"reason": "lease_expired"}) == 0
        on_demand = sum(o.metrics.extra["bytes"]["on_demand"] for o in outs)
        assert on_demand > 0 and _sample(metrics, "jkv_kv_transfer_bytes_total",
                                         {"role": "prefill", "path": "on_demand"}) == on_demand  # on_released
        assert worker.inflight() == (0, 0) and worker.held_load() == (0, 0)  # on_prefill_queued balanced
        call = FetchCall(0)
        call.add("no-such-request", [(0, [1])])
        with pytest.raises(RemoteError, match="no-such-request"):
            decode.endpoint.peer("prefill-0").call("fetch", call.payload(), timeout=30)
        assert _sample(metrics, "jkv_kv_transfer_failures_total", {"role": "prefill"}) == 1  # on_fetch_failed
    finally:
        decode.close()
        worker.close()
        runner.join(5)
    assert _sample(metrics, "jkv_kv_freed_requests_total", {"reason": "shutdown"}) == 0
    assert worker.closed and worker.held() == [] and worker.pool.live() == []
