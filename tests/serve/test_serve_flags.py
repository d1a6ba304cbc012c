"""`jkv serve` flags and config file keys: each sets exactly one field of the nested configs
(ServeConfig -> Disaggregation -> TransferConfig), and no field is repeated between the levels."""
import argparse
import dataclasses

import pytest
import yaml

from jkv.disagg.config import Disaggregation
from jkv.serving.config import (FLAGS, LIST_OPTIONS, ServeConfig, add_serve_arguments, config_from_args, field_path,
                                field_value, read_config_file)
from jkv.serving.routing import RoutingConfig
from jkv.transfer.plan import TransferConfig

DECODE = ["--role", "decode", "--prefill-worker", "a:1", "--strategy", "sequential"]
ROUTER = ["--role", "router", "--upstream", "http://u:1", "--prefill", "http://p:1", "--decode", "http://d:1"]
# flag -> (a valid value that is not the default, the flags that make a config it is valid in)
SAMPLES = {
    "role": ("prefill", []), "host": ("0.0.0.0", DECODE), "port": ("9000", DECODE), "model": ("m2", DECODE),
    "served_model_name": ("tiny", DECODE), "dtype": ("bfloat16", DECODE), "max_slots": ("3", DECODE),
    "max_model_len": ("200", DECODE), "default_max_tokens": ("7", DECODE), "max_request_bytes": ("1000", DECODE),
    "upstream": ("http://u:2", ROUTER), "health_interval": ("0.5", ROUTER), "health_timeout": ("0.25", ROUTER),
    "upstream_timeout": ("9", ROUTER), "graceful_timeout": ("3", DECODE), "log_level": ("debug", DECODE),
    "disaggregation": ("+parallel", DECODE), "num_prefill_workers": ("3", DECODE),
    "prefill_worker": ("b:2", DECODE), "selector": ("quest", DECODE), "selector_file": ("s.pkl", DECODE),
    "transport": ("shm", DECODE), "bandwidth": ("2gbit", DECODE), "strategy": ("random", DECODE),
    "spec_ratio": ("0.5", DECODE), "max_blocks": ("64", DECODE), "profile": ("p.npz", DECODE),
    "kr_fraction": ("0.25", DECODE), "on_failure": ("recompute", DECODE), "lease_s": ("60", DECODE),
    "transfer_timeout": ("2.5", DECODE), "min_budget": ("32", DECODE), "transport_listen": ("127.0.0.1:0", DECODE),
    "worker_name": ("p-7", DECODE), "prefill_restarts": ("2", DECODE),
    "kv_layout": ("slots", []), "page_size": ("32", DECODE), "num_pages": ("200", DECODE),
    "prefill_chunk": ("256", DECODE), "enable_prefix_caching": ("false", DECODE),
    "prefix_cache_host_bytes": ("1048576", DECODE), "prefix_cache_l3": ("redis://127.0.0.1:6379/0", DECODE),
    "prefix_cache_l3_timeout": ("2.5", DECODE), "schedule": ("edf", DECODE), "cost_model": ("cost.json", DECODE),
    "tensor_parallel": ("2", []), "prefill_prefix_cache_tokens": ("4096", ["--role", "prefill"]),
    "coordinator_address": ("10.0.0.1:8476", []), "num_processes": ("2", []), "process_id": ("1", []),
    "transport_advertise": ("jkv-prefill-a:7100|jkv-prefill-a:7101", ["--role", "prefill"]), "prefill": ("http://p:2", ROUTER), "decode": ("http://d:2", ROUTER),
    "routing": ("least-load", ROUTER), "routing_chunk_chars": ("32", ROUTER), "routing_record_chunks": ("100", ROUTER),
    "routing_min_match": ("0.5", ROUTER), "balance_abs_tokens": ("512", ROUTER), "balance_rel": ("2.5", ROUTER),
}
# fields filled from another one: Disaggregation.bandwidth is also the transfer's Eq. 2 link estimate
DERIVED = {"disagg.transfer.bandwidth_bps": "bandwidth"}


def parser():
    p = argparse.ArgumentParser()
    add_serve_arguments(p)
    return p


def parse(argv):
    return config_from_args(parser().parse_args(argv))


def leaves(obj, prefix=""):
    """Dotted field path -> value of every non-dataclass field under `obj`."""
    out = {}
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            out.update(leaves(value, f"{prefix}{f.name}."))
        else:
            out[prefix + f.name] = value
    return out


@pytest.mark.parametrize("name", sorted(FLAGS))
def test_each_flag_sets_exactly_its_field(name):
    assert name in SAMPLES, f"add a valid non-default value for --{name.replace('_', '-')} to SAMPLES"
    sample, base_argv = SAMPLES[name]
    flag, path = FLAGS[name], field_path(name)
    base = parse(base_argv)
    cfg = parse(base_argv + ["--" + name.replace("_", "-"), sample])
    if name in LIST_OPTIONS:
        want = field_value(base, path) + (sample,)
    else:
        want = flag.type(sample)
    assert field_value(cfg, path) == want
    changed = {p for p, v in leaves(cfg).items() if leaves(base)[p] != v}
    expected = {path} | ({flag.switch} if flag.switch else set()) | {d for d, src in DERIVED.items() if src == name}
    assert changed == expected, f"--{name} changed {sorted(changed)}, not only its field {path}"


@pytest.mark.parametrize("name", sorted(FLAGS))
@pytest.mark.parametrize("spelling", ["-", "_"])
def test_each_config_file_key_reads_like_its_flag(tmp_path, name, spelling):
    sample = SAMPLES[name][0]
    f = tmp_path / "serve.yaml"
    f.write_text(yaml.safe_dump({name.replace("_", spelling): sample}))
    from_flag = vars(parser().parse_args(["--" + name.replace("_", "-"), sample]))[name]
    assert read_config_file(f) == {name: from_flag}


def test_the_switch_flag_turns_role_all_disaggregated_and_null_leaves_it_off(tmp_path):
    assert not parse([]).uses_disaggregation
    cfg = parse(["--disaggregation", "full"])
    assert cfg.uses_disaggregation and cfg.disagg.transfer.mode == "full"
    f = tmp_path / "serve.yaml"
    f.write_text("disaggregation: null\n")
    assert parse(["--config", str(f)]) == ServeConfig()


def test_flags_map_to_distinct_fields_and_no_field_is_repeated_between_levels():
    paths = [field_path(name) for name in FLAGS]
    assert len(set(paths)) == len(paths)
    serve = {f.name for f in dataclasses.fields(ServeConfig)} - {"disagg", "routing"}
    disagg = {f.name for f in dataclasses.fields(Disaggregation)} - {"transfer"}
    transfer = {f.name for f in dataclasses.fields(TransferConfig)}
    routing = {f.name for f in dataclasses.fields(RoutingConfig)}
    assert not serve & disagg and not serve & transfer and not disagg & transfer, (
        serve & disagg, serve & transfer, disagg & transfer)
    assert not routing & (serve | disagg | transfer), routing & (serve | disagg | transfer)
    assert ServeConfig().disagg == Disaggregation()  # the serve defaults are the engine's
    assert ServeConfig().routing == RoutingConfig()


def test_the_engine_flags_live_only_in_the_nested_batcher_config():
    """--max-slots ... --prefix-cache-l3-timeout set ServeConfig.batcher, declared once in BatcherConfig."""
    from jkv.serving.batcher import BatcherConfig

    batcher = {f.name for f in dataclasses.fields(BatcherConfig)}
    assert not batcher & {f.name for f in dataclasses.fields(ServeConfig)}
    assert {field_path(name) for name in FLAGS if field_path(name).startswith("batcher.")} == {
        "batcher." + name for name in batcher}
    assert ServeConfig().batcher == BatcherConfig()  # the serve defaults are the engine's
    cfg = parse(["--max-slots", "3", "--page-size", "32", "--enable-prefix-caching", "false"])
    assert cfg.batcher_config(256) == BatcherConfig(3, 256, page_size=32, enable_prefix_caching=False)


@pytest.mark.parametrize("argv, match", [
    # an error in a nested field names the flag that set it
    (["--num-prefill-workers", "0"], r"prefill_workers=0 must be an int >= 1 \(prefill_workers is --num-prefill-w"),
    (["--disaggregation", "fast"], r"mode='fast' must be one of .*\(mode is --disaggregation\)$"),
    # a bad L3 URL or timeout is refused at start, naming the fix
    (["--prefix-cache-l3", "127.0.0.1:6379"], r"prefix_cache_l3='127.0.0.1:6379' must start with one of redis://"),
    (["--prefix-cache-l3-timeout", "0"], r"prefix_cache_l3_timeout=0.0 must be > 0 seconds"),
])
def test_a_bad_value_is_refused_naming_the_flag_or_the_fix(argv, match):
    with pytest.raises(ValueError, match=match):
        parse(argv)


def test_an_error_in_a_field_named_like_its_flag_is_not_annotated():
    with pytest.raises(ValueError, match="strategy='best' must be one of") as e:
        parse(["--strategy", "best"])
    assert " is --" not in str(e.value)


@pytest.mark.parametrize("key", ["timeout_s", "disagg", "transfer", "mode", "addresses"])
def test_field_names_are_not_config_file_keys(tmp_path, key):
    f = tmp_path / "serve.yaml"
    f.write_text(f"{key}: 1\n")
    with pytest.raises(ValueError, match=f"unknown option '{key}'; known: .*transfer_timeout"):
        read_config_file(f)


@pytest.mark.parametrize("argv", [DECODE + ["--kv-layout", "slots"], ["--disaggregation", "full", "--kv-layout", "slots"]])
def test_the_disaggregated_engine_refuses_the_slot_layout(argv):
    with pytest.raises(ValueError, match=r"--kv-layout slots is for the colocated engine; .* paged cache only"):
        parse(argv)
    assert parse(argv[:-2] + ["--page-size", "32", "--num-pages", "99"]).batcher_config(256).num_pages == 99


@pytest.mark.parametrize("config, match", [
    (dict(kv_layout="slots"), r"kv_layout='slots': the disaggregated decode engine keeps its KV in the paged cache"),
    (dict(page_size=32), r"page_size=32, num_pages=None asked, but the decode worker was built with page_size=16"),
    (dict(num_pages=200), r"num_pages=200 asked, but .* num_pages=300; build it with DecodeWorker\(page_config="),
])
def test_the_decode_batcher_refuses_pages_its_worker_does_not_have(config, match):
    """DisaggBatcher honours --page-size / --num-pages through the worker it is given (launch builds
    the worker with them); a config that disagrees with that worker is refused, never ignored."""
    from types import SimpleNamespace as NS

    from jkv.kvcache import PageConfig
    from jkv.serving.batcher import BatcherConfig
    from jkv.serving.disagg_decode import DisaggBatcher
    from jkv.serving.paged_batcher import page_config

    model = NS(cfg=NS(max_position_embeddings=2048, eos_token_ids=(2,)))
    worker = NS(pages=NS(cache=NS(page_cfg=PageConfig(16, 300))))
    with pytest.raises(ValueError, match=match):
        DisaggBatcher(model, worker, BatcherConfig(4, 256, **config))
    assert page_config(BatcherConfig(4, 256, num_pages=300)) == worker.pages.cache.page_cfg  # what launch builds
