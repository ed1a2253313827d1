#!/usr/bin/env python3
"""Writes the chart's values.schema.json from hicache's own definitions (enums and field names come from
the code, so the schema cannot drift from what ``hicache serve`` / ``hicache route`` accept).

    python deploy/helm/values_schema.py            # rewrite deploy/helm/hicache/values.schema.json
    python deploy/helm/values_schema.py --check    # exit 1 when the committed file differs

Fields the chart owns (listen addresses, ports, ``cache.device``, TLS paths, ``storage.url``, tokens) are
left out of ``config`` / ``router.config`` on purpose: a value there is rejected, so secrets cannot land in
the ConfigMap.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from hicache.config import (
    IO_BACKENDS,
    PREFETCH_POLICIES,
    TRANSFER_CHOICE_OPTIONS,
    TRANSFER_INT_OPTIONS,
    WRITE_POLICIES,
)
from hicache.eviction import policy_names
from hicache.layout import DTYPES, HOST_LAYOUTS
from hicache.storage.page_codec import LEVELS, codec_names
from hicache.router.config import INDEX_MODES
from hicache.router.scoring import policy_names as router_policy_names

SCHEMA_PATH = Path(__file__).resolve().parent / "hicache" / "values.schema.json"
Schema = dict[str, Any]


def obj(props: Schema, required: tuple[str, ...] = (), **kw: Any) -> Schema:
    d: Schema = {"type": "object", "additionalProperties": False, "properties": props}
    if required:
        d["required"] = list(required)
    d.update(kw)
    return d


def integer(minimum: int | None = None, maximum: int | None = None) -> Schema:
    d: Schema = {"type": "integer"}
    if minimum is not None:
        d["minimum"] = minimum
    if maximum is not None:
        d["maximum"] = maximum
    return d


def number(minimum: float | None = None, maximum: float | None = None, positive: bool = False) -> Schema:
    d: Schema = {"type": "number"}
    if positive:
        d["exclusiveMinimum"] = 0
    elif minimum is not None:
        d["minimum"] = minimum
    if maximum is not None:
        d["maximum"] = maximum
    return d


def string(**kw: Any) -> Schema:
    return {"type": "string", **kw}


def enum(values: Any) -> Schema:
    return {"type": "string", "enum": list(values)}


BOOL: Schema = {"type": "boolean"}
ANY_OBJECT: Schema = {"type": "object"}
# node name -> ZeroMQ endpoint of an engine's KV-event publisher (router.kv_events)
ENDPOINTS: Schema = {"type": "object",
                     "additionalProperties": {"type": "string", "pattern": "^(tcp://[^*/][^/]*:[0-9]+|ipc://.+)$"}}
ANY_LIST: Schema = {"type": "array"}
PORT = integer(1, 65535)
QUANTITY: Schema = {"type": ["string", "integer", "number"],
                    "pattern": r"^[0-9]+(\.[0-9]+)?(m|k|Ki|Mi|Gi|Ti|Pi|Ei|M|G|T|P|E)?$"}
RESOURCES = obj({"requests": {"type": "object", "additionalProperties": QUANTITY},
                 "limits": {"type": "object", "additionalProperties": QUANTITY}, "claims": ANY_LIST})
PROBE = obj({"periodSeconds": integer(1), "failureThreshold": integer(1), "timeoutSeconds": integer(1),
             "initialDelaySeconds": integer(0), "successThreshold": integer(1)})
LABELS: Schema = {"type": "object", "additionalProperties": {"type": "string"}}
SECRET_KEY = string(minLength=1, pattern=r"^[-._a-zA-Z0-9]+$")
PULL_POLICY = enum(["Always", "IfNotPresent", "Never"])
SERVICE_TYPE = enum(["ClusterIP", "NodePort", "LoadBalancer"])
DURATION = string(pattern=r"^[0-9]+(ms|s|m|h)$")
BUDGET: Schema = {"type": ["integer", "string"]}
# router.nodes entries as hicache.router.config.parse_node accepts them: [NAME=]host:port, NAME of letters,
# digits, '_', '.', '-' (63 at most), a host name, IPv4 or [IPv6] address, a port in 1-65535
NODE_PATTERN = (r"^([A-Za-z0-9][A-Za-z0-9_.-]{0,62}=)?(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9_.-]+)"
                r":([1-9][0-9]{0,3}|[1-5][0-9]{4}|6[0-4][0-9]{3}|65[0-4][0-9]{2}|655[0-2][0-9]|6553[0-5])$")


def config_schema() -> Schema:
    """``config``: the sections of hicache.config.HiCacheConfig, less what the chart sets."""
    return obj({
        "model": obj({
            "name": string(minLength=1, description="model id; part of every page key's namespace"),
            "revision": string(minLength=1, description="weights revision: different weights never share pages"),
            "tenant": string(description="default tenant salt"),
            "tp_rank": integer(0), "tp_size": integer(1)}),
        "layout": obj({
            "num_layers": integer(1), "num_kv_heads": integer(1), "head_dim": integer(1),
            "dtype": enum(sorted(DTYPES)), "page_size": integer(1), "attention": enum(["mha", "mla"])}),
        "cache": obj({
            "l1_tokens": integer(1), "l2_tokens": integer(0), "host_layout": enum(list(HOST_LAYOUTS)),
            "host_block_pages": integer(0),
            "write_policy": enum(WRITE_POLICIES), "eviction_policy": enum(policy_names()),
            "io_backend": enum(IO_BACKENDS), "max_pinned_fraction": number(0, 1),
            "transfer_options": obj({**{k: integer(low) for k, low in TRANSFER_INT_OPTIONS.items()},
                                     **{k: enum(list(v)) for k, v in TRANSFER_CHOICE_OPTIONS.items()}},
                                    description="tuning of the GPU transfer engine"),
            # Helm's toYaml cannot write a key holding DEL, a C1 control or U+FFFE / U+FFFF: it would
            # render an empty hicache.yaml, so the schema refuses such tenant names
            "tenant_shares": {"type": "object", "additionalProperties": False, "patternProperties": {
                                  "^[^\u007f-\u009f\ufffe\uffff]*$": number(maximum=1, positive=True)},
                              "description": "tenant -> share of L1 and L2 beyond which its pages are "
                                             "evicted first ('*': tenants not listed)"}},
            description="cache.device is set by the chart (node.gpu.enabled)"),
        "storage": obj({
            "prefetch_policy": enum(PREFETCH_POLICIES), "prefetch_threshold_tokens": integer(0),
            "prefetch_timeout_base_s": number(0), "prefetch_timeout_per_1k_tokens_s": number(0),
            "prefetch_timeout_max_s": number(0), "prefetch_max_inflight_bytes": integer(1),
            "io_batch_pages": integer(1), "writeback_queue_pages": integer(1),
            "writeback_when_full": enum(["block", "drop"]), "compression": enum(codec_names()),
            "compression_level": integer(*LEVELS), "options": ANY_OBJECT},
            description="storage.url comes from redis.* / externalStorage.* (an external URL through the Secret)"),
        "serve": obj({
            "max_concurrency": integer(1), "max_message_bytes": integer(1 << 20), "max_request_tokens": integer(1),
            "shutdown_grace_s": number(0), "shared_pool": BOOL},
            description="host, ports, TLS paths and the metrics address are set by the chart; auth_token, "
                        "auth_tokens_file and metrics_token come from auth.* / metrics.* (Secrets)"),
    })


def router_config_schema() -> Schema:
    """``router.config``: hicache.router.config.RouterConfig, less what the chart sets."""
    return obj({
        "policy": enum(router_policy_names()), "load_weight": number(0), "l2_weight": number(0, 1),
        "min_prefix_score": number(0, 1), "balance_abs_threshold": number(positive=True),
        "balance_rel_threshold": number(1),
        "route_ttl_s": number(positive=True), "stats_interval_s": number(positive=True),
        "index": enum(list(INDEX_MODES)), "approx_ttl_s": number(positive=True),
        "approx_capacity_tokens": integer(1),
        "breaker_failures": integer(1), "breaker_cooldown_s": number(positive=True),
        "breaker_max_cooldown_s": number(positive=True), "reconnect_max_s": number(positive=True),
        "event_queue": integer(0), "verify_keys": BOOL, "max_request_tokens": integer(1),
        "shutdown_grace_s": number(positive=True),
        "kv_events": ENDPOINTS, "kv_events_replay": ENDPOINTS, "kv_events_topic": string(),
        "engine_metrics_path": {"type": "string", "pattern": "^(/.*)?$"}},
        description="host, port, metrics_port and metrics_host, nodes, tokens, the tokens file and TLS paths are set "
                    "by the chart")


def values_schema() -> Schema:
    return {
        "$schema": "https://json-schema.org/draft-07/schema#",
        "title": "hicache chart values",
        "type": "object",
        "additionalProperties": False,
        "properties": {
            "global": ANY_OBJECT,
            "nameOverride": string(), "fullnameOverride": string(),
            "image": obj({"repository": string(minLength=1), "tag": string(), "pullPolicy": PULL_POLICY},
                         required=("repository",)),
            "imagePullSecrets": {"type": "array", "items": obj({"name": string(minLength=1)}, required=("name",))},
            "serviceAccount": obj({"create": BOOL, "name": string(), "annotations": LABELS, "automountToken": BOOL}),
            "config": config_schema(),
            "auth": obj({"enabled": BOOL,
                         "token": string(pattern=r"^[!-~]*$",
                                         description="visible ASCII only (it travels in gRPC metadata): no spaces, "
                                                     "no trailing newline"),
                         "existingSecret": string(),
                         "existingSecretKey": SECRET_KEY,
                         "tokensFileSecret": string(description="a Secret holding a tokens file (tokens -> "
                                                                "tenants): serve.auth_tokens_file"),
                         "tokensFileKey": SECRET_KEY}),
            "tls": {**obj({"enabled": BOOL, "secretName": string(), "mtls": BOOL}),
                    "if": {"properties": {"enabled": {"const": True}}, "required": ["enabled"]},
                    "then": {"properties": {"secretName": string(minLength=1)}}},
            "node": obj({
                "enabled": BOOL, "kind": enum(["daemonset", "statefulset"]), "replicas": integer(1), "port": PORT,
                "gpu": obj({"enabled": BOOL, "count": integer(1), "resourceName": string(minLength=1)},
                           required=("enabled", "count", "resourceName")),
                "nodeSelector": LABELS, "tolerations": ANY_LIST, "affinity": ANY_OBJECT,
                "priorityClassName": string(), "runtimeClassName": string(), "hostIPC": BOOL,
                "shm": obj({"sizeLimit": string(pattern=r"^$|^[0-9]+(\.[0-9]+)?(k|Ki|Mi|Gi|Ti|M|G|T)?$"),
                            "hostPath": string(pattern=r"^$|^/")}),
                "memoryOverhead": QUANTITY, "resources": RESOURCES,
                "service": obj({"type": SERVICE_TYPE, "internalTrafficPolicy": enum(["Local", "Cluster"]),
                                "annotations": LABELS}),
                "podAnnotations": LABELS, "podLabels": LABELS, "updateStrategy": ANY_OBJECT,
                "terminationGracePeriodSeconds": integer(0),
                "startupProbe": PROBE, "livenessProbe": PROBE, "readinessProbe": PROBE,
                "pdb": obj({"enabled": BOOL, "maxUnavailable": BUDGET}, required=("maxUnavailable",)),
                "extraEnv": ANY_LIST, "extraVolumes": ANY_LIST, "extraVolumeMounts": ANY_LIST},
                required=("enabled", "kind", "replicas", "port", "gpu", "shm", "resources", "service", "pdb",
                          "startupProbe", "livenessProbe", "readinessProbe")),
            "router": obj({
                "enabled": BOOL, "replicas": integer(0), "port": PORT, "config": router_config_schema(),
                "nodes": {"type": "array", "items": string(pattern=NODE_PATTERN)},
                "extraArgs": {"type": "array", "items": string()},
                "resources": RESOURCES, "nodeSelector": LABELS, "tolerations": ANY_LIST, "affinity": ANY_OBJECT,
                "priorityClassName": string(), "podAnnotations": LABELS, "podLabels": LABELS,
                "service": obj({"type": SERVICE_TYPE, "annotations": LABELS}),
                "metrics": obj({"port": integer(0, 65535)}, required=("port",)),
                "probes": obj({"type": enum(["grpc", "tcp"])}),
                "pdb": obj({"enabled": BOOL, "minAvailable": BUDGET}, required=("minAvailable",)),
                "extraEnv": ANY_LIST},
                required=("port", "extraArgs", "service", "metrics", "probes", "pdb")),
            # SGLang / vLLM servers the router follows (their names, addresses and endpoints are checked by
            # the templates, with one-line messages)
            "engines": {"type": "array", "items": obj({"name": string(), "address": string(), "kvEvents": string(),
                                                       "kvEventsReplay": string()})},
            "metrics": obj({
                "enabled": BOOL, "port": PORT, "annotations": BOOL,
                "auth": obj({"enabled": BOOL,
                             "token": string(pattern=r"^[!-~]*$", description="visible ASCII only (an HTTP "
                                                                              "header value): no spaces"),
                             "existingSecret": string(), "existingSecretKey": SECRET_KEY}),
                "tls": BOOL,
                "serviceMonitor": obj({"enabled": BOOL, "interval": DURATION, "scrapeTimeout": DURATION,
                                       "labels": LABELS, "tlsConfig": ANY_OBJECT}),
                "prometheusRule": obj({"enabled": BOOL, "labels": LABELS,
                                       "matchLatencyP99Seconds": number(positive=True),
                                       "hitRateBelow": number(0, 1)}),
                "grafanaDashboard": obj({"enabled": BOOL, "labels": LABELS})},
                required=("enabled", "port", "auth", "serviceMonitor", "prometheusRule", "grafanaDashboard")),
            "redis": obj({
                "enabled": BOOL,
                "image": obj({"repository": string(minLength=1), "tag": string(minLength=1),
                              "pullPolicy": PULL_POLICY}, required=("repository", "tag")),
                "port": integer(1, 55535),  # the Cluster bus listens on port + 10000
                "cluster": obj({"enabled": BOOL, "masters": integer(3)}, required=("enabled", "masters")),
                "auth": obj({"enabled": BOOL,
                             "password": string(pattern=r"^[A-Za-z0-9._~-]*$",
                                                description="URL-safe characters only (it goes into the storage URL)"),
                             "existingSecret": string(), "existingSecretKey": SECRET_KEY}, required=("enabled",)),
                "maxmemory": string(pattern=r"^[0-9]+(b|k|kb|m|mb|g|gb)?$"),
                "maxmemoryPolicy": enum(["allkeys-lru", "allkeys-lfu", "allkeys-random", "volatile-lru",
                                         "volatile-lfu", "volatile-random", "volatile-ttl", "noeviction"]),
                "persistence": obj({"enabled": BOOL, "size": QUANTITY, "storageClass": string()},
                                   required=("enabled", "size")),
                "resources": RESOURCES, "nodeSelector": LABELS, "tolerations": ANY_LIST, "affinity": ANY_OBJECT,
                "pdb": obj({"enabled": BOOL, "maxUnavailable": BUDGET}, required=("maxUnavailable",))},
                required=("image", "port", "cluster", "auth", "persistence", "pdb")),
            "externalStorage": obj({"url": string(pattern=r"^$|^[a-z][a-z0-9+.-]*://"), "existingSecret": string(),
                                    "existingSecretKey": SECRET_KEY}),
            "podSecurityContext": ANY_OBJECT,
            "securityContext": ANY_OBJECT,
        },
        # what the templates read without a default: a key removed (null) is named here, not a template error
        "required": ["image", "serviceAccount", "config", "auth", "tls", "node", "router", "metrics", "redis",
                     "externalStorage"],
    }


def render() -> str:
    return json.dumps(values_schema(), indent=2) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check", action="store_true", help="compare with the committed file instead of writing it")
    args = p.parse_args(argv)
    text = render()
    if args.check:
        if SCHEMA_PATH.read_text() != text:
            print(f"{SCHEMA_PATH} is out of date: run python {Path(__file__).name}", file=sys.stderr)
            return 1
        return 0
    SCHEMA_PATH.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
