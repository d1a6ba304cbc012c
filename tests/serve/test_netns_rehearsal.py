"""A rehearsal of a multi-machine deployment on one machine (issue 21): the router, two
`--role prefill` servers and one `jkv decode-worker` each in its own network namespace, joined by
tbf-shaped veths to one bridge (`transport.netns.StarNetwork`), every role bound to its namespace's
address only (nothing on loopback crosses roles), served to the official openai client from the
root namespace. The second prefill role runs at --tensor-parallel 2, the decode role at 1. Killing
the first prefill namespace's process is survived: the router drops it, and new requests run on the
TP 2 one with the same greedy text. Needs root ('ip netns'); skipped with the reason otherwise."""
import functools
import signal
import subprocess

import openai
import pytest

from conftest import REPO, ServerProcess, health, wait_for as wait_until
from jkv import SamplingParams
from transport.netns import StarNetwork, netns_available

_OK, _WHY = netns_available()
pytestmark = [pytest.mark.skipif(not _OK, reason=f"netns+veth+tbf not permitted: {_WHY}"), pytest.mark.slow]

SECRET = {"JKV_SECRET": "netns-rehearsal-secret"}
LINK = "200mbit"  # tc tbf on both ends of every veth
TRANSFER = ["--selector", "streamingllm", "--strategy", "sequential", "--kr-fraction", "0.3"]


class NsServer(ServerProcess):
    """`python -m jkv.cli COMMAND --host ADDR ...` inside namespace `name`; `url` from its startup log."""

    def __init__(self, net, name, command, args, env, ready_timeout=180):
        self.name = name
        super().__init__(args, dict(env, PYTHONPATH=str(REPO)), ready_timeout, command, wait=False,
                         host=net.addr[name], prefix=tuple(net.exec_in(name)))


wait_for = functools.partial(wait_until, timeout=30, poll=0.1)  # this file's default wait


def test_router_two_prefills_and_a_decode_in_separate_namespaces_survive_a_killed_prefill(tiny_dir, cache_env,
                                                                                          tiny_llm):
    env = dict(cache_env, **SECRET)
    common = ["--model", str(tiny_dir), "--port", "0", "--selector", "streamingllm"]
    servers = []
    with StarNetwork(["router", "prefill-a", "prefill-b", "decode"], rate=LINK) as net:
        try:
            # prefill-b runs at TP 2 on 2 CPU devices; the decode role at TP 1 (the KV crosses per KV-head slice)
            prefills = [NsServer(net, name, "serve", ["--role", "prefill", *common, "--worker-name", name,
                                                      "--transport-listen", f"{net.addr[name]}:0", "--lease-s", "60",
                                                      "--tensor-parallel", str(tp)],
                                 dict(env, XLA_FLAGS=f"--xla_force_host_platform_device_count={tp}"))
                        for name, tp in (("prefill-a", 1), ("prefill-b", 2))]
            servers += prefills
            for p in prefills:
                p.wait_ready()
            addrs = [health(p.url)["transport_address"] for p in prefills]
            for p, a in zip(prefills, addrs):  # each listens on its own namespace's address, not loopback
                assert p.url.startswith(f"http://{net.addr[p.name]}:") and a.startswith(net.addr[p.name] + ":")
            decode = NsServer(net, "decode", "decode-worker",
                              ["--model", str(tiny_dir), "--served-model-name", "tiny", "--port", "0", *TRANSFER,
                               "--disaggregation", "smartgen", "--max-slots", "4", "--max-model-len", "512",
                               "--prefill-worker", addrs[0], "--prefill-worker", addrs[1]], env)
            servers.append(decode)
            decode.wait_ready()
            router = NsServer(net, "router", "serve",
                              ["--role", "router", "--port", "0", "--prefill", prefills[0].url, "--prefill",
                               prefills[1].url, "--decode", decode.url, "--health-interval", "0.2",
                               "--health-timeout", "1"], {})
            servers.append(router)
            router.wait_ready()
            assert router.url.startswith(f"http://{net.addr['router']}:")

            client = openai.OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0, timeout=120)
            prompt = "the quick brown fox"
            want = tiny_llm.generate(prompt, SamplingParams(max_tokens=12, ignore_eos=True))[0].text
            texts = [client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0,
                                               extra_body={"ignore_eos": True}).choices[0].text for _ in range(2)]
            assert texts == [want, want]  # the colocated greedy text, through router -> prefill -> decode
            served = [health(p.url) for p in prefills]

            victim, survivor = prefills
            victim.proc.send_signal(signal.SIGKILL)
            victim.proc.wait(10)
            wait_for(lambda: not next(u for u in health(router.url)["upstreams"] if u["url"] == victim.url)["healthy"],
                     what="the router dropping the killed prefill instance")
            assert health(survivor.url)["handshake"]["config"]["tensor_parallel"] == 2
            for _ in range(3):  # served by the surviving namespace: prefill TP 2 -> decode TP 1
                r = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0,
                                              extra_body={"ignore_eos": True})
                assert r.choices[0].text == want
            assert health(router.url)["status"] == "ok"
            assert health(survivor.url)["status"] == "ok"
            assert all(s["handshake"]["agreed_with"] for s in served)  # the decode worker connected to both
        finally:
            for s in reversed(servers):
                s.stop()
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(ns in listed for ns in net.ns.values())  # the namespaces (and their veths) are gone
