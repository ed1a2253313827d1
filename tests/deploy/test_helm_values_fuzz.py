"""The Helm chart rendered for random values that values.schema.json accepts (hypothesis).

Each example draws a whole release: GPU or CPU nodes (DaemonSet or StatefulSet), a KV layout and L1/L2
sizes, a memory limit at, above or just below what the pools need, /dev/shm, the grace period, an L3
store of every kind (bundled Redis or Redis Cluster, external redis / rediss / sentinel / cluster / file /
s3 / gs / hdfs URLs, or Secrets the operator manages), auth and TLS, the router (derived or explicit node
lists, its own config), monitoring, node selectors, tolerations, extra environment, long release names.
Helm's own engine renders it, and then either

* the render fails with one of the chart's own ``fail`` messages, exactly when one of the chart's cross-field
  rules (computed here independently, with hicache's own sizes) is broken; never a template error; or
* it succeeds, and: every manifest validates (strict) against the Kubernetes schemas; the ConfigMap's
  hicache.yaml loads with ``hicache.config.config_from_dict`` and holds the values given; the L3 URL, the
  token and the password reach the processes from Secrets only; ports agree between containers, Services,
  probes and the configs; the router's command line and router.yaml load with ``hicache route``'s own parser
  and name the node Service's real DNS names and port; the memory limit holds L2 (+ L1 on CPU) + overhead
  as hicache's ``HostPool`` sizes it; selectors match the pods; names fit Kubernetes' length limits.

A second property removes one default value (``null``, as ``--set key=null`` does): the chart renders
with that default gone, or the schema names the missing key; never a template error.
"""

from __future__ import annotations

import base64
import json
import math
import re
import string
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

helm = pytest.importorskip("helm_python")
kv = pytest.importorskip("kubernetes_validate")

from helm_render import CHART, Rendered, container, container_env, pod_spec, render  # noqa: E402

import hicache.pool  # noqa: E402
from hicache.config import HiCacheConfig, config_from_dict  # noqa: E402
from hicache.config_load import env_overrides, merge  # noqa: E402
from hicache.layout import DTYPES, HOST_LAYOUTS  # noqa: E402

SCHEMA = json.loads((CHART / "values.schema.json").read_text())
OLDEST_KUBE = "1.27.0"  # Chart.yaml kubeVersion


def _defaults() -> dict[str, Any]:
    with helm.Chart.load(CHART) as chart:
        values: dict[str, Any] = chart.values
    return values


DEFAULTS = _defaults()


def kube_versions() -> list[str]:
    from packaging.version import Version

    oldest = max(OLDEST_KUBE, kv.utils.all_versions()[0], key=Version)
    return sorted({oldest, kv.latest_version()}, key=Version)


# --- the chart's own fail messages -----------------------------------------------------------------------

_FAIL = re.compile(r'fail\s+(?:\(printf\s+)?"((?:[^"\\]|\\.)*)"')
_VERB = re.compile(r"%[-+# 0]*[0-9]*(?:\.[0-9]+)?[a-zA-Z]")


def _fail_patterns() -> list[re.Pattern[str]]:
    """Every ``fail`` message in the templates as a regex (printf verbs match anything)."""
    out = []
    for path in sorted((CHART / "templates").iterdir()):
        for fmt in _FAIL.findall(path.read_text()):
            parts = _VERB.split(fmt.replace('\\"', '"'))
            out.append(re.compile(".*?".join(re.escape(p) for p in parts), re.DOTALL))
    assert len(out) >= 9, out
    return out


FAIL_PATTERNS = _fail_patterns()
# what Go's template engine says when a template, not a value, is wrong
TEMPLATE_ERRORS = ("nil pointer", "wrong type", "can't evaluate", "error calling", "invalid value; expected",
                   "incompatible types")

# The chart's cross-field rules, by name: a piece of each one's message.
RULES = {
    "one_store": "pick one L3 store",
    "l1_page": "config.cache.l1_tokens (",
    "mla_heads": "num_kv_heads must be 1",
    "credential_option": "looks like a credential",
    "tp_rank": "config.model.tp_rank (",
    "metrics_port": "metrics.port and node.port must differ",
    "grace": "node.terminationGracePeriodSeconds (",
    "memory": "node.resources.limits.memory (",
    "shm": "node.shm.sizeLimit (",
    "scrape_timeout": "metrics.serviceMonitor.scrapeTimeout (",
    "router_metrics_port": "router.metrics.port and router.port must differ",
    "router_breaker": "router.config.breaker_max_cooldown_s (",
    "router_approx_capacity": "router.config.approx_capacity_tokens (",
    "router_nodes": "names a node already listed",
}


# --- values as Helm sees them ----------------------------------------------------------------------------


def coalesce(base: Any, over: Any) -> Any:
    """Helm's merge of user values over the chart's: maps merge, ``None`` removes the key, the rest replaces."""
    if isinstance(base, dict) and isinstance(over, dict):
        out = dict(base)
        for k, v in over.items():
            if v is None:
                out.pop(k, None)
            else:
                out[k] = coalesce(base.get(k), v)
        return out
    return over


def get(d: Any, path: str, default: Any = None) -> Any:
    for part in path.split("."):
        if not isinstance(d, dict) or part not in d:
            return default
        d = d[part]
    return d


_UNITS = {"": 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18,
          "Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40, "Pi": 1 << 50, "Ei": 1 << 60}


def quantity(q: Any) -> Fraction:
    """A Kubernetes quantity in bytes, exactly."""
    if not isinstance(q, str):
        return Fraction(q)
    m = re.fullmatch(r"([0-9]+(?:\.[0-9]+)?)(m|k|[KMGTPE]i|[MGTPE]|)", q)
    assert m, q
    return Fraction(m.group(1)) * (Fraction(1, 1000) if m.group(2) == "m" else _UNITS[m.group(2)])


def effective_config(values: dict[str, Any]) -> dict[str, Any]:
    """``config`` as hicache reads it from the ConfigMap: the chart's sections (hicache's defaults where a
    key was removed), less what the chart owns."""
    return {s: dict(v or {}) for s, v in (values.get("config") or {}).items()}


@dataclass
class Sizes:
    page: int
    l1: int  # the L1 pool's bytes (l1_tokens // page_size pages)
    l2: int  # what HostPool allocates for L2 (at least one page, whole blocks)


def sizes(config: dict[str, Any]) -> Sizes:
    """Pool sizes computed as hicache does (hicache.layout / hicache.pool), from possibly invalid values."""
    d = HiCacheConfig().to_dict()
    lay = {**d["layout"], **config.get("layout", {})}
    cache = {**d["cache"], **config.get("cache", {})}
    kv_count = 1 if lay["attention"] == "mla" else 2
    piece = lay["page_size"] * lay["num_kv_heads"] * lay["head_dim"] * DTYPES[lay["dtype"]]
    page = piece * kv_count * lay["num_layers"]
    l2_pages = max(1, cache["l2_tokens"] // lay["page_size"])
    block = {"page_first": 1, "layer_first": l2_pages}.get(cache["host_layout"]) or (
        cache["host_block_pages"] or hicache.pool.default_block_pages(piece))
    return Sizes(page, cache["l1_tokens"] // lay["page_size"] * page, -(-l2_pages // block) * block * page)


def host_pool_bytes(cfg: HiCacheConfig) -> int:
    """What hicache's own HostPool asks for the config's L2, read from its size check (nothing allocated)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(hicache.pool, "available_host_memory", lambda: 0)
        with pytest.raises(hicache.pool.HostMemoryError) as e:
            hicache.pool.HostPool(cfg.layout.to_layout(), max(cfg.l2_pages, 1), cfg.cache.host_layout,  # type: ignore[arg-type]
                                  pin_memory=False, block_pages=cfg.cache.host_block_pages)
    return int(e.value.needed)


def node_memory(values: dict[str, Any]) -> Fraction:
    """Bytes the node's memory limit must hold: L2, the L1 pool on a CPU node, node.memoryOverhead."""
    s = sizes(effective_config(values))
    gpu = get(values, "node.gpu.enabled")
    return s.l2 + (0 if gpu else s.l1) + quantity(get(values, "node.memoryOverhead") or 0)


def grace_needed(values: dict[str, Any]) -> int:
    grace = get(values, "config.serve.shutdown_grace_s", 30.0)
    return 2 * math.ceil(grace) + 20


def broken_rules(values: dict[str, Any]) -> set[str]:
    """The chart's cross-field rules these (coalesced) values break, computed independently of the chart."""
    out = set()
    ext = get(values, "externalStorage.url") or get(values, "externalStorage.existingSecret")
    if get(values, "redis.enabled") and ext:
        out.add("one_store")
    d = HiCacheConfig().to_dict()
    cfg = effective_config(values)
    lay = {**d["layout"], **cfg.get("layout", {})}
    cache = {**d["cache"], **cfg.get("cache", {})}
    model = {**d["model"], **cfg.get("model", {})}
    if cache["l1_tokens"] < lay["page_size"]:
        out.add("l1_page")
    if lay["attention"] == "mla" and lay["num_kv_heads"] != 1:
        out.add("mla_heads")
    if any(re.search(r"(?i)token(?!s)|passw|secret|credential", k) for k in get(values, "config.storage.options", {})):
        out.add("credential_option")
    if model["tp_rank"] >= model["tp_size"]:
        out.add("tp_rank")
    if get(values, "metrics.enabled") and get(values, "metrics.port") == get(values, "node.port"):
        out.add("metrics_port")
    if (get(values, "node.terminationGracePeriodSeconds") or 0) < grace_needed(values):
        out.add("grace")
    limit = get(values, "node.resources.limits.memory")
    if limit is not None and quantity(limit) < node_memory(values):
        out.add("memory")
    serve = {**d["serve"], **cfg.get("serve", {})}
    shm = get(values, "node.shm.sizeLimit")
    if (not get(values, "node.gpu.enabled") and serve["shared_pool"] and shm and not get(values, "node.shm.hostPath")
            and quantity(shm) < sizes(cfg).l1):
        out.add("shm")
    sm = get(values, "metrics.serviceMonitor") or {}
    if (get(values, "metrics.enabled") and sm.get("enabled") and sm.get("interval") and sm.get("scrapeTimeout")
            and seconds(sm["scrapeTimeout"]) > seconds(sm["interval"])):
        out.add("scrape_timeout")
    if get(values, "router.enabled"):
        if get(values, "metrics.enabled") and get(values, "router.metrics.port") == get(values, "router.port"):
            out.add("router_metrics_port")
        cooldown = get(values, "router.config.breaker_cooldown_s", 5.0)  # RouterConfig's defaults
        if get(values, "router.config.breaker_max_cooldown_s", 60.0) < cooldown:
            out.add("router_breaker")
        if (get(values, "router.config.index", "events") == "approximate"  # check_approx_capacity
                and get(values, "router.config.approx_capacity_tokens", 1 << 20) < lay["page_size"]):
            out.add("router_approx_capacity")
        from hicache.router.config import check_nodes, parse_node

        try:
            check_nodes([parse_node(n) for n in get(values, "router.nodes") or []])
        except ValueError:
            out.add("router_nodes")
    return out


# --- strategies ------------------------------------------------------------------------------------------

ALNUM = string.ascii_letters + string.digits
secret_st = st.text(ALNUM, min_size=12, max_size=24).map(lambda s: "zq" + s)  # never found by chance
dns_label_st = st.from_regex(r"\A[a-z]([-a-z0-9]{0,20}[a-z0-9])?\Z")
host_st = st.one_of(
    st.builds(lambda a, b: f"{a}.{b}.svc", dns_label_st, dns_label_st),
    st.builds(lambda *o: ".".join(map(str, o)), *[st.integers(0, 255)] * 4),
    st.sampled_from(["[::1]", "[fd00::12]", "[2001:db8::5]"]),
)
port_st = st.integers(1, 65535)
label_value_st = st.from_regex(r"\A([A-Za-z0-9]([-A-Za-z0-9_.]{0,20}[A-Za-z0-9])?)?\Z")
label_key_st = st.one_of(dns_label_st, st.builds(lambda p, n: f"{p}.io/{n}", dns_label_st, dns_label_st))
labels_st = st.dictionaries(label_key_st, label_value_st, max_size=3)
toleration_st = st.one_of(
    st.fixed_dictionaries({"key": label_key_st, "operator": st.just("Exists"),
                           "effect": st.sampled_from(["NoSchedule", "NoExecute", "PreferNoSchedule"])}),
    st.fixed_dictionaries({"key": label_key_st, "operator": st.just("Equal"), "value": label_value_st,
                           "effect": st.sampled_from(["NoSchedule", "NoExecute"])}),
)
env_st = st.lists(st.fixed_dictionaries({"name": st.from_regex(r"\AX_[A-Z0-9_]{0,15}\Z"),
                                         "value": st.text(ALNUM + " -_/:", max_size=20)}),
                  max_size=3, unique_by=lambda e: e["name"])
small_float = st.floats(0.001, 100.0, allow_nan=False).map(lambda f: round(f, 3))


def optional(**fields: st.SearchStrategy[Any]) -> st.SearchStrategy[dict[str, Any]]:
    """A mapping holding any subset of ``fields`` (the chart's defaults fill the rest)."""
    return st.fixed_dictionaries({}, optional=fields)


layout_st = optional(
    num_layers=st.integers(1, 96), num_kv_heads=st.sampled_from([1, 1, 1, 2, 8, 16]),
    head_dim=st.sampled_from([8, 64, 128, 576]), dtype=st.sampled_from(sorted(DTYPES)),
    page_size=st.sampled_from([1, 16, 32, 64, 128]), attention=st.sampled_from(["mha", "mla"]))
cache_st = optional(
    l1_tokens=st.one_of(*[st.integers(1 << 10, 1 << 17)] * 6, st.integers(1, 200)), l2_tokens=st.integers(0, 1 << 21),
    host_layout=st.sampled_from(HOST_LAYOUTS), host_block_pages=st.integers(0, 9),
    write_policy=st.sampled_from(SCHEMA["properties"]["config"]["properties"]["cache"]["properties"]["write_policy"]
                                 ["enum"]),
    eviction_policy=st.sampled_from(SCHEMA["properties"]["config"]["properties"]["cache"]["properties"]
                                    ["eviction_policy"]["enum"]),
    io_backend=st.sampled_from(["auto", "cpu", "kernel", "copy_engine", "staged"]),
    max_pinned_fraction=st.floats(0, 1).map(lambda f: round(f, 4)),
    transfer_options=optional(blocks=st.integers(1, 64), threads=st.integers(32, 1024),
                              layer_signal=st.sampled_from(["auto", "flags", "events"])))
storage_cfg_st = optional(
    prefetch_policy=st.sampled_from(["best_effort", "wait_complete", "timeout"]),
    prefetch_threshold_tokens=st.integers(0, 4096), prefetch_timeout_base_s=small_float,
    prefetch_timeout_per_1k_tokens_s=small_float, prefetch_timeout_max_s=small_float,
    prefetch_max_inflight_bytes=st.integers(1, 1 << 40), io_batch_pages=st.integers(1, 1024),
    writeback_queue_pages=st.integers(1, 1 << 20), writeback_when_full=st.sampled_from(["block", "drop"]),
    options=st.dictionaries(st.sampled_from(["ttl_s", "key_prefix", "socket_timeout_s", "max_connections",
                                             "tokens_per_batch"] * 4 + ["sentinel_password", "access_token"]),
                            st.one_of(st.integers(1, 3600), st.text(ALNUM, min_size=1, max_size=8)), max_size=2))
serve_st = optional(
    max_concurrency=st.integers(1, 4096), max_message_bytes=st.integers(1 << 20, 1 << 30),
    max_request_tokens=st.integers(1, 1 << 22),
    shutdown_grace_s=st.one_of(st.integers(0, 35), st.floats(0, 35).map(lambda f: round(f, 3)), st.integers(0, 35),
                               st.integers(0, 200)),
    shared_pool=st.booleans())
model_st = optional(
    name=st.one_of(st.sampled_from(["llama-3.1-8b", "/models/llama", "deepseek-v3", "Qwen/Qwen2-7B", "1.0", "true",
                                    "null", "0123", "1:30", "2024-01-01", "yes", "~", "a: b", "#x"]),
                   st.text(ALNUM + "-_./:", min_size=1, max_size=20)),
    revision=st.one_of(st.sampled_from(["main", "0e9e39f", "1e10", "0x1F", "v1.0"]), st.text(ALNUM, min_size=1)),
    tenant=st.text(ALNUM + "-", max_size=8), tp_rank=st.sampled_from([0, 0, 0, 1, 3, 7]),
    tp_size=st.sampled_from([1, 2, 4, 8, 8]))
config_st = optional(model=model_st, layout=layout_st, cache=cache_st, storage=storage_cfg_st, serve=serve_st)

router_cfg_props = SCHEMA["properties"]["router"]["properties"]["config"]["properties"]


def number_st(prop: dict[str, Any]) -> st.SearchStrategy[Any]:
    """Numbers (and a few edges) a schema property accepts."""
    if prop["type"] == "integer":
        return st.integers(prop.get("minimum", 0), prop.get("maximum", 1 << 20))
    lo = prop.get("minimum", prop.get("exclusiveMinimum", 0))
    hi = prop.get("maximum", 200.0)
    edges = [v for v in (lo, hi, 1.0, 0.5) if lo <= v <= hi and not (v == lo and "exclusiveMinimum" in prop)]
    return st.one_of(st.sampled_from(edges), st.floats(lo, hi, exclude_min="exclusiveMinimum" in prop)
                     .map(lambda f: round(f, 3)).filter(lambda f: f > lo or "exclusiveMinimum" not in prop))


router_config_st = optional(**{
    k: (st.sampled_from(p["enum"]) if "enum" in p else st.booleans() if p["type"] == "boolean" else number_st(p))
    for k, p in router_cfg_props.items()
    if k not in ("kv_events", "kv_events_replay", "kv_events_topic", "engine_metrics_path")}
    | {"breaker_cooldown_s": st.sampled_from([0.5, 5.0, 30.0]),
       "breaker_max_cooldown_s": st.sampled_from([1.0, 60.0, 300.0]),
       "kv_events_topic": st.sampled_from(["", "kv", "kv-events"]),
       "engine_metrics_path": st.sampled_from(["", "/metrics", "/engine/metrics"])})
endpoint_st = st.builds("tcp://{}:{}".format, st.sampled_from(["10.0.0.1", "engine-0.svc", "[::1]"]),
                        st.integers(1, 65535))
NODES_PATTERN = SCHEMA["properties"]["router"]["properties"]["nodes"]["items"]["pattern"]
node_name_st = st.from_regex(r"\A[A-Za-z0-9][A-Za-z0-9_.-]{0,12}\Z")


@st.composite
def router_nodes(draw: st.DrawFn) -> list[str]:
    n = draw(st.integers(1, 4))
    names = draw(st.lists(node_name_st, min_size=n, max_size=n, unique=True))
    hosts = draw(st.lists(host_st, min_size=n, max_size=n, unique=True))
    named = draw(st.booleans())
    nodes = [f"{name}={h}:{draw(port_st)}" if named else f"{h}:{draw(port_st)}"
             for name, h in zip(names, hosts, strict=True)]
    if draw(st.sampled_from([True] + [False] * 9)):  # one node twice: under another name, or the same name elsewhere
        name, _, addr = draw(st.sampled_from(nodes)).rpartition("=")
        nodes.append(draw(st.sampled_from([f"again={addr}", f"{name or 'n'}=other.host:1", addr.upper()])))
    return nodes


def ipv6_ok(node: str) -> bool:
    """Whether a bracketed host is an IPv6 address (the schema's pattern only lists the characters)."""
    import ipaddress

    host = node.rpartition(":")[0].rpartition("=")[2]
    if not host.startswith("["):
        return True
    try:
        ipaddress.IPv6Address(host[1:-1])
    except ValueError:
        return False
    return True


@dataclass
class Case:
    """One example: the values given to Helm, the release, and what the test knows about them."""

    values: dict[str, Any]
    release: str = "rel"
    namespace: str = "ml"
    kube: str = OLDEST_KUBE
    external: dict[tuple[str, str], str] = field(default_factory=dict)  # Secrets the operator manages
    secrets: list[str] = field(default_factory=list)  # values that must never leave a Secret
    storage_url: str | None = None  # the external L3 URL the node must get ("" none, None bundled Redis)
    risky: list[str] = field(default_factory=list)  # values drawn that the schema may refuse (JSON pointers)

    @property
    def merged(self) -> dict[str, Any]:
        merged: dict[str, Any] = coalesce(DEFAULTS, self.values)
        return merged


def url_st(scheme: str, creds: str) -> st.SearchStrategy[str]:
    hosts = st.lists(st.sampled_from(["r0.db.svc", "10.0.0.7", "r1.db.svc", "[fd00::9]"]), min_size=1, max_size=3,
                     unique=True)
    if scheme in ("redis", "rediss"):
        return st.builds(lambda h, p, db, user: f"{scheme}://{user}:{creds}@{h[0]}:{p}/{db}", hosts, port_st,
                         st.integers(0, 15), st.sampled_from(["", "app"]))
    if scheme == "redis+sentinel":
        return st.builds(lambda h: f"{scheme}://:{creds}@" + ",".join(f"{x}:26379" for x in h)
                         + f"/mymaster?sentinel_password={creds}x&ttl_s=60", hosts)
    if scheme == "redis+cluster":
        return st.builds(lambda h: f"{scheme}://app:{creds}@" + ",".join(f"{x}:6379" for x in h), hosts)
    if scheme == "file":
        return st.just("file:///mnt/l3/pages")
    return st.builds(lambda b: f"{scheme}://{b}/hicache?access_key={creds}&secret_key={creds}y",
                     st.from_regex(r"\A[a-z][a-z0-9-]{2,12}\Z"))


@st.composite
def cases(draw: st.DrawFn) -> Case:
    v: dict[str, Any] = {}
    case = Case(v, kube=draw(st.sampled_from(kube_versions())))
    if draw(st.integers(0, 5)) == 0:  # long names: every resource name must still fit
        case.release = draw(st.from_regex(r"\A[a-z][-a-z0-9]{30,51}[a-z0-9]\Z"))
        case.namespace = draw(st.from_regex(r"\A[a-z][-a-z0-9]{20,61}[a-z0-9]\Z"))
        if draw(st.booleans()):
            v["nameOverride"] = draw(st.from_regex(r"\A[a-z][-a-z0-9]{0,70}[a-z0-9]\Z"))
        if draw(st.booleans()):
            v["fullnameOverride"] = draw(st.from_regex(r"\A[a-z][-a-z0-9]{40,70}[a-z0-9]\Z"))
    config = draw(config_st)
    if config:
        v["config"] = config
    gpu = draw(st.booleans())
    node: dict[str, Any] = {"kind": draw(st.sampled_from(["daemonset", "statefulset"])),
                            "gpu": {"enabled": gpu, "count": draw(st.integers(1, 8))}}
    v["node"] = node
    if draw(st.booleans()):
        node["replicas"] = draw(st.integers(1, 5))
    if draw(st.booleans()):
        node["port"] = draw(st.sampled_from([50051, 50051, 8080, draw(port_st), 9400]))
    if draw(st.booleans()):
        node["nodeSelector"] = draw(labels_st)
    if draw(st.booleans()):
        node["tolerations"] = draw(st.lists(toleration_st, max_size=3))
    if draw(st.booleans()):
        node["extraEnv"] = draw(env_st)
    if draw(st.booleans()):
        node["podLabels"] = draw(labels_st)
        node["podAnnotations"] = draw(labels_st)
    node["hostIPC"] = draw(st.booleans())
    if draw(st.booleans()):
        node["service"] = {"type": draw(st.sampled_from(["ClusterIP", "NodePort", "LoadBalancer"])),
                           "internalTrafficPolicy": draw(st.sampled_from(["Local", "Cluster"]))}
    if draw(st.booleans()):
        node["pdb"] = {"enabled": draw(st.booleans()), "maxUnavailable": draw(st.sampled_from([1, 2, "25%"]))}
    if draw(st.booleans()):
        node["memoryOverhead"] = draw(st.sampled_from(["2Gi", "512Mi", "0", 3 << 30, "1.5Gi", "3G"]))
    # the memory limit: at what the pools need (in several spellings), above, or just below
    merged = coalesce(DEFAULTS, v)
    need = node_memory(merged)
    mode = draw(st.sampled_from(["exact", "exact-int", "round-gi", "round-mi", "round-g", "below", "default",
                                 "default", "none"]))
    limit: Any = {"exact": str(math.ceil(need)), "exact-int": math.ceil(need),
                  "round-gi": f"{math.ceil(need / (1 << 30))}Gi", "round-mi": f"{math.ceil(need / (1 << 20))}Mi",
                  "round-g": f"{math.ceil(need / 10**7) / 100:.2f}G", "below": str(math.ceil(need) - 1),
                  "default": "40Gi", "none": None}[mode]
    if mode == "none":
        node["resources"] = {"limits": None, "requests": {"cpu": "1", "memory": "1Gi"}}
    elif mode != "default":
        node["resources"] = {"requests": {"memory": limit, "cpu": "2"}, "limits": {"memory": limit}}
    if not gpu and draw(st.booleans()):
        pool = sizes(effective_config(merged)).l1
        sizes_given = [f"{-(-pool // (1 << 20))}Mi", str(pool), str(max(pool - 1, 0)), f"{pool // 1024}Ki", "64Mi"]
        node["shm"] = {"sizeLimit": draw(st.sampled_from(sizes_given))}
    if draw(st.booleans()):
        node.setdefault("shm", {})["hostPath"] = "/dev/shm"
    grace = draw(st.sampled_from(["default", "default", "default", "exact", "above", "below"]))
    if grace != "default":
        node["terminationGracePeriodSeconds"] = grace_needed(merged) + {"exact": 0, "below": -1, "above": 60}[grace]

    # L3
    store = draw(st.sampled_from(["redis", "redis", "cluster", "cluster", "external-url", "external-url",
                                  "external-secret", "none", "none", "both"]))
    redis: dict[str, Any] = {}
    v["redis"] = redis
    case.storage_url = None if store in ("redis", "cluster") else ""
    if store in ("redis", "cluster"):
        redis["cluster"] = {"enabled": store == "cluster", "masters": draw(st.integers(3, 6))}
        redis["port"] = draw(st.sampled_from([6379, 7000, 55535]))
        auth = draw(st.sampled_from(["generated", "given", "existing", "off"]))
        redis["auth"] = {"enabled": auth != "off"}
        if auth == "given":
            redis["auth"]["password"] = draw(secret_st)
            case.secrets.append(redis["auth"]["password"])
        elif auth == "existing":
            pw = draw(secret_st)
            redis["auth"].update(existingSecret="ops-redis", existingSecretKey="pw")
            case.external[("ops-redis", "pw")] = pw
        redis["persistence"] = {"enabled": draw(st.booleans()), "size": draw(st.sampled_from(["10Gi", "1Ti"]))}
    else:
        redis["enabled"] = store == "both"
        scheme = draw(st.sampled_from(["redis", "rediss", "redis+sentinel", "redis+cluster", "file", "s3", "gs",
                                       "hdfs"]))
        creds = draw(secret_st)
        url = draw(url_st(scheme, creds))
        if store in ("external-url", "both"):
            v["externalStorage"] = {"url": url}
            case.storage_url = url
            if "@" in url or "key=" in url:
                case.secrets.append(creds)
        elif store == "external-secret":
            v["externalStorage"] = {"existingSecret": "ops-store", "existingSecretKey": "url"}
            case.external[("ops-store", "url")] = url
            case.storage_url = url
        if scheme == "file" and store != "none":
            node["extraVolumes"] = [{"name": "l3", "persistentVolumeClaim": {"claimName": "l3-pages"}}]
            node["extraVolumeMounts"] = [{"name": "l3", "mountPath": "/mnt/l3"}]

    auth = draw(st.sampled_from(["off", "off", "generated", "given", "existing"]))
    v["auth"] = {"enabled": auth != "off"}
    if auth == "given":  # sometimes pasted with a space or a newline
        token = draw(secret_st) + draw(st.sampled_from(["", "", "", "\n", " x", "\u00e9"]))
        v["auth"]["token"] = token
        case.risky.append("/auth/token")
        case.secrets.append(token.strip())
    elif auth == "existing":
        v["auth"].update(existingSecret="ops-auth", existingSecretKey="token")
        case.external[("ops-auth", "token")] = draw(secret_st)
    if draw(st.booleans()):
        v["tls"] = {"enabled": True, "secretName": "hicache-tls", "mtls": draw(st.booleans())}

    router: dict[str, Any] = {"enabled": draw(st.sampled_from([True, True, False]))}
    v["router"] = router
    if router["enabled"]:
        router["replicas"] = draw(st.integers(0, 3))
        router["port"] = draw(st.sampled_from([50061, 9401, draw(port_st)]))
        router["metrics"] = {"port": draw(st.sampled_from([9401, 0, draw(port_st)]))}
        router["probes"] = {"type": draw(st.sampled_from(["grpc", "tcp"]))}
        router["config"] = draw(router_config_st)
        if draw(st.booleans()):
            router["nodes"] = draw(router_nodes())
        elif draw(st.integers(0, 3)) == 0:  # anything the schema lets through
            any_node = st.from_regex(NODES_PATTERN, fullmatch=True).filter(ipv6_ok)
            router["nodes"] = draw(st.lists(any_node, min_size=1, max_size=3))
        if router.get("nodes") and router["config"].get("index", "events") == "events" and draw(st.booleans()):
            from hicache.router.config import parse_node

            try:
                names = sorted({parse_node(n).name for n in router["nodes"]})  # some nodes are engines
            except ValueError:  # nodes the router refuses (a broken rule of its own): no engines then
                names = []
            if names:
                engines = draw(st.lists(st.sampled_from(names), min_size=1, unique=True))
                router["config"]["kv_events"] = {n: draw(endpoint_st) for n in engines}
                router["config"]["kv_events_replay"] = {n: draw(endpoint_st) for n in engines
                                                        if draw(st.booleans())}
        if draw(st.booleans()):
            router["nodeSelector"] = draw(labels_st)
            router["tolerations"] = draw(st.lists(toleration_st, max_size=2))
            router["extraEnv"] = draw(env_st)

    metrics: dict[str, Any] = {"enabled": draw(st.sampled_from([True, True, False]))}
    v["metrics"] = metrics
    if metrics["enabled"]:
        metrics["port"] = draw(st.sampled_from([9400, 9400, 9400, 9400, 50051, draw(port_st)]))
        metrics["annotations"] = draw(st.booleans())
        metrics["serviceMonitor"] = {"enabled": draw(st.booleans()), "labels": draw(labels_st)}
        if draw(st.booleans()):
            metrics["serviceMonitor"]["interval"] = draw(st.sampled_from(["5s", "15s", "1m", "500ms", "2h"]))
        if draw(st.booleans()):
            metrics["serviceMonitor"]["scrapeTimeout"] = draw(st.sampled_from(["5s", "10s", "30s", "900ms", "1m"]))
        metrics["prometheusRule"] = {"enabled": draw(st.booleans()), "hitRateBelow": draw(st.sampled_from([0, 0.5])),
                                     "matchLatencyP99Seconds": draw(st.sampled_from([0.01, 2]))}
        metrics["grafanaDashboard"] = {"enabled": draw(st.booleans())}
    return case


# --- checks ----------------------------------------------------------------------------------------------


def assert_fails_with_a_chart_message(e: Exception, broken: set[str]) -> None:
    msg = str(e)
    assert isinstance(e, helm.HelmRenderError), f"{type(e).__name__}: {msg}"
    assert "execution error at" in msg and not any(t in msg for t in TEMPLATE_ERRORS), msg
    text = msg.split("): ", 1)[1]
    assert any(p.fullmatch(text) for p in FAIL_PATTERNS), f"not one of the chart's fail messages: {msg}"
    assert broken, f"the render failed but no rule is broken: {msg}"
    assert any(RULES[b] in text for b in broken), f"broken {sorted(broken)}, but the chart said: {text}"


def check_manifests(r: Rendered, c: Case) -> None:
    for doc in r.docs:
        if doc["kind"] in ("ServiceMonitor", "PrometheusRule"):  # CRDs: no schema in Kubernetes itself
            continue
        kv.validate(doc, c.kube, strict=True)
        name = doc["metadata"]["name"]
        limit = 63 if doc["kind"] in ("Service", "ServiceAccount") else 253
        assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*", name), name
        assert len(name) <= limit, f"{doc['kind']}/{name}: {len(name)} characters"
        if doc["kind"] == "Service":
            assert re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", name), f"Service {name}: not a DNS-1035 label"
        if doc["kind"] == "StatefulSet":
            # the controller labels each pod controller-revision-hash=<name>-<hash of up to 10 characters>,
            # a label value of at most 63 characters; pods are <name>-<ordinal>, DNS labels
            assert len(name) <= 52, f"StatefulSet {name}: {len(name)} characters, its pods cannot be created"
        for k, val in doc["metadata"].get("labels", {}).items():
            assert len(val) <= 63, (k, val)
        if doc["kind"] in ("DaemonSet", "StatefulSet", "Deployment", "Job"):
            for ctr in pod_spec(doc)["containers"]:
                ports = [p["containerPort"] for p in ctr.get("ports", [])]
                assert len(ports) == len(set(ports)), f"{name}: container ports {ports}"
                res = ctr.get("resources") or {}
                for k, req in (res.get("requests") or {}).items():  # the API server's rule
                    lim = (res.get("limits") or {}).get(k)
                    assert lim is None or quantity(req) <= quantity(lim), f"{name}: {k} request {req} > limit {lim}"
        if doc["kind"] == "Service":
            ports = [p["port"] for p in doc["spec"]["ports"]]
            assert len(ports) == len(set(ports)), f"Service {name}: ports {ports}"


def seconds(duration: str) -> float:
    m = re.fullmatch(r"([0-9]+)(ms|s|m|h)", duration)
    assert m, duration
    return int(m.group(1)) * {"ms": 0.001, "s": 1, "m": 60, "h": 3600}[m.group(2)]


def check_selectors(r: Rendered) -> None:
    workloads = [d for d in r.docs if d["kind"] in ("DaemonSet", "StatefulSet", "Deployment")]
    pods = [d["spec"]["template"]["metadata"]["labels"] for d in workloads]
    for d in workloads:
        assert d["spec"]["selector"]["matchLabels"].items() <= d["spec"]["template"]["metadata"]["labels"].items()
        others = [o for o in workloads if o is not d]
        assert not any(d["spec"]["selector"]["matchLabels"].items() <= o["spec"]["template"]["metadata"]["labels"]
                       .items() for o in others), f"{d['metadata']['name']} selects another workload's pods"
    for d in r.docs:
        if d["kind"] == "Service":
            matched = [p for p in pods if d["spec"]["selector"].items() <= p.items()]
            assert len(matched) == 1, d["metadata"]["name"]
        if d["kind"] == "PodDisruptionBudget":
            matched = [p for p in pods if d["spec"]["selector"]["matchLabels"].items() <= p.items()]
            assert len(matched) == 1, d["metadata"]["name"]
    for sm in r.kinds("ServiceMonitor"):
        for ep in sm["spec"]["endpoints"]:  # Prometheus refuses a scrape config whose timeout exceeds its interval
            if ep.get("scrapeTimeout") and ep.get("interval"):  # else Prometheus' defaults
                assert seconds(ep["scrapeTimeout"]) <= seconds(ep["interval"]), ep
        sel = sm["spec"]["selector"]["matchLabels"]
        scraped = [s for s in r.kinds("Service") if sel.items() <= s["metadata"]["labels"].items()]
        assert any(s["metadata"]["name"].endswith("-node-headless") for s in scraped)
        for s in scraped:
            assert s["spec"].get("clusterIP") == "None" or "router" in s["metadata"]["name"]


def node_services(r: Rendered) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """(the node workload, its Service, its headless Service), found through their selectors."""
    node = r.component("node")
    labels = node["spec"]["template"]["metadata"]["labels"]
    svcs = [s for s in r.kinds("Service") if s["spec"]["selector"].items() <= labels.items()]
    (headless,) = [s for s in svcs if s["spec"].get("clusterIP") == "None"]
    (svc,) = [s for s in svcs if s["spec"].get("clusterIP") != "None"]
    return node, svc, headless


def check_node(r: Rendered, c: Case) -> HiCacheConfig:
    m = c.merged
    cfg = config_from_dict(r.config_data())
    # the values given, as hicache reads them
    for section, fields in effective_config(m).items():
        for k, want in fields.items():
            assert getattr(getattr(cfg, section), k) == want, f"config.{section}.{k}"
    gpu = get(m, "node.gpu.enabled")
    assert cfg.cache.device == ("cuda" if gpu else "cpu") and cfg.storage.url == "" and cfg.serve.auth_token == ""
    tls = get(m, "tls.enabled")
    assert (cfg.serve.tls_cert, cfg.serve.tls_key, cfg.serve.tls_client_ca) == (
        ("/etc/hicache/tls/tls.crt", "/etc/hicache/tls/tls.key",
         "/etc/hicache/tls/ca.crt" if get(m, "tls.mtls") else "")
        if tls else ("", "", ""))
    # ports: config, container, Services, probes, annotations
    node, svc, headless = node_services(r)
    ctr = container(node, "node")
    ports = {p["name"]: p["containerPort"] for p in ctr["ports"]}
    metrics = get(m, "metrics.enabled")
    assert cfg.serve.host == "0.0.0.0" and cfg.serve.port == get(m, "node.port") == ports["grpc"]
    assert cfg.serve.metrics_port == (get(m, "metrics.port") if metrics else 0) == ports.get("metrics", 0)
    for s in (svc, headless):
        sp = {p["name"]: p for p in s["spec"]["ports"]}
        assert sp["grpc"]["port"] == cfg.serve.port and sp["grpc"]["targetPort"] == "grpc"
        for p in sp.values():
            assert p["targetPort"] in ports, f"{s['metadata']['name']}: targetPort {p['targetPort']}"
    assert ("metrics" in {p["name"] for p in headless["spec"]["ports"]}) == metrics
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        if tls:  # Kubernetes' grpc probe cannot speak TLS
            assert ctr[probe]["tcpSocket"] == {"port": "grpc"} and "grpc" not in ctr[probe]
        else:
            service = "hicache.v1.HiCache" if probe == "readinessProbe" else ""
            assert ctr[probe]["grpc"] == {"port": cfg.serve.port, "service": service}
    ann = node["spec"]["template"]["metadata"]["annotations"]
    if metrics and get(m, "metrics.annotations"):
        assert int(ann["prometheus.io/port"]) == cfg.serve.metrics_port
    else:
        assert "prometheus.io/port" not in ann
    if node["kind"] == "StatefulSet":
        assert node["spec"]["serviceName"] == headless["metadata"]["name"]
        assert node["spec"]["replicas"] == get(m, "node.replicas")
    # memory: the limit holds what hicache allocates
    limit = (ctr["resources"].get("limits") or {}).get("memory")
    pools = sizes(effective_config(m))
    assert host_pool_bytes(cfg) == pools.l2  # the arithmetic above is hicache's own
    if limit is not None:
        l1 = 0 if gpu else cfg.l1_pages * cfg.layout.to_layout().bytes_per_page
        assert quantity(limit) >= pools.l2 + l1 + quantity(get(m, "node.memoryOverhead") or 0)
    if gpu:
        name, count = get(m, "node.gpu.resourceName"), get(m, "node.gpu.count")
        assert ctr["resources"]["limits"][name] == ctr["resources"]["requests"][name] == count
    # /dev/shm holds the CPU pool when it is shared there
    dshm = next(vol for vol in pod_spec(node)["volumes"] if vol["name"] == "dshm")
    if "emptyDir" in dshm and not gpu and cfg.serve.shared_pool:
        assert quantity(dshm["emptyDir"]["sizeLimit"]) >= cfg.l1_pages * cfg.layout.to_layout().bytes_per_page
    assert pod_spec(node)["terminationGracePeriodSeconds"] >= 2 * cfg.serve.shutdown_grace_s + 20
    # what the node reads at start: the file plus its environment (the L3 URL and the token from Secrets)
    env = container_env(r, ctr, c.external)
    full = config_from_dict(merge(r.config_data(), env_overrides(env)))
    if c.storage_url is None:  # the bundled Redis, through its Services
        assert_bundled_redis_url(r, c, full.storage.url)
    else:
        assert full.storage.url == c.storage_url
    token = expected_token(r, c)
    assert full.serve.auth_token == token
    return cfg


def expected_token(r: Rendered, c: Case) -> str:
    a = c.merged.get("auth") or {}
    if not get(a, "enabled"):
        return ""
    if get(a, "existingSecret"):
        return c.external[(get(a, "existingSecret"), get(a, "existingSecretKey"))]
    token = r.secret_data()["auth-token"]
    assert token == get(a, "token") or (not get(a, "token") and re.fullmatch(r"[A-Za-z0-9]{40}", token))
    return token


def assert_bundled_redis_url(r: Rendered, c: Case, url: str) -> None:
    rd = c.merged["redis"]
    sts = r.component("redis")
    labels = sts["spec"]["template"]["metadata"]["labels"]
    svcs = {s["metadata"]["name"]: s for s in r.kinds("Service") if s["spec"]["selector"].items() <= labels.items()}
    headless = sts["spec"]["serviceName"]
    assert svcs[headless]["spec"]["clusterIP"] == "None"
    (plain,) = [n for n in svcs if n != headless]
    args = container(sts)["args"]
    assert args[args.index("--port") + 1] == str(get(rd, "port"))
    if get(rd, "auth.enabled"):
        if get(rd, "auth.existingSecret"):
            pw = c.external[(get(rd, "auth.existingSecret"), get(rd, "auth.existingSecretKey"))]
        else:
            pw = r.secret_data()["redis-password"]
            assert pw == get(rd, "auth.password") or re.fullmatch(r"[A-Za-z0-9]{32}", pw)
        auth = f":{pw}@"
    else:
        auth = ""
    if get(rd, "cluster.enabled"):
        assert sts["spec"]["replicas"] == get(rd, "cluster.masters")
        hosts = [f"{sts['metadata']['name']}-{i}.{headless}.{c.namespace}.svc:{rd['port']}"
                 for i in range(get(rd, "cluster.masters"))]
        assert url == f"redis+cluster://{auth}{','.join(hosts)}"
    else:
        assert url == f"redis://{auth}{plain}.{c.namespace}.svc:{rd['port']}"


def router_argv(r: Rendered) -> list[str]:
    ctr = container(r.component("router"))
    return [*ctr.get("command", []), *ctr["args"]]


def check_router(r: Rendered, c: Case, node_cfg: HiCacheConfig, tmp_path: Path) -> None:
    from hicache.cli import build_parser
    from hicache.router.cli import overrides_from_args
    from hicache.router.config import load_router_config, parse_node

    m = c.merged
    if not get(m, "router.enabled"):
        assert not [d for d in r.docs if d["metadata"]["labels"].get("app.kubernetes.io/component") == "router"]
        assert "router.yaml" not in r.config_map()["data"]
        return
    dep = r.component("router")
    ctr = container(dep)
    node, _, headless = node_services(r)
    argv = router_argv(r)
    given = get(m, "router.nodes") or []
    if argv[0] == "python3":  # a DaemonSet's node pods, resolved from the headless Service at start
        assert not given and node["kind"] == "DaemonSet"
        host, port = argv[3], argv[4]
        assert host == f"{headless['metadata']['name']}.{c.namespace}.svc"
        assert int(port) == node_cfg.serve.port
        argv = [*argv[5:], f"--node=node-10-0-0-1=10.0.0.1:{port}"]
    flags = [a.removeprefix("--node=") for a in argv if a.startswith("--node=")]
    if given:
        assert flags == given
    elif node["kind"] == "StatefulSet":
        sts = node["metadata"]["name"]
        pods = [f"{sts}-{i}" for i in range(node["spec"]["replicas"])]
        assert flags == [f"{p}={p}.{headless['metadata']['name']}.{c.namespace}.svc:{node_cfg.serve.port}"
                         for p in pods]
        for p in pods:
            assert len(p) <= 63
        assert {pp["port"] for pp in headless["spec"]["ports"] if pp["name"] == "grpc"} == {node_cfg.serve.port}
    for f in flags:
        parse_node(f)
    # router.yaml + the command line + the environment, as `hicache route` loads them
    path = tmp_path / "router.yaml"
    path.write_text(r.config_map()["data"]["router.yaml"])
    args = build_parser("route").parse_args(argv)
    mounts = {mm["mountPath"]: mm.get("subPath") for mm in ctr["volumeMounts"]}
    assert args.command == "route" and mounts[args.config] == "router.yaml"
    ns_cfg, rc = load_router_config(path, env=container_env(r, ctr, c.external), overrides=overrides_from_args(args))
    assert ns_cfg.namespace().digest == node_cfg.namespace().digest
    for k, want in (get(m, "router.config") or {}).items():
        assert getattr(rc, k) == want, f"router.config.{k}"
    ports = {p["name"]: p["containerPort"] for p in ctr["ports"]}
    rmetrics = get(m, "metrics.enabled") and get(m, "router.metrics.port") > 0
    assert (rc.host, rc.port, rc.metrics_port) == ("0.0.0.0", get(m, "router.port"),
                                                   get(m, "router.metrics.port") if rmetrics else 0)
    assert ports == {"grpc": rc.port} | ({"metrics": rc.metrics_port} if rmetrics else {})
    (rsvc,) = [s for s in r.kinds("Service") if s["spec"]["selector"].items() <=
               dep["spec"]["template"]["metadata"]["labels"].items()]
    assert {p["name"]: p["port"] for p in rsvc["spec"]["ports"]} == ports
    grpc_probe = get(m, "router.probes.type") == "grpc"
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        if grpc_probe:
            assert ctr[probe]["grpc"]["port"] == rc.port
        else:
            assert ctr[probe]["tcpSocket"] == {"port": "grpc"}
    assert rc.node_token == rc.auth_token == expected_token(r, c)
    if get(m, "tls.enabled"):
        assert rc.node_tls_ca == "/etc/hicache/tls/ca.crt"
        assert (rc.node_client_cert != "") == bool(get(m, "tls.mtls"))
    grace = pod_spec(dep)["terminationGracePeriodSeconds"]
    assert grace >= rc.shutdown_grace_s + 10 and grace >= 30


def check_secrets(r: Rendered, c: Case) -> None:
    """Tokens, passwords and URL credentials are in the Secret only; references name real keys."""
    own = {s["metadata"]["name"]: set(s.get("data") or {}) for s in r.kinds("Secret")}
    for doc in r.docs:
        if doc["kind"] == "Secret":
            continue
        text = json.dumps(doc)
        for s in c.secrets + [v for v in r.secret_data().values()] + list(c.external.values()):
            assert s not in text, f"a secret appears in {doc['kind']}/{doc['metadata']['name']}"
        if doc["kind"] in ("DaemonSet", "StatefulSet", "Deployment", "Job"):
            for ctr in pod_spec(doc)["containers"]:
                for e in ctr.get("env") or []:
                    ref = e.get("valueFrom", {}).get("secretKeyRef")
                    if ref:
                        assert ref["key"] in own.get(ref["name"], set()) or (ref["name"], ref["key"]) in c.external
    for s in c.secrets + list(r.secret_data().values()) + list(c.external.values()):
        assert s not in r.notes
    for secret in r.kinds("Secret"):
        for v in (secret.get("data") or {}).values():
            base64.b64decode(v, validate=True)


# --- the properties --------------------------------------------------------------------------------------


ROUTER_ON = {"router": {"enabled": True}, "metrics": {"enabled": True}}


@settings(max_examples=140, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(c=cases())
# bugs found this way, kept as fixed examples: StatefulSet names too long for their pods' revision label
@example(c=Case({"node": {"kind": "statefulset"}}, release="kv-" + "x" * 42))
# the router's metrics port on its gRPC port (one Service port twice, the router cannot bind both)
@example(c=Case({**ROUTER_ON, "router": {"port": 9401, "metrics": {"port": 9401}}}))
# router.config values hicache route refuses: out of range, or a max cooldown below the cooldown
@example(c=Case({"router": {"config": {"l2_weight": 1.5}}}, risky=["/router/config/l2_weight"]))
@example(c=Case({"router": {"config": {"balance_abs_threshold": 0}}}, risky=["/router/config/balance_abs_threshold"]))
@example(c=Case({"router": {"config": {"balance_rel_threshold": 0.5}}}, risky=["/router/config/balance_rel_threshold"]))
@example(c=Case({"router": {"config": {"breaker_cooldown_s": 90.0}}}))
# router.nodes entries the schema let through but hicache route refuses: a bad name or port, one node twice
@example(c=Case({"router": {"nodes": ["gpu/0=10.0.0.1:50051"]}}, risky=["/router/nodes/0"]))
@example(c=Case({"router": {"nodes": ["a=10.0.0.1:70000"]}}, risky=["/router/nodes/0"]))
@example(c=Case({"router": {"nodes": ["a=10.0.0.1:50051", "b=10.0.0.1:50051"]}}))
# a token pasted with its newline: no gRPC client can send it, every call would be refused
@example(c=Case({"auth": {"enabled": True, "token": "s3cr3t-t0ken\n"}}, risky=["/auth/token"]))
# a ServiceMonitor Prometheus refuses: its scrape timeout longer than its interval
@example(c=Case({"metrics": {"serviceMonitor": {"enabled": True, "interval": "5s"}}}))
def test_random_values_render_valid_consistent_manifests_or_fail_clearly(c: Case, tmp_path_factory: Any) -> None:
    check_case(c, tmp_path_factory.mktemp("router"))


def check_case(c: Case, tmp: Path) -> None:
    broken = broken_rules(c.merged)
    try:
        r = render(c.values, name=c.release, namespace=c.namespace)
    except helm.HelmValuesError as e:  # only for a value the strategy knows the schema may refuse
        where = set(re.findall(r"at '([^']*)'", str(e)))
        assert where and where <= set(c.risky), str(e)
        return
    except helm.HelmError as e:
        assert_fails_with_a_chart_message(e, broken)
        return
    assert not broken, f"rules {sorted(broken)} are broken, but the chart rendered"
    check_manifests(r, c)
    check_selectors(r)
    node_cfg = check_node(r, c)
    check_router(r, c, node_cfg, tmp)
    check_secrets(r, c)


def default_paths(d: dict[str, Any], prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """Every key of the chart's default values (nested ones too)."""
    out = []
    for k, v in d.items():
        out.append((*prefix, k))
        if isinstance(v, dict):
            out.extend(default_paths(v, (*prefix, k)))
    return out


# keys the chart defines (not those inside Kubernetes objects it passes through, like podSecurityContext)
def schema_at(path: tuple[str, ...]) -> dict[str, Any]:
    node: dict[str, Any] = SCHEMA
    for p in path:
        node = node.get("properties", {}).get(p, {})
    return node


DEFAULT_PATHS = [p for p in default_paths(DEFAULTS)
                 if "properties" in schema_at(p[:-1])
                 or isinstance(schema_at(p[:-1]).get("additionalProperties"), dict)]
BASES: list[dict[str, Any]] = [  # a default key is removed from each of these
    {},
    {"node": {"kind": "statefulset", "gpu": {"enabled": False}, "resources": {"limits": {"memory": "64Gi"}}},
     "auth": {"enabled": True}, "tls": {"enabled": True, "secretName": "t"},
     "metrics": {"serviceMonitor": {"enabled": True}, "prometheusRule": {"enabled": True},
                 "grafanaDashboard": {"enabled": True}},
     "redis": {"cluster": {"enabled": True}, "persistence": {"enabled": True}}},
    {"redis": {"enabled": False}, "externalStorage": {"url": "s3://b/p"}, "router": {"nodes": ["a=h:1"]}},
]


def without(values: dict[str, Any], path: tuple[str, ...]) -> dict[str, Any]:
    """``values`` with ``path`` set to null (Helm then drops the chart's default there)."""
    out = json.loads(json.dumps(values))
    d = out
    for p in path[:-1]:
        d = d.setdefault(p, {})
    d[path[-1]] = None
    return out


def schema_requires(path: tuple[str, ...]) -> bool:
    """Whether values.schema.json requires the key at ``path``."""
    return path[-1] in schema_at(path[:-1]).get("required", [])


@settings(max_examples=80, deadline=None)
@given(path=st.sampled_from(DEFAULT_PATHS), base=st.sampled_from(BASES))
# template errors found this way (nil pointer, wrong type), kept as fixed examples
@example(path=("node", "shm"), base={})
@example(path=("node", "gpu", "enabled"), base={})
@example(path=("node", "replicas"), base=BASES[1])  # a StatefulSet of one pod, a router with no node
@example(path=("node", "readinessProbe"), base={})
@example(path=("metrics", "serviceMonitor"), base={})
@example(path=("redis", "auth"), base={})
@example(path=("redis", "cluster", "masters"), base=BASES[1])
@example(path=("router", "extraArgs"), base={})
def test_removing_a_default_renders_or_names_the_key(path: tuple[str, ...], base: dict[str, Any],
                                                      tmp_path_factory: Any) -> None:
    check_without(path, base, tmp_path_factory.mktemp("router"))


def check_without(path: tuple[str, ...], base: dict[str, Any], tmp: Path) -> None:
    c = Case(without(base, path))
    m = c.merged
    c.storage_url = get(m, "externalStorage.url") or ("" if not get(m, "redis.enabled") else None)
    try:
        r = render(c.values)
    except helm.HelmValuesError as e:  # the schema says which key is missing
        # required, or tls.secretName, which the schema requires while tls.enabled
        assert schema_requires(path) or path == ("tls", "secretName"), str(e)
        assert f"missing property '{path[-1]}'" in str(e) or path[-1] in str(e), str(e)
        return
    except helm.HelmError as e:
        assert_fails_with_a_chart_message(e, broken_rules(m))
        return
    assert not schema_requires(path)
    assert not broken_rules(m)
    check_manifests(r, c)
    check_selectors(r)
    node_cfg = check_node(r, c)
    check_router(r, c, node_cfg, tmp)
    check_secrets(r, c)
