"""deploy/ (issue 21, item 6): the Kubernetes manifests are valid offline — built-in kinds against the
Kubernetes JSON schemas PyPI `kubernetes-validate` carries, the LeaderWorkerSet by YAML parsing plus the
fields its controller needs (its pod templates against the built-in PodTemplate schema) — Services
and Secrets referenced exist, every jkv pod is probed and scraped, and every `jkv` command line in
the manifests and in docs/deploy.md is accepted by jkv's own argument parsers (parsed, never run)."""
import re
import shlex
from pathlib import Path

import pytest
import yaml

from jkv.cli import build_parser
from jkv.serving.config import config_from_args

kubernetes_validate = pytest.importorskip(
    "kubernetes_validate", reason="needs PyPI kubernetes-validate (pip install -e '.[dev]')")

REPO = Path(__file__).resolve().parents[1]
K8S = REPO / "deploy" / "k8s"
DOCS = REPO / "docs" / "deploy.md"
K8S_VERSION = "1.30.0"  # the oldest Kubernetes the manifests target (LeaderWorkerSet needs >= 1.26)
LWS_API = "leaderworkerset.x-k8s.io/v1"


def _documents():
    out = []
    for path in sorted(K8S.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc is not None:
                out.append((path.name, doc))
    return out


DOCS_ = _documents()
BUILTIN = [(f, d) for f, d in DOCS_ if d["apiVersion"] != LWS_API]
LWS = [d for _, d in DOCS_ if d["apiVersion"] == LWS_API]


def _pod_templates():
    """(where, pod template) of every Deployment and of the LeaderWorkerSet's leader and workers."""
    for f, d in DOCS_:
        if d["kind"] == "Deployment":
            yield f"{f}:{d['metadata']['name']}", d["spec"]["template"]
        elif d["kind"] == "LeaderWorkerSet":
            lwt = d["spec"]["leaderWorkerTemplate"]
            for part in ("leaderTemplate", "workerTemplate"):
                if part in lwt:
                    yield f"{f}:{d['metadata']['name']}.{part}", lwt[part]


def _jkv_containers():
    for where, tmpl in _pod_templates():
        for c in tmpl["spec"]["containers"]:
            if c.get("command", [None])[0] == "jkv":
                yield f"{where}/{c['name']}", tmpl, c


def test_the_manifests_hold_every_role():
    kinds = {(d["kind"], d["metadata"]["name"]) for _, d in DOCS_}
    assert {("Deployment", "jkv-prefill-a"), ("Deployment", "jkv-decode"), ("Deployment", "jkv-router"),
            ("Service", "jkv"), ("Service", "jkv-decode"), ("Secret", "jkv-transport"),
            ("LeaderWorkerSet", "jkv-replica")} <= kinds, kinds
    assert len(list(_jkv_containers())) >= 6


@pytest.mark.parametrize("doc", [d for _, d in BUILTIN], ids=[f"{f}:{d['kind']}/{d['metadata']['name']}"
                                                                  for f, d in BUILTIN])
def test_built_in_kinds_validate_against_the_kubernetes_schema(doc):
    kubernetes_validate.validate(doc, K8S_VERSION, strict=True)  # raises naming the bad field


def test_the_leaderworkerset_has_the_fields_its_controller_needs():
    assert len(LWS) == 1
    lws = LWS[0]
    assert lws["kind"] == "LeaderWorkerSet"
    assert re.fullmatch(r"[a-z]([-a-z0-9]{0,61}[a-z0-9])?", lws["metadata"]["name"])  # it names a Service
    spec = lws["spec"]
    assert isinstance(spec["replicas"], int) and spec["replicas"] >= 1
    assert spec.get("startupPolicy", "LeaderCreated") in ("LeaderCreated", "LeaderReady")
    assert spec["rolloutStrategy"]["type"] == "RollingUpdate"
    lwt = spec["leaderWorkerTemplate"]
    assert isinstance(lwt["size"], int) and lwt["size"] >= 2  # a leader and at least one worker
    assert lwt.get("restartPolicy", "RecreateGroupOnPodRestart") in ("RecreateGroupOnPodRestart", "None")
    assert "workerTemplate" in lwt
    for part in ("leaderTemplate", "workerTemplate"):
        template = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": f"lws-{part.lower()}"},
                    "template": lwt[part]}
        kubernetes_validate.validate(template, K8S_VERSION, strict=True)
    # the leader reaches its workers as <pod>-<index>.<lws name>, index 1 .. size-1
    leader = next(c for c in lwt["leaderTemplate"]["spec"]["containers"] if c["name"] == "decode")
    workers = [value for flag, value in zip(leader["args"], leader["args"][1:]) if flag == "--prefill-worker"]
    name = lws["metadata"]["name"]
    assert workers == [f"$(POD_NAME)-{i}.{name}:7100|$(POD_NAME)-{i}.{name}:7101" for i in range(1, lwt["size"])]


def test_services_select_pods_and_target_ports_that_exist():
    templates = [t for _, t in _pod_templates()]
    for _, svc in ((f, d) for f, d in DOCS_ if d["kind"] == "Service"):
        selector = svc["spec"]["selector"]
        pods = [t for t in templates if selector.items() <= t["metadata"]["labels"].items()]
        assert pods, f"Service {svc['metadata']['name']} selects no pod template ({selector})"
        ports = {p["name"] for t in pods for c in t["spec"]["containers"] for p in c.get("ports", [])}
        for p in svc["spec"]["ports"]:
            assert p["targetPort"] in ports, f"Service {svc['metadata']['name']}: no container port {p['targetPort']}"


def test_every_jkv_pod_is_probed_scraped_and_gets_the_transport_secret_it_needs():
    secrets = {d["metadata"]["name"]: set(d.get("stringData", {})) | set(d.get("data", {}))
               for _, d in DOCS_ if d["kind"] == "Secret"}
    for where, tmpl, c in _jkv_containers():
        assert c["livenessProbe"]["httpGet"]["path"] == "/health", where
        assert c["readinessProbe"]["httpGet"]["path"] == "/ready", where
        ann = tmpl["metadata"]["annotations"]
        assert ann["prometheus.io/scrape"] == "true" and ann["prometheus.io/path"] == "/metrics", where
        assert int(ann["prometheus.io/port"]) in {p["containerPort"] for p in c["ports"]}, where
        role = c["args"][c["args"].index("--role") + 1]
        env = {e["name"]: e for e in c.get("env", [])}
        if role in ("prefill", "decode"):
            ref = env["JKV_SECRET"]["valueFrom"]["secretKeyRef"]
            assert ref["key"] in secrets[ref["name"]], where


def _expand(arg: str) -> str:
    """Kubernetes expands $(VAR) in args from the container's env: any name parses the same."""
    return re.sub(r"\$\((\w+)\)", lambda m: m[1].lower().replace("_", "-"), arg)


def _parse_jkv(argv: list[str], where: str):
    try:
        args = build_parser().parse_args(argv)
    except SystemExit:
        pytest.fail(f"{where}: jkv's parser rejects `jkv {shlex.join(argv)}` (see the usage message above)")
    if args.command in ("serve", "decode-worker"):
        if args.command == "decode-worker":
            args.role = "decode"
        config_from_args(args)  # raises ValueError naming a bad value or combination
    return args


@pytest.mark.parametrize("where,container", [(w, c) for w, _, c in _jkv_containers()],
                         ids=[w for w, _, _ in _jkv_containers()])
def test_every_jkv_command_line_in_the_manifests_parses(where, container):
    argv = [_expand(a) for a in container["command"][1:] + container.get("args", [])]
    _parse_jkv(argv, where)


def _doc_command_lines() -> list[str]:
    """`jkv ...` command lines of the fenced code blocks of docs/deploy.md (continuations joined,
    leading VAR=value assignments dropped, cut at a shell operator)."""
    text = DOCS.read_text()
    lines = []
    for block in re.findall(r"```[a-z]*\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            tokens = shlex.split(line, comments=True)
            while tokens and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", tokens[0]):
                tokens = tokens[1:]
            if tokens and tokens[0] == "jkv":
                cut = next((i for i, t in enumerate(tokens) if t in ("&", "&&", "|", ";", ">", "2>")), len(tokens))
                lines.append(tokens[1:cut])
    return lines


def test_every_jkv_command_line_in_docs_deploy_parses():
    commands = _doc_command_lines()
    roles = set()
    for argv in commands:
        args = _parse_jkv([_expand(a) for a in argv], "docs/deploy.md")
        roles.add(getattr(args, "role", args.command))
    assert {"prefill", "decode", "router"} <= roles, f"docs/deploy.md shows no command for some role: {roles}"


def test_the_command_line_check_catches_a_bad_flag():
    with pytest.raises(pytest.fail.Exception, match="rejects"):
        _parse_jkv(["serve", "--role", "prefill", "--no-such-flag"], "probe")
    with pytest.raises(ValueError, match="--prefill-worker"):
        _parse_jkv(["serve", "--role", "decode"], "probe")


# ----------------------------------------------------------------------------- flags the manifests rely on
def test_a_prefill_worker_binds_a_fixed_main_and_bulk_port_pair():
    import socket
    from types import SimpleNamespace

    from jkv.disagg.prefill_worker import PrefillWorker
    from transport import Endpoint

    ports = []
    for _ in range(2):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    pair = f"127.0.0.1:{ports[0]}|127.0.0.1:{ports[1]}"
    worker = SimpleNamespace(endpoint=Endpoint("p", secret="deploy-test-secret"),
                             bulk=Endpoint("p.bulk", secret="deploy-test-secret"))
    try:
        assert PrefillWorker.listen(worker, pair) == pair
    finally:
        worker.endpoint.close()
        worker.bulk.close()


def test_transport_advertise_is_a_main_bulk_pair_of_a_prefill_role():
    from jkv.serving.config import ServeConfig

    assert ServeConfig(role="prefill", transport_advertise="p:7100|p:7101").transport_advertise == "p:7100|p:7101"
    with pytest.raises(ValueError, match="only for --role prefill"):
        ServeConfig(role="router", upstream=("http://a:1",), transport_advertise="p:7100|p:7101")
    with pytest.raises(ValueError, match="must be a main\\|bulk pair"):
        ServeConfig(role="prefill", transport_advertise="p:7100")


def test_the_placeholder_secret_of_the_manifest_is_refused(monkeypatch):
    from jkv.serving import launch

    secret = next(d for _, d in DOCS_ if d["kind"] == "Secret")["stringData"]["JKV_SECRET"]
    monkeypatch.setenv("JKV_SECRET", secret)
    with pytest.raises(ValueError, match="placeholder of deploy/k8s/secret.yaml"):
        launch._secret()
    monkeypatch.setenv("JKV_SECRET", "a-random-deployment-secret")
    assert launch._secret() == "a-random-deployment-secret"
