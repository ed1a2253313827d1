"""The Helm chart without hicache nodes: the shared L3 store and the router for SGLang / vLLM servers the
user runs (``node.enabled: false`` and ``engines``), rendered by Helm's own library.

The router's command line and router.yaml load with ``hicache route``'s own parser and loader and follow
each engine's KV events; NOTES.txt prints the storage JSON that ``hicache.integrations.sglang`` and
``hicache.integrations.vllm`` accept, pointing at the chart's Redis; bad engine entries fail the render
with one line; docs/engines-cluster.md's command lines and Helm values are the ones that work.
"""

from __future__ import annotations

import ast
import itertools
import json
import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml

helm = pytest.importorskip("helm_python")

from helm_render import CHART, NAMESPACE, RELEASE, REPO, Rendered, container, container_env, render  # noqa: E402

from hicache.integrations.store import parse_config  # noqa: E402

ENGINES = [
    {"name": "sgl0", "address": "10.0.0.1:30000", "kvEvents": "tcp://10.0.0.1:5557",
     "kvEventsReplay": "tcp://10.0.0.1:5558"},
    {"name": "sgl1", "address": "sgl1.engines.svc:30000", "kvEvents": "tcp://sgl1.engines.svc:5557"},
]
ONLY_ENGINES: dict[str, Any] = {"node": {"enabled": False}, "engines": ENGINES}
CLUSTER: dict[str, Any] = {**ONLY_ENGINES, "redis": {"cluster": {"enabled": True, "masters": 3}}}
DOC = REPO / "docs" / "engines-cluster.md"
REDIS = f"{RELEASE}-hicache-redis.{NAMESPACE}.svc:6379"
REDIS_CLUSTER = ",".join(f"{RELEASE}-hicache-redis-{i}.{RELEASE}-hicache-redis-headless.{NAMESPACE}.svc:6379"
                         for i in range(3))


@pytest.fixture(scope="module")
def single() -> Rendered:
    return render(ONLY_ENGINES)


@pytest.fixture(scope="module")
def cluster() -> Rendered:
    return render(CLUSTER)


def components(r: Rendered) -> set[str]:
    return {d["metadata"].get("labels", {}).get("app.kubernetes.io/component", "") for d in r.docs}


# --- what is deployed ------------------------------------------------------------------------------------


def test_no_hicache_node_is_deployed(single: Rendered, cluster: Rendered) -> None:
    for r in (single, cluster):
        assert not r.kinds("DaemonSet")
        assert "node" not in components(r), [d["metadata"]["name"] for d in r.docs]
        assert all(d["metadata"]["name"] != f"{RELEASE}-hicache-node" for d in r.docs)
        assert [d["metadata"]["name"] for d in r.kinds("Deployment")] == [f"{RELEASE}-hicache-router"]
        (cm,) = r.kinds("ConfigMap")
        assert set(cm["data"]) == {"router.yaml"}  # no node, no hicache.yaml
    assert "node" in components(render({}))  # the default still deploys nodes


@pytest.mark.parametrize("values", [ONLY_ENGINES, CLUSTER], ids=["redis", "redis-cluster"])
def test_lint_and_kubernetes_schemas(values: dict[str, Any]) -> None:
    kv = pytest.importorskip("kubernetes_validate")
    report = helm.lint(CHART, values, strict=True, kube_version="v1.27.0")  # Chart.yaml's kubeVersion
    assert report["errors"] == [] and [m for m in report["messages"] if m["severity"] >= 2] == []
    for doc in render(values).docs:
        kv.validate(doc, kv.latest_version(), strict=True)


def test_redis_standalone_and_cluster(single: Rendered, cluster: Rendered) -> None:
    sts = single.component("redis")
    assert sts["spec"]["replicas"] == 1 and not single.kinds("Job")
    args = container(sts)["args"]
    assert "--cluster-enabled" not in args and "--requirepass" in args
    sts = cluster.component("redis")
    assert sts["spec"]["replicas"] == 3
    args = container(sts)["args"]
    assert args[args.index("--cluster-enabled") + 1] == "yes"
    (job,) = cluster.kinds("Job")
    assert job["metadata"]["annotations"]["helm.sh/hook"] == "post-install"
    assert "redis-password" in single.secret_data() and "redis-password" in cluster.secret_data()


# --- the router ------------------------------------------------------------------------------------------


def router_yaml(r: Rendered) -> str:
    (cm,) = [c for c in r.kinds("ConfigMap") if "router.yaml" in c.get("data", {})]
    return str(cm["data"]["router.yaml"])


def load_router(r: Rendered, tmp_path: Path, argv: list[str] | None = None) -> tuple[Any, Any]:
    """(namespace config, RouterConfig) as `hicache route` builds them in the rendered router pod."""
    from hicache.cli import build_parser
    from hicache.router.cli import overrides_from_args
    from hicache.router.config import load_router_config

    c = container(r.component("router"))
    argv = [*c.get("command", []), *c["args"]] if argv is None else argv
    args = build_parser("route").parse_args(argv)
    assert args.command == "route" and args.config == "/etc/hicache/router.yaml"
    path = tmp_path / "router.yaml"
    path.write_text(router_yaml(r))
    return load_router_config(path, env=container_env(r, c), overrides=overrides_from_args(args))


def test_router_follows_the_engines_kv_events(single: Rendered, cluster: Rendered, tmp_path: Path) -> None:
    for r in (single, cluster):
        c = container(r.component("router"))
        assert "command" not in c and c["args"][0] == "route"  # no node discovery without nodes
        assert [a for a in c["args"] if a.startswith("--node=")] == [
            f"--node={e['name']}={e['address']}" for e in ENGINES]
        data = yaml.safe_load(router_yaml(r))["router"]
        assert data["kv_events"] == {e["name"]: e["kvEvents"] for e in ENGINES}
        assert data["kv_events_replay"] == {"sgl0": "tcp://10.0.0.1:5558"}
        _, rc = load_router(r, tmp_path)
        assert [(n.name, n.address) for n in rc.nodes] == [(e["name"], e["address"]) for e in ENGINES]
        assert rc.kv_events == {e["name"]: e["kvEvents"] for e in ENGINES}
        assert rc.kv_events_replay == {"sgl0": "tcp://10.0.0.1:5558"}
        assert rc.index == "events" and rc.engine_metrics_path == "/metrics"


def test_engines_beside_hicache_nodes_and_router_config(tmp_path: Path) -> None:
    """Engines add to the hicache nodes (and to router.nodes); router.config.kv_events entries are kept."""
    r = render({"node": {"kind": "statefulset", "replicas": 2}, "engines": ENGINES[:1]})
    assert r.component("node")["kind"] == "StatefulSet"
    _, rc = load_router(r, tmp_path)
    assert [n.name for n in rc.nodes] == [f"{RELEASE}-hicache-node-0", f"{RELEASE}-hicache-node-1", "sgl0"]
    assert rc.kv_events == {"sgl0": "tcp://10.0.0.1:5557"}
    r = render({"node": {"enabled": False}, "engines": ENGINES[1:],
                "router": {"nodes": ["v0=10.0.0.9:8000"], "config": {"kv_events": {"v0": "tcp://10.0.0.9:5557"}}}})
    _, rc = load_router(r, tmp_path)
    assert [n.name for n in rc.nodes] == ["v0", "sgl1"]
    assert rc.kv_events == {"v0": "tcp://10.0.0.9:5557", "sgl1": "tcp://sgl1.engines.svc:5557"}


# --- NOTES.txt: what the engines are launched with -------------------------------------------------------


def quoted_after(notes: str, flag: str) -> list[Any]:
    """The JSON arguments (single-quoted for the shell) after each ``flag`` in NOTES."""
    return [json.loads(s) for s in re.findall(rf"{flag}\s+(?:\\\n\s*)?'([^']*)'", notes)]


def module_names(path: str, constant: str) -> tuple[set[str], Any]:
    """Classes defined in a hicache module and the value of one of its constants, read from the source
    (importing the adapters needs the engines installed)."""
    tree = ast.parse((REPO / path).read_text())
    classes = {n.name for n in tree.body if isinstance(n, ast.ClassDef)}
    value = next(ast.literal_eval(n.value) for n in tree.body if isinstance(n, ast.Assign)
                 and any(isinstance(t, ast.Name) and t.id == constant for t in n.targets))
    return classes, value


@pytest.mark.parametrize(("values", "hosts", "scheme"), [(ONLY_ENGINES, REDIS, "redis"),
                                                         (CLUSTER, REDIS_CLUSTER, "redis+cluster")],
                         ids=["redis", "redis-cluster"])
def test_notes_print_the_sglang_storage_json(values: dict[str, Any], hosts: str, scheme: str) -> None:
    notes = render(values).notes
    (cfg,) = quoted_after(notes, "--hicache-storage-backend-extra-config")
    classes, sglang_keys = module_names("hicache/integrations/sglang.py", "SGLANG_KEYS")
    assert set(sglang_keys) <= set(cfg)
    assert cfg["backend_name"] == "hicache" and cfg["interface_v1"] == 1
    assert cfg["module_path"] == "hicache.integrations.sglang" and cfg["class_name"] in classes
    fields = {k: v for k, v in cfg.items() if k not in sglang_keys}  # as hicache_fields() drops them
    engine_cfg = parse_config(fields, "--hicache-storage-backend-extra-config")
    assert engine_cfg.storage.url == f"{scheme}://:PASSWORD@{hosts}" and engine_cfg.tenant == ""
    assert "PASSWORD below is the Redis password" in notes and "jsonpath='{.data.redis-password}'" in notes
    assert "--page-size 64" in notes and "--enable-hierarchical-cache" in notes


def test_notes_print_the_vllm_kv_transfer_config(single: Rendered) -> None:
    from hicache.integrations.vllm_plan import WHERE, split_config

    (cfg,) = quoted_after(single.notes, "--kv-transfer-config")
    classes, _ = module_names("hicache/integrations/vllm.py", "VLLM_TESTED")
    assert cfg["kv_connector"] in classes and cfg["kv_connector_module_path"] == "hicache.integrations.vllm"
    assert cfg["kv_role"] == "kv_both"
    assert cfg["kv_load_failure_policy"] == "recompute"  # the connector refuses to start otherwise
    store_fields, _ = split_config(cfg["kv_connector_extra_config"])
    assert parse_config(store_fields, WHERE).storage.url == f"redis://:PASSWORD@{REDIS}"
    assert "--block-size 64" in single.notes and "--prefix-caching-hash-algo sha256" in single.notes


def test_notes_print_the_kv_events_config_and_the_router(single: Rendered) -> None:
    sglang, vllm = quoted_after(single.notes, "--kv-events-config")
    want = {"publisher": "zmq", "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"}  # sgl0's ports
    assert sglang == want and vllm == {**want, "enable_kv_cache_events": True}
    for e in ENGINES:
        assert f"{e['name']}: http://{e['address']}, KV events {e['kvEvents']}" in single.notes
    assert f"{RELEASE}-hicache-router.{NAMESPACE}.svc:50061" in single.notes
    assert "Node service" not in single.notes and "grpc.health.v1" not in single.notes


def test_notes_with_other_stores_and_tenants() -> None:
    notes = render({**ONLY_ENGINES, "redis": {"auth": {"enabled": False}},
                    "config": {"model": {"tenant": "acme"}, "layout": {"page_size": 16}}}).notes
    (cfg,) = quoted_after(notes, "--hicache-storage-backend-extra-config")
    assert (cfg["url"], cfg["tenant"]) == (f"redis://{REDIS}", "acme") and "PASSWORD" not in notes
    assert "--page-size 16" in notes and "--block-size 16" in notes
    notes = render({**ONLY_ENGINES, "redis": {"enabled": False},
                    "externalStorage": {"url": "redis://:pw@10.0.0.5:6379"}}).notes
    (cfg,) = quoted_after(notes, "--kv-transfer-config")
    assert cfg["kv_connector_extra_config"]["url"] == "STORAGE_URL" and "pw@" not in notes
    assert "jsonpath='{.data.storage-url}'" in notes
    assert "--hicache-storage-backend-extra-config" not in render({}).notes  # only with engines


# --- bad values ------------------------------------------------------------------------------------------

BAD = [
    ({"node": {"enabled": False}}, "node.enabled=false deploys no hicache node"),
    ({"node": {"enabled": False}, "router": {"enabled": False}}, "node.enabled=false deploys no hicache node"),
    ({"engines": [{"address": "10.0.0.1:30000", "kvEvents": "tcp://10.0.0.1:5557"}]}, r'engines\[0\]: name ""'),
    ({"engines": [{"name": "a/b", "address": "h:1", "kvEvents": "tcp://h:2"}]}, r'engines\[0\]: name "a/b"'),
    ({"engines": [{"name": "e", "kvEvents": "tcp://h:2"}]}, r'engines\[0\] \(e\): address ""'),
    ({"engines": [{"name": "e", "address": "h:70000", "kvEvents": "tcp://h:2"}]}, r'address "h:70000"'),
    ({"engines": [{"name": "e", "address": "h:1"}]}, r"engines\[0\] \(e\): kvEvents: required"),
    ({"engines": [{"name": "e", "address": "h:1", "kvEvents": "tcp://*:5557"}]}, "'\\*' binds on the engine's side"),
    ({"engines": [{"name": "e", "address": "h:1", "kvEvents": "h:5557"}]}, 'kvEvents "h:5557": not a ZeroMQ'),
    ({"engines": [{"name": "e", "address": "h:1", "kvEvents": "tcp://h:2", "kvEventsReplay": "tcp://h:0"}]},
     'kvEventsReplay "tcp://h:0": not a ZeroMQ'),
    ({"engines": [*ENGINES, {**ENGINES[0], "address": "10.0.0.7:30000"}]}, "sgl0=10.0.0.7:30000 names a node already"),
    ({"router": {"nodes": ["x=10.0.0.1:30000"]}, "engines": ENGINES}, "sgl0=10.0.0.1:30000 names a node already"),
    ({"engines": ENGINES, "router": {"config": {"index": "approximate"}}}, "router.config.index=approximate"),
]


@pytest.mark.parametrize(("values", "message"), BAD, ids=[m for _, m in BAD])
def test_bad_values_fail_with_one_line(values: dict[str, Any], message: str) -> None:
    with pytest.raises(helm.HelmRenderError, match=message) as e:
        render(values)
    assert "\n" not in str(e.value).strip()
    assert not re.search("nil pointer|wrong type|can't evaluate|error calling", str(e.value))


def test_schema_refuses_unknown_engine_keys() -> None:
    with pytest.raises(helm.HelmValuesError, match="kv_events"):
        render({**ONLY_ENGINES, "engines": [{**ENGINES[0], "kv_events": "tcp://h:1"}]})


# --- docs/engines-cluster.md ------------------------------------------------------------------------------


def doc_blocks(lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", DOC.read_text(), re.M | re.S)


def doc_commands() -> list[list[str]]:
    out = []
    for block in doc_blocks("bash"):
        for line in block.replace("\\\n", " ").splitlines():
            argv = shlex.split(line, comments=True)
            if argv:
                out.append(argv)
    return out


def test_doc_route_commands_parse_and_load(tmp_path: Path) -> None:
    from hicache.cli import build_parser
    from hicache.router.cli import overrides_from_args
    from hicache.router.config import load_router_config

    routes = [a for a in doc_commands() if a[:2] == ["hicache", "route"]]
    assert routes
    for argv in routes:
        args = build_parser("route").parse_args(argv[1:])
        assert args.kv_events, argv
        _, rc = load_router_config(None, env={}, overrides=overrides_from_args(args))
        assert set(rc.kv_events) == {n.name for n in rc.nodes}


def test_doc_engine_commands_carry_configs_hicache_accepts() -> None:
    from hicache.integrations.vllm_plan import WHERE, split_config

    _, sglang_keys = module_names("hicache/integrations/sglang.py", "SGLANG_KEYS")
    seen = set()
    for argv in doc_commands():
        for flag, value in itertools.pairwise(argv):
            if flag == "--hicache-storage-backend-extra-config":
                cfg = json.loads(value)
                parse_config({k: v for k, v in cfg.items() if k not in sglang_keys}, flag)
                assert cfg["module_path"] == "hicache.integrations.sglang" and cfg["interface_v1"] == 1
                seen.add(flag)
            elif flag == "--kv-transfer-config":
                cfg = json.loads(value)
                assert cfg["kv_load_failure_policy"] == "recompute"
                parse_config(split_config(cfg["kv_connector_extra_config"])[0], WHERE)
                seen.add(flag)
            elif flag == "--kv-events-config":
                assert json.loads(value)["publisher"] == "zmq"
                seen.add(flag)
    assert seen == {"--hicache-storage-backend-extra-config", "--kv-transfer-config", "--kv-events-config"}


def test_doc_helm_values_render(tmp_path: Path) -> None:
    (values_text,) = doc_blocks("yaml")
    values = yaml.safe_load(values_text)
    r = render(values)
    assert "node" not in components(r)
    _, rc = load_router(r, tmp_path)
    assert set(rc.kv_events) == {e["name"] for e in values["engines"]}
    installs = [a for a in doc_commands() if a[:2] == ["helm", "install"]]
    assert installs and all("deploy/helm/hicache" in a for a in installs)


def test_doc_metric_names_are_exported() -> None:
    from hicache.metrics.catalog import series_names

    names = {n for n in re.findall(r"\bhicache_[a-z0-9_]+\b", DOC.read_text()) if not n.endswith("_")}  # not a glob
    assert names and names <= series_names(), sorted(names - series_names())
