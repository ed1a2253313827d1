"""The Helm chart (deploy/helm/hicache), rendered by Helm's own library for several value sets.

Every rendered manifest must validate against Kubernetes' schemas (strict: unknown fields are errors)
for the oldest supported and the newest known Kubernetes version; the ConfigMap must be a valid hicache
config; secrets must only travel through the Secret; nodes carry GPU resources and gRPC probes.
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any
from urllib.parse import parse_qsl, urlparse

import pytest

helm = pytest.importorskip("helm_python")
kv = pytest.importorskip("kubernetes_validate")

from helm_render import CHART, NAMESPACE, RELEASE, Rendered, container, container_env, pod_spec, render  # noqa: E402

from hicache.config import config_from_dict  # noqa: E402
from hicache.config_load import env_overrides, merge  # noqa: E402

OLDEST_KUBE = "1.27.0"  # Chart.yaml kubeVersion; native grpc probes are GA from 1.27


def kube_versions() -> list[str]:
    """The oldest supported Kubernetes (or the oldest schema this kubernetes-validate ships) and the newest."""
    from packaging.version import Version

    oldest = max(OLDEST_KUBE, kv.utils.all_versions()[0], key=Version)
    return sorted({oldest, kv.latest_version()}, key=Version)

SMALL = {"layout": {"num_layers": 2, "num_kv_heads": 2, "head_dim": 8, "dtype": "float16", "page_size": 16},
         "cache": {"l1_tokens": 4096, "l2_tokens": 4096}}

CASES: dict[str, dict[str, Any]] = {
    "default": {},
    "cpu-statefulset": {"node": {"kind": "statefulset", "replicas": 3, "gpu": {"enabled": False}}, "config": SMALL},
    # the default config on a CPU node: L1 (8 GiB) is host memory too, 42 GiB in all
    "cpu-no-router-no-l3": {"node": {"gpu": {"enabled": False}, "resources": {"limits": {"memory": "42Gi"}}},
                            "router": {"enabled": False},
                            "redis": {"enabled": False}, "metrics": {"enabled": False}},
    "redis-cluster-auth-tls": {
        "auth": {"enabled": True},
        "tls": {"enabled": True, "secretName": "hicache-tls", "mtls": True},
        "redis": {"cluster": {"enabled": True, "masters": 3}, "persistence": {"enabled": True, "size": "10Gi"}},
        "metrics": {"serviceMonitor": {"enabled": True, "labels": {"release": "prometheus"}},
                    "prometheusRule": {"enabled": True, "hitRateBelow": 0.5}, "grafanaDashboard": {"enabled": True}},
        "node": {"gpu": {"count": 2}, "hostIPC": True},
    },
    "external-store": {"redis": {"enabled": False},
                       "externalStorage": {"url": "redis+cluster://app:s3cret@10.0.0.1:6379,10.0.0.2:6379"},
                       "router": {"nodes": ["a=10.1.0.1:50051", "b=10.1.0.2:50051"]}},
    "existing-secrets": {"auth": {"enabled": True, "existingSecret": "ops-auth", "existingSecretKey": "token"},
                         "redis": {"enabled": False},
                         "externalStorage": {"existingSecret": "ops-store", "existingSecretKey": "url"}},
    "mla-write-back": {"config": {"layout": {"attention": "mla", "num_kv_heads": 1, "head_dim": 576},
                                  "cache": {"write_policy": "write_back", "eviction_policy": "lru"},
                                  "storage": {"prefetch_policy": "best_effort", "options": {"ttl_s": 3600},
                                              "prefetch_max_inflight_bytes": 16 << 30},  # > 2**32: no float form
                                  "model": {"name": "deepseek-v3", "revision": "abc123", "tp_size": 8}}},
}
EXTERNAL_SECRETS = {("ops-auth", "token"): "ops-token", ("ops-store", "url"): "file:///mnt/l3"}


@pytest.fixture(scope="module")
def rendered() -> dict[str, Rendered]:
    return {name: render(values) for name, values in CASES.items()}


def node_container(r: Rendered) -> dict[str, Any]:
    return container(r.component("node"), "node")


# --- the chart as Helm sees it --------------------------------------------------------------------------


@pytest.mark.parametrize("case", sorted(CASES))
def test_lint_is_clean(case: str) -> None:
    report = helm.lint(CHART, CASES[case] or None, strict=True, kube_version=f"v{OLDEST_KUBE}")
    assert report["errors"] == []
    worse_than_info = [m for m in report["messages"] if m["severity"] >= 2]
    assert worse_than_info == []


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_manifest_validates_against_kubernetes(rendered: dict[str, Rendered], case: str) -> None:
    r = rendered[case]
    assert r.docs
    versions = kube_versions()
    assert len(versions) == 2
    for version in versions:
        for doc in r.docs:
            if doc["kind"] in ("ServiceMonitor", "PrometheusRule"):  # CRDs: no schema in Kubernetes itself
                continue
            kv.validate(doc, version, strict=True)


def test_servicemonitor_shape(rendered: dict[str, Rendered]) -> None:
    r = rendered["redis-cluster-auth-tls"]
    (sm,) = r.kinds("ServiceMonitor")
    assert sm["apiVersion"] == "monitoring.coreos.com/v1"
    assert sm["metadata"]["labels"]["release"] == "prometheus"
    selected = [s for s in r.kinds("Service")
                if sm["spec"]["selector"]["matchLabels"].items() <= s["metadata"]["labels"].items()]
    names = {s["metadata"]["name"] for s in selected}
    assert names == {f"{RELEASE}-hicache-node-headless", f"{RELEASE}-hicache-router"}
    for s in selected:
        assert "metrics" in {p["name"] for p in s["spec"]["ports"]}
    assert [e["port"] for e in sm["spec"]["endpoints"]] == ["metrics"]
    assert not rendered["default"].kinds("ServiceMonitor")


# --- config ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", sorted(CASES))
def test_configmap_is_a_valid_hicache_config(rendered: dict[str, Rendered], case: str) -> None:
    r = rendered[case]
    cfg = config_from_dict(r.config_data())
    c = node_container(r)
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert cfg.serve.host == "0.0.0.0"
    assert cfg.serve.port == ports["grpc"]
    assert cfg.serve.metrics_port == ports.get("metrics", 0)
    gpu = CASES[case].get("node", {}).get("gpu", {}).get("enabled", True)
    assert cfg.cache.device == ("cuda" if gpu else "cpu")
    for section, values in CASES[case].get("config", {}).items():
        for k, v in values.items():
            assert getattr(getattr(cfg, section), k) == v, f"{section}.{k}"
    # The node reads the same file plus its environment, as `hicache serve` does (env wins).
    env = container_env(r, c, EXTERNAL_SECRETS)
    full = config_from_dict(merge(r.config_data(), env_overrides(env)))
    assert full.serve.port == cfg.serve.port


def test_config_defaults_match_hicache_defaults(rendered: dict[str, Rendered]) -> None:
    """values.yaml's config section restates hicache's own defaults (so the chart changes nothing silently)."""
    from hicache.config import HiCacheConfig

    defaults = HiCacheConfig().to_dict()
    with helm.Chart.load(CHART) as chart:
        values = chart.values["config"]
    for section, fields in values.items():
        for k, v in fields.items():
            assert defaults[section][k] == v, f"config.{section}.{k}: chart {v!r}, hicache {defaults[section][k]!r}"


def test_schema_config_properties_match_hicache_config() -> None:
    """values.schema.json knows every hicache config field except the ones the chart owns."""
    import dataclasses

    from hicache.config import _SECTIONS

    owned = {"cache": {"device"}, "storage": {"url"},
             "serve": {"host", "port", "metrics_port", "auth_token", "tls_cert", "tls_key", "tls_client_ca",
                       "metrics_host", "metrics_token", "metrics_tls", "auth_tokens_file"}}
    schema = json.loads((CHART / "values.schema.json").read_text())
    props = schema["properties"]["config"]["properties"]
    assert set(props) == set(_SECTIONS)
    for section, cls in _SECTIONS.items():
        fields = {f.name for f in dataclasses.fields(cls)} - owned.get(section, set())
        got = set(props[section]["properties"])
        assert got == fields, (f"hicache.config.{cls.__name__} and the chart disagree: add {sorted(fields - got)} to / "
                               f"drop {sorted(got - fields)} from config.{section} in deploy/helm/values_schema.py")
        assert props[section]["additionalProperties"] is False


def test_committed_schema_is_the_generated_one() -> None:
    """values.schema.json is written by deploy/helm/values_schema.py from hicache's definitions."""
    from scriptload import load_script

    mod = load_script("deploy/helm/values_schema.py", "values_schema")
    assert (CHART / "values.schema.json").read_text() == mod.render(), "run python deploy/helm/values_schema.py"


def test_l3_url_reaches_the_node_through_the_environment(rendered: dict[str, Rendered]) -> None:
    def url(case: str) -> str:
        r = rendered[case]
        return container_env(r, node_container(r), EXTERNAL_SECRETS).get("HICACHE_STORAGE__URL", "")

    pw = rendered["default"].secret_data()["redis-password"]
    assert url("default") == f"redis://:{pw}@{RELEASE}-hicache-redis.{NAMESPACE}.svc:6379"
    u = urlparse(url("redis-cluster-auth-tls"))
    assert u.scheme == "redis+cluster"
    hosts = u.netloc.rsplit("@", 1)[1].split(",")
    assert hosts == [f"{RELEASE}-hicache-redis-{i}.{RELEASE}-hicache-redis-headless.{NAMESPACE}.svc:6379"
                     for i in range(3)]
    assert url("external-store") == CASES["external-store"]["externalStorage"]["url"]
    assert url("existing-secrets") == "file:///mnt/l3"
    assert url("cpu-no-router-no-l3") == ""


# --- secrets ---------------------------------------------------------------------------------------------


def test_secrets_only_in_the_secret() -> None:
    token, password, store_pw = "tok-3f9a1c7e55", "pw7c0ffee42", "st0repw99x"
    cases = [
        {"auth": {"enabled": True, "token": token}, "redis": {"auth": {"password": password}}},
        {"auth": {"enabled": True, "token": token}, "redis": {"enabled": False},
         "externalStorage": {"url": f"rediss://u:{store_pw}@redis.example:6380/0"}},
    ]
    for values in cases:
        r = render(values)
        data = r.secret_data()
        assert data["auth-token"] == token
        secret_values = [token, password, store_pw]
        for doc in r.docs:
            if doc["kind"] == "Secret":
                continue
            text = json.dumps(doc)
            for s in secret_values:
                assert s not in text, f"{s} appears in {doc['kind']}/{doc['metadata']['name']}"
        assert all(s not in r.notes for s in secret_values)
        cfg = r.config_data()
        assert "auth_token" not in cfg["serve"] and cfg["storage"]["url"] == ""
        env = {e["name"]: e for e in node_container(r)["env"]}
        assert "secretKeyRef" in env["HICACHE_SERVE__AUTH_TOKEN"]["valueFrom"]
        router_env = container_env(r, container(r.component("router")))
        assert router_env["HICACHE_ROUTER__NODE_TOKEN"] == router_env["HICACHE_ROUTER__AUTH_TOKEN"] == token


def test_storage_credentials_stay_out_of_the_configmap() -> None:
    """Backend options that are credentials (the names hicache.config hides in its errors) belong in the
    storage URL's query, which the Secret holds; in config.storage.options they would land in the ConfigMap."""
    for key in ("sentinel_password", "Password", "secret_key", "access_token", "credentials_file"):
        with pytest.raises(helm.HelmRenderError, match=f"config.storage.options.{key} looks like a credential"):
            render({"config": {"storage": {"options": {key: "s3cr3t-v4lue"}}}})
    render({"config": {"storage": {"options": {"ttl_s": 60, "max_connections": 8}}}})
    url = "redis+sentinel://10.0.0.5:26379/mymaster?sentinel_password=s3ntinelpw&ttl_s=60"
    r = render({"redis": {"enabled": False}, "externalStorage": {"url": url}})
    assert "s3ntinelpw" not in json.dumps([d for d in r.docs if d["kind"] != "Secret"])
    env = container_env(r, node_container(r))
    cfg = config_from_dict(merge(r.config_data(), env_overrides(env)))
    assert cfg.storage.url == url  # the node reads it from the Secret; the redis backend parses its query
    from hicache.storage.redis_options import RedisOptions

    opts, rest = RedisOptions.parse(dict(parse_qsl(urlparse(cfg.storage.url).query)), {})
    assert opts.sentinel_password == "s3ntinelpw" and rest == {}


def test_generated_secrets_are_random_and_consistent(rendered: dict[str, Rendered]) -> None:
    r = rendered["redis-cluster-auth-tls"]
    data = r.secret_data()
    assert len(data["auth-token"]) == 40 and len(data["redis-password"]) == 32
    assert data["redis-password"] != rendered["default"].secret_data()["redis-password"]
    # the node, Redis and the cluster-init Job read the same Secret key
    refs = set()
    for doc in r.docs:
        if doc["kind"] not in ("DaemonSet", "StatefulSet", "Deployment", "Job"):
            continue
        for c in pod_spec(doc)["containers"]:
            for e in c.get("env", []):
                ref = e.get("valueFrom", {}).get("secretKeyRef")
                if ref and ref["key"] == "redis-password":
                    refs.add((doc["kind"], ref["name"]))
    assert refs == {(k, f"{RELEASE}-hicache-secret") for k in ("DaemonSet", "StatefulSet", "Job")}


def test_existing_secrets_are_referenced_not_created(rendered: dict[str, Rendered]) -> None:
    r = rendered["existing-secrets"]
    assert r.kinds("Secret") == []
    env = container_env(r, node_container(r), EXTERNAL_SECRETS)
    assert env["HICACHE_SERVE__AUTH_TOKEN"] == "ops-token"


# --- node pods -------------------------------------------------------------------------------------------


def test_default_nodes_run_on_gpu_nodes_with_gpu_resources(rendered: dict[str, Rendered]) -> None:
    r = rendered["default"]
    ds = r.component("node")
    assert ds["kind"] == "DaemonSet"
    spec = pod_spec(ds)
    assert spec["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
    res = container(ds)["resources"]
    assert res["limits"]["nvidia.com/gpu"] == 1 and res["requests"]["nvidia.com/gpu"] == 1
    assert res["requests"]["memory"] == "36Gi" and res["limits"]["memory"] == "40Gi"
    assert container(ds)["image"].endswith(":0.1.0-cuda")
    assert container(r.component("router"))["image"].endswith(":0.1.0")
    two = rendered["redis-cluster-auth-tls"]
    assert container(two.component("node"))["resources"]["limits"]["nvidia.com/gpu"] == 2
    assert pod_spec(two.component("node"))["hostIPC"] is True


def test_cpu_nodes_have_no_gpu(rendered: dict[str, Rendered]) -> None:
    r = rendered["cpu-statefulset"]
    sts = r.component("node")
    assert sts["kind"] == "StatefulSet" and sts["spec"]["replicas"] == 3
    assert sts["spec"]["serviceName"] == f"{RELEASE}-hicache-node-headless"
    assert r.get("Service", sts["spec"]["serviceName"])["spec"]["clusterIP"] == "None"
    res = container(sts)["resources"]
    assert not any("nvidia" in k for part in res.values() for k in part)
    assert container(sts)["image"].endswith(":0.1.0")


@pytest.mark.parametrize("case", sorted(CASES))
def test_probes(rendered: dict[str, Rendered], case: str) -> None:
    from hicache.service.server import SERVICE_NAME

    r = rendered[case]
    c = node_container(r)
    grpc_port = next(p["containerPort"] for p in c["ports"] if p["name"] == "grpc")
    tls = CASES[case].get("tls", {}).get("enabled", False)
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        p = c[probe]
        if tls:  # Kubernetes' grpc probe cannot speak TLS
            assert p["tcpSocket"] == {"port": "grpc"}
        else:
            assert p["grpc"]["port"] == grpc_port
    if not tls:
        assert c["readinessProbe"]["grpc"]["service"] == SERVICE_NAME  # what the server marks SERVING
        assert c["livenessProbe"]["grpc"]["service"] == ""
    assert c["startupProbe"]["failureThreshold"] * c["startupProbe"]["periodSeconds"] >= 120
    grace = pod_spec(r.component("node"))["terminationGracePeriodSeconds"]
    # the RPC drain and the L3 flush, each up to shutdown_grace_s, then the writeback threads (test_helm_sizing)
    assert grace >= 2 * config_from_dict(r.config_data()).serve.shutdown_grace_s + 20
    if r.kinds("Deployment"):
        rc = container(r.component("router"))
        assert {"startupProbe", "livenessProbe", "readinessProbe"} <= rc.keys()


def test_security_context(rendered: dict[str, Rendered]) -> None:
    r = rendered["redis-cluster-auth-tls"]
    for doc in r.docs:
        if doc["kind"] not in ("DaemonSet", "StatefulSet", "Deployment", "Job"):
            continue
        spec = pod_spec(doc)
        assert spec["securityContext"]["runAsNonRoot"] is True
        assert spec["securityContext"]["runAsUser"] != 0
        for c in spec["containers"]:
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"] is True
            assert sc["capabilities"]["drop"] == ["ALL"]
            assert "resources" in c


def test_tls_secret_is_mounted_and_configured(rendered: dict[str, Rendered]) -> None:
    r = rendered["redis-cluster-auth-tls"]
    cfg = config_from_dict(r.config_data())
    assert (cfg.serve.tls_cert, cfg.serve.tls_key, cfg.serve.tls_client_ca) == (
        "/etc/hicache/tls/tls.crt", "/etc/hicache/tls/tls.key", "/etc/hicache/tls/ca.crt")
    vols = {v["name"]: v for v in pod_spec(r.component("node"))["volumes"]}
    assert vols["tls"]["secret"]["secretName"] == "hicache-tls"
    mounts = {m["name"]: m["mountPath"] for m in node_container(r)["volumeMounts"]}
    assert mounts["tls"] == "/etc/hicache/tls"


def test_prometheus_annotations_point_at_metrics(rendered: dict[str, Rendered]) -> None:
    r = rendered["default"]
    meta = r.component("node")["spec"]["template"]["metadata"]
    cfg = config_from_dict(r.config_data())
    assert meta["annotations"]["prometheus.io/scrape"] == "true"
    assert int(meta["annotations"]["prometheus.io/port"]) == cfg.serve.metrics_port
    assert "prometheus.io/scrape" not in rendered["cpu-no-router-no-l3"].component("node")["spec"]["template"][
        "metadata"]["annotations"]
    assert config_from_dict(rendered["cpu-no-router-no-l3"].config_data()).serve.metrics_port == 0


def test_config_change_rolls_the_pods() -> None:
    a = render({})
    b = render({"config": {"cache": {"l2_tokens": 1 << 17}}})
    def checksum(r: Rendered) -> str:
        return str(r.component("node")["spec"]["template"]["metadata"]["annotations"]["checksum/config"])
    assert checksum(a) != checksum(b)


# --- selectors, services, PDBs --------------------------------------------------------------------------


@pytest.mark.parametrize("case", sorted(CASES))
def test_selectors_match_pods(rendered: dict[str, Rendered], case: str) -> None:
    r = rendered[case]
    pods = [d["spec"]["template"]["metadata"]["labels"] for d in r.docs
            if d["kind"] in ("DaemonSet", "StatefulSet", "Deployment")]
    for d in r.docs:
        if d["kind"] in ("DaemonSet", "StatefulSet", "Deployment"):
            assert d["spec"]["selector"]["matchLabels"].items() <= d["spec"]["template"]["metadata"]["labels"].items()
        if d["kind"] == "Service":
            matched = [p for p in pods if d["spec"]["selector"].items() <= p.items()]
            assert len(matched) == 1, d["metadata"]["name"]
        if d["kind"] == "PodDisruptionBudget":
            matched = [p for p in pods if d["spec"]["selector"]["matchLabels"].items() <= p.items()]
            assert len(matched) == 1, d["metadata"]["name"]


def test_pdbs(rendered: dict[str, Rendered]) -> None:
    def pdbs(case: str) -> set[str]:
        return {d["metadata"]["name"] for d in rendered[case].kinds("PodDisruptionBudget")}

    assert pdbs("default") == {f"{RELEASE}-hicache-node", f"{RELEASE}-hicache-router"}
    assert pdbs("redis-cluster-auth-tls") == {f"{RELEASE}-hicache-{c}" for c in ("node", "router", "redis")}
    assert pdbs("cpu-no-router-no-l3") == {f"{RELEASE}-hicache-node"}


def test_node_service_keeps_traffic_on_the_host(rendered: dict[str, Rendered]) -> None:
    svc = rendered["default"].get("Service", f"{RELEASE}-hicache-node")
    assert svc["spec"]["internalTrafficPolicy"] == "Local"


# --- router ----------------------------------------------------------------------------------------------


def router_argv(r: Rendered) -> list[str]:
    c = container(r.component("router"))
    return [*c.get("command", []), *c["args"]]


def test_router_optional(rendered: dict[str, Rendered]) -> None:
    assert rendered["default"].component("router")["spec"]["replicas"] == 2
    assert not [d for d in rendered["cpu-no-router-no-l3"].docs
                if d["metadata"]["labels"].get("app.kubernetes.io/component") == "router"]


def test_router_nodes_for_a_statefulset_are_stable_dns_names(rendered: dict[str, Rendered]) -> None:
    argv = router_argv(rendered["cpu-statefulset"])
    assert argv[0] == "route"
    nodes = [a.removeprefix("--node=") for a in argv if a.startswith("--node=")]
    assert nodes == [f"{RELEASE}-hicache-node-{i}={RELEASE}-hicache-node-{i}.{RELEASE}-hicache-node-headless."
                     f"{NAMESPACE}.svc:50051" for i in range(3)]


def test_router_nodes_given_explicitly(rendered: dict[str, Rendered]) -> None:
    argv = router_argv(rendered["external-store"])
    assert [a for a in argv if a.startswith("--node=")] == ["--node=a=10.1.0.1:50051", "--node=b=10.1.0.2:50051"]


def test_router_discovers_daemonset_nodes_at_start(rendered: dict[str, Rendered], tmp_path: Any) -> None:
    """The launcher resolves the headless Service and execs `hicache route ... --node=IP=IP:PORT`."""
    argv = router_argv(rendered["default"])
    assert argv[:2] == ["python3", "-c"]
    script, host, port, *rest = argv[2:]
    assert host == f"{RELEASE}-hicache-node-headless.{NAMESPACE}.svc" and port == "50051"
    assert rest[:3] == ["route", "--config", "/etc/hicache/router.yaml"]
    # Run it for real against a name that resolves (localhost), with `hicache` stubbed by a script
    # that prints its argv.
    fake = tmp_path / "hicache"
    fake.write_text("#!/bin/sh\nprintf '%s\\n' \"$@\"\n")
    fake.chmod(0o755)
    out = subprocess.run([sys.executable, "-c", script, "localhost", port, *rest], capture_output=True, text=True,
                         timeout=30, env={"PATH": f"{tmp_path}:/usr/bin:/bin"}, check=True).stdout.split("\n")
    assert out[:len(rest)] == rest
    assert "--node=node-127-0-0-1=127.0.0.1:50051" in out
    from hicache.router.config import parse_node

    for flag in out[len(rest):]:
        if flag:  # every resolved address (IPv6 too) is a node the router accepts
            parse_node(flag.removeprefix("--node="))


def router_config(r: Rendered, tmp_path: Any, argv: list[str] | None = None,
                  env: dict[str, str] | None = None) -> tuple[Any, Any]:
    """(namespace config, RouterConfig) exactly as `hicache route` builds them from the rendered pod."""
    from hicache.cli import build_parser
    from hicache.router.cli import overrides_from_args
    from hicache.router.config import load_router_config

    cm = r.config_map()
    path = tmp_path / "router.yaml"
    path.write_text(cm["data"]["router.yaml"])
    argv = router_argv(r) if argv is None else argv
    args = build_parser("route").parse_args(argv)
    assert args.command == "route" and args.config == "/etc/hicache/router.yaml"
    c = container(r.component("router"))
    assert {m["mountPath"]: m.get("subPath") for m in c["volumeMounts"]}[args.config] == "router.yaml"
    return load_router_config(path, env=container_env(r, c) if env is None else env,
                              overrides=overrides_from_args(args))


@pytest.mark.parametrize("case", ["cpu-statefulset", "external-store", "redis-cluster-auth-tls", "mla-write-back"])
def test_router_config_loads_with_the_router_cli(rendered: dict[str, Rendered], case: str, tmp_path: Any) -> None:
    r = rendered[case]
    argv = router_argv(r)
    if argv[0] == "python3":  # daemonset: the launcher appends the resolved nodes
        argv = [*argv[5:], "--node=10.0.0.1=10.0.0.1:50051"]
    ns_cfg, rc = router_config(r, tmp_path, argv)
    node_cfg = config_from_dict(r.config_data())
    assert ns_cfg.namespace().digest == node_cfg.namespace().digest  # the router computes the nodes' page keys
    assert ns_cfg.layout == node_cfg.layout
    c = container(r.component("router"))
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert (rc.host, rc.port, rc.metrics_port) == ("0.0.0.0", ports["grpc"], ports.get("metrics", 0))
    assert rc.nodes, "the router refuses to start without nodes"
    for n in rc.nodes:
        assert n.address.rsplit(":", 1)[1] == str(node_cfg.serve.port)
    if CASES[case].get("auth", {}).get("enabled"):
        token = r.secret_data()["auth-token"]
        assert rc.node_token == rc.auth_token == token
        assert container_env(r, node_container(r))["HICACHE_SERVE__AUTH_TOKEN"] == token
    if CASES[case].get("tls", {}).get("enabled"):
        assert (rc.node_tls_ca, rc.node_client_cert, rc.node_client_key) == (
            "/etc/hicache/tls/ca.crt", "/etc/hicache/tls/tls.crt", "/etc/hicache/tls/tls.key")
        assert {m["name"]: m["mountPath"] for m in c["volumeMounts"]}["tls"] == "/etc/hicache/tls"


def test_router_approximate_index_reaches_the_router(tmp_path: Any) -> None:
    """router.config.index and its settings land in router.yaml and load as `hicache route` loads them; a
    capacity of exactly one page is accepted (the router refuses less, and so does the render)."""
    r = render({"config": SMALL, "router": {"nodes": ["a=10.1.0.1:50051"], "config": {
        "index": "approximate", "approx_ttl_s": 30.0, "approx_capacity_tokens": 16}}})
    _, rc = router_config(r, tmp_path)
    assert (rc.index, rc.approx_ttl_s, rc.approx_capacity_tokens) == ("approximate", 30.0, 16)


def test_router_probes_use_the_router_health_service(rendered: dict[str, Rendered]) -> None:
    from hicache.router.server import SERVICE_NAME

    c = container(rendered["default"].component("router"))
    port = next(p["containerPort"] for p in c["ports"] if p["name"] == "grpc")
    assert c["readinessProbe"]["grpc"] == {"port": port, "service": SERVICE_NAME}
    assert c["livenessProbe"]["grpc"] == {"port": port, "service": ""}
    tcp = container(render({"router": {"probes": {"type": "tcp"}}}).component("router"))
    assert tcp["readinessProbe"]["tcpSocket"] == {"port": "grpc"}


def test_router_values_match_router_defaults() -> None:
    import dataclasses

    from hicache.router.config import RouterConfig

    defaults = dataclasses.asdict(RouterConfig())
    with helm.Chart.load(CHART) as chart:
        values = chart.values["router"]["config"]
    for k, v in values.items():
        assert defaults[k] == v, f"router.config.{k}"
    owned = {"host", "port", "metrics_port", "nodes", "node_token", "auth_token", "node_tls_ca", "node_client_cert",
             "node_client_key", "tls_cert", "tls_key", "tls_client_ca", "auth_tokens_file", "metrics_host",
             "metrics_token", "metrics_tls"}
    schema = json.loads((CHART / "values.schema.json").read_text())
    props = schema["properties"]["router"]["properties"]["config"]["properties"]
    want = set(defaults) - owned
    assert set(props) == want, (f"RouterConfig and the chart disagree: add {sorted(want - set(props))} to / drop "
                                f"{sorted(set(props) - want)} from router.config in values.yaml and "
                                "deploy/helm/values_schema.py")
    assert set(values) == set(props)


def test_router_yaml_only_with_a_router(rendered: dict[str, Rendered]) -> None:
    (cm,) = rendered["cpu-no-router-no-l3"].kinds("ConfigMap")
    assert set(cm["data"]) == {"hicache.yaml"}
    (cm,) = rendered["default"].kinds("ConfigMap")
    assert set(cm["data"]) == {"hicache.yaml", "router.yaml"}


# --- bundled Redis ---------------------------------------------------------------------------------------


def test_redis_cluster_init_job(rendered: dict[str, Rendered]) -> None:
    r = rendered["redis-cluster-auth-tls"]
    (job,) = r.kinds("Job")
    assert job["metadata"]["annotations"]["helm.sh/hook"] == "post-install"
    c = container(job)
    script = c["args"][0]
    subprocess.run(["sh", "-n", "-c", script], check=True)  # syntax
    for i in range(3):
        assert f"{RELEASE}-hicache-redis-{i}.{RELEASE}-hicache-redis-headless.{NAMESPACE}.svc" in script
    assert "--cluster-replicas 0" in script
    sts = r.component("redis")
    assert sts["spec"]["replicas"] == 3
    args = container(sts)["args"]
    assert args[args.index("--cluster-enabled") + 1] == "yes"
    assert sts["spec"]["volumeClaimTemplates"][0]["spec"]["resources"]["requests"]["storage"] == "10Gi"
    assert not rendered["default"].kinds("Job")


# --- bad values ------------------------------------------------------------------------------------------

BAD_VALUES = [
    ({"config": {"serve": {"auth_token": "x"}}}, "auth_token"),  # secrets never in the config
    ({"config": {"storage": {"url": "redis://h"}}}, "url"),
    ({"config": {"cache": {"write_policy": "sometimes"}}}, "write_policy"),
    ({"config": {"layout": {"dtype": "float64"}}}, "dtype"),
    ({"config": {"cache": {"l1_tokens": 0}}}, "l1_tokens"),
    ({"config": {"model": {"name": ""}}}, "name"),
    ({"config": {"nonsense": {}}}, "nonsense"),
    ({"node": {"kind": "deployment"}}, "kind"),
    ({"node": {"port": 70000}}, "port"),
    ({"node": {"gpu": {"count": 0}}}, "count"),
    ({"tls": {"enabled": True}}, "secretName"),
    ({"router": {"nodes": ["no-address"]}}, "nodes"),
    ({"redis": {"auth": {"password": "has spaces/and@signs"}}}, "password"),
    ({"externalStorage": {"url": "not a url"}}, "url"),
    ({"metrics": {"serviceMonitor": {"interval": "often"}}}, "interval"),
    ({"replicaCount": 3}, "replicaCount"),
]


@pytest.mark.parametrize(("values", "where"), BAD_VALUES, ids=[w for _, w in BAD_VALUES])
def test_schema_rejects_bad_values(values: dict[str, Any], where: str) -> None:
    with pytest.raises(helm.HelmValuesError, match=where):
        render(values)


CROSS_FIELD = [
    ({"externalStorage": {"url": "redis://h:6379"}}, "pick one L3 store"),
    ({"config": {"cache": {"l1_tokens": 32}}}, "l1_tokens"),
    ({"config": {"layout": {"attention": "mla"}}}, "num_kv_heads must be 1"),
    ({"config": {"model": {"tp_rank": 2, "tp_size": 2}}}, "tp_rank"),
    ({"metrics": {"port": 50051}}, "must differ"),
    ({"node": {"terminationGracePeriodSeconds": 10}}, "terminationGracePeriodSeconds"),
    ({"router": {"config": {"index": "approximate", "approx_capacity_tokens": 63}}}, "holds no page"),
]


@pytest.mark.parametrize(("values", "message"), CROSS_FIELD, ids=[m for _, m in CROSS_FIELD])
def test_cross_field_checks_fail_the_render(values: dict[str, Any], message: str) -> None:
    with pytest.raises(helm.HelmRenderError, match=message):
        render(values)


def test_notes_render(rendered: dict[str, Rendered]) -> None:
    notes = rendered["redis-cluster-auth-tls"].notes
    assert "Redis Cluster (3 masters)" in notes and "base64 -d" in notes
    assert "requires client" in notes and "the node pod IPs" in notes
    assert "rollout restart" in rendered["default"].notes
    assert "none (L1 + L2 only)" in rendered["cpu-no-router-no-l3"].notes
    r = rendered["redis-cluster-auth-tls"]
    (rule,) = r.kinds("PrometheusRule")
    dash = next(c for c in r.kinds("ConfigMap") if "hicache.json" in c["data"])
    assert f"PrometheusRule {rule['metadata']['name']}" in notes and dash["metadata"]["name"] in notes
    assert "PrometheusRule" not in rendered["default"].notes and "hicache status" in rendered["default"].notes



def test_shm_holds_the_cpu_l1_pool(rendered: dict[str, Rendered]) -> None:
    """On CPU nodes the shared L1 pool is a /dev/shm segment: the emptyDir is sized from the layout."""
    def shm(r: Rendered) -> dict[str, Any]:
        return next(v for v in pod_spec(r.component("node"))["volumes"] if v["name"] == "dshm")

    for case in ("cpu-statefulset", "cpu-no-router-no-l3"):
        r = rendered[case]
        cfg = config_from_dict(r.config_data())
        pool = cfg.l1_pages * cfg.layout.to_layout().bytes_per_page
        size = shm(r)["emptyDir"]["sizeLimit"]
        assert size.endswith("Mi") and int(size[:-2]) << 20 == (pool + (1 << 30) + (1 << 20) - 1) >> 20 << 20
    assert shm(rendered["default"])["emptyDir"] == {"medium": "Memory", "sizeLimit": "1024Mi"}
    assert shm(render({"node": {"shm": {"hostPath": "/dev/shm"}}}))["hostPath"] == {"path": "/dev/shm",
                                                                                     "type": "Directory"}
    mounts = {m["name"]: m["mountPath"] for m in node_container(rendered["default"])["volumeMounts"]}
    assert mounts["dshm"] == "/dev/shm"
