"""The chart's side of tenants and metrics security: the tokens file mounted from a Secret and named in the
node's config, the nodes' /metrics bound for Prometheus, behind a bearer token from the Secret that the
ServiceMonitor sends, and over HTTPS with the TLS Secret's certificate when asked; what cannot work is
refused at render time."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

helm = pytest.importorskip("helm_python")
kv = pytest.importorskip("kubernetes_validate")

from helm_render import RELEASE, Rendered, container, container_env, pod_spec, render  # noqa: E402

from hicache.config import HiCacheConfig, config_from_dict  # noqa: E402
from hicache.config_load import env_overrides, merge  # noqa: E402
from hicache.router.config import RouterConfig, load_router_config  # noqa: E402

TLS = {"enabled": True, "secretName": "hicache-tls"}
SM = {"enabled": True, "labels": {"release": "prometheus"}}


def node_container(r: Rendered) -> dict[str, Any]:
    return container(r.component("node"), "node")


def node_config(r: Rendered) -> HiCacheConfig:
    """The node's config as it starts: the ConfigMap, then its environment (the Secret's tokens)."""
    env = container_env(r, node_container(r), {("tenant-tokens", "tokens.yaml"): "unused"})
    return config_from_dict(merge(r.config_data(), env_overrides(env)))


def validate(r: Rendered) -> None:
    for doc in r.docs:
        if doc["kind"] not in ("ServiceMonitor", "PrometheusRule"):
            kv.validate(doc, kv.latest_version(), strict=True)


def test_defaults_bind_metrics_for_prometheus_with_no_token_and_no_tokens_file() -> None:
    r = render()
    cfg = node_config(r)
    assert cfg.serve.metrics_host == "0.0.0.0" and cfg.serve.metrics_port == 9400  # the pod's addresses
    assert (cfg.serve.metrics_token, cfg.serve.metrics_tls, cfg.serve.auth_tokens_file) == ("", False, "")
    assert "metrics-token" not in r.secret_data()
    off = node_config(render({"metrics": {"enabled": False}}))
    assert off.serve.metrics_port == 0 and off.serve.metrics_host == "127.0.0.1"  # hicache's default


def test_a_tokens_file_secret_is_mounted_and_named_in_the_config() -> None:
    r = render({"auth": {"enabled": True, "tokensFileSecret": "tenant-tokens", "tokensFileKey": "tokens.yaml"}})
    validate(r)
    cfg = node_config(r)
    assert cfg.serve.auth_tokens_file == "/etc/hicache/auth/tokens.yaml"
    assert cfg.serve.auth_token == r.secret_data()["auth-token"]  # the admin token: the router's
    spec = pod_spec(r.component("node"))
    (vol,) = [v for v in spec["volumes"] if v["name"] == "auth-tokens"]
    assert vol["secret"] == {"secretName": "tenant-tokens", "items": [{"key": "tokens.yaml", "path": "tokens.yaml"}]}
    mounts = {m["name"]: m for m in node_container(r)["volumeMounts"]}
    assert mounts["auth-tokens"]["mountPath"] == "/etc/hicache/auth" and mounts["auth-tokens"]["readOnly"]
    assert "tenant-tokens" not in r.config_text()


def test_a_metrics_token_comes_from_the_secret_and_the_servicemonitor_sends_it() -> None:
    token = "m3tr1cs-tok-9a"
    r = render({"metrics": {"auth": {"enabled": True, "token": token}, "serviceMonitor": SM},
                "router": {"enabled": True}})
    validate(r)
    assert node_config(r).serve.metrics_token == token
    assert r.secret_data()["metrics-token"] == token
    for doc in r.docs:  # nowhere but in the Secret
        if doc["kind"] != "Secret":
            assert token not in json.dumps(doc), doc["kind"]
    (sm,) = r.kinds("ServiceMonitor")
    (ep,) = sm["spec"]["endpoints"]
    assert ep["authorization"] == {"type": "Bearer", "credentials": {"name": f"{RELEASE}-hicache-secret",
                                                                      "key": "metrics-token"}}
    generated = render({"metrics": {"auth": {"enabled": True}}})
    assert len(generated.secret_data()["metrics-token"]) == 40
    theirs = render({"metrics": {"auth": {"enabled": True, "existingSecret": "ops-metrics",
                                          "existingSecretKey": "t"}}})
    env = {e["name"]: e for e in node_container(theirs)["env"]}
    assert env["HICACHE_SERVE__METRICS_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "ops-metrics", "key": "t"}
    assert "metrics-token" not in theirs.secret_data()


def test_metrics_tls_serves_the_nodes_over_https_and_the_servicemonitor_trusts_the_ca(tmp_path: Path) -> None:
    r = render({"tls": TLS, "metrics": {"tls": True, "serviceMonitor": SM}, "router": {"enabled": True}})
    validate(r)
    cfg = node_config(r)
    assert cfg.serve.metrics_tls and cfg.serve.tls_cert == "/etc/hicache/tls/tls.crt"
    # the router has no certificate of its own in the chart (router.metrics_tls would need router.tls_cert,
    # which would make its gRPC port TLS too): its /metrics stays HTTP, and the config it starts with says so
    rc = router_config(r, tmp_path)
    assert (rc.metrics_tls, rc.tls_cert, rc.metrics_port) == (False, "", 9401)
    router_svc = r.get("Service", f"{RELEASE}-hicache-router")
    assert {p["name"]: p["port"] for p in router_svc["spec"]["ports"]}["metrics"] == 9401
    assert "prometheus.io/scheme" not in r.component("router")["spec"]["template"]["metadata"]["annotations"]
    (sm,) = r.kinds("ServiceMonitor")
    eps = {e["port"]: e for e in sm["spec"]["endpoints"]}
    assert set(eps) == {"metrics", "https-metrics"}  # the router's (HTTP), the nodes' (HTTPS)
    assert "scheme" not in eps["metrics"] and "tlsConfig" not in eps["metrics"]
    assert eps["https-metrics"]["scheme"] == "https"
    assert eps["https-metrics"]["tlsConfig"] == {"ca": {"secret": {"name": "hicache-tls", "key": "ca.crt"}}}
    headless = r.get("Service", f"{RELEASE}-hicache-node-headless")
    assert "https-metrics" in {p["name"] for p in headless["spec"]["ports"]}
    meta = r.component("node")["spec"]["template"]["metadata"]
    assert meta["annotations"]["prometheus.io/scheme"] == "https"
    custom = {"serverName": "hicache-node", "ca": {"configMap": {"name": "ca", "key": "ca.crt"}}}
    r2 = render({"tls": TLS, "metrics": {"tls": True, "serviceMonitor": {**SM, "tlsConfig": custom}}})
    (sm2,) = r2.kinds("ServiceMonitor")
    assert {e["port"]: e for e in sm2["spec"]["endpoints"]}["https-metrics"]["tlsConfig"] == custom



def router_config(r: Rendered, tmp: Path) -> RouterConfig:
    """The router's config as it starts: router.yaml from the ConfigMap, then its environment."""
    (cm,) = [d for d in r.kinds("ConfigMap") if "router.yaml" in d.get("data", {})]
    path = tmp / "router.yaml"
    path.write_text(cm["data"]["router.yaml"])
    env = container_env(r, container(r.component("router"), "router"), {("tenant-tokens", "tokens.yaml"): "unused"})
    return load_router_config(path, env=env)[1]


def test_the_router_gets_the_tokens_file_the_metrics_token_and_binds_metrics_for_prometheus(tmp_path: Path) -> None:
    token = "r0uter-m3trics-7"
    r = render({"auth": {"enabled": True, "tokensFileSecret": "tenant-tokens", "tokensFileKey": "tokens.yaml"},
                "metrics": {"auth": {"enabled": True, "token": token}}, "router": {"enabled": True}})
    validate(r)
    cfg = router_config(r, tmp_path)
    assert cfg.auth_tokens_file == "/etc/hicache/auth/tokens.yaml" and cfg.metrics_token == token
    assert cfg.metrics_host == "0.0.0.0"
    spec = pod_spec(r.component("router"))
    (vol,) = [v for v in spec["volumes"] if v["name"] == "auth-tokens"]
    assert vol["secret"]["secretName"] == "tenant-tokens"
    mounts = {m["name"]: m for m in container(r.component("router"), "router")["volumeMounts"]}
    assert mounts["auth-tokens"]["mountPath"] == "/etc/hicache/auth" and mounts["auth-tokens"]["readOnly"]
    plain = router_config(render({"router": {"enabled": True}, "metrics": {"enabled": False}}), tmp_path)
    assert (plain.auth_tokens_file, plain.metrics_token, plain.metrics_host) == ("", "", "127.0.0.1")


@pytest.mark.parametrize(("values", "message"), [
    ({"metrics": {"tls": True}}, "set tls.enabled=true"),
    ({"auth": {"tokensFileSecret": "t"}}, "set auth.enabled=true"),
])
def test_what_cannot_work_fails_the_render(values: dict[str, Any], message: str) -> None:
    with pytest.raises(helm.HelmRenderError, match=message):
        render(values)


def test_the_schema_refuses_tokens_in_the_config() -> None:
    for field in ("metrics_token", "auth_tokens_file", "metrics_host"):
        with pytest.raises(helm.HelmValuesError, match=field):
            render({"config": {"serve": {field: "x"}}})
