"""Renders the Helm chart with Helm's own Go library (helm-python-sdk, no helm binary) and reads the result.

``render(values)`` returns a :class:`Rendered`: every manifest as a dict (parsed with a YAML loader that
rejects duplicate keys, which Kubernetes would reject too), plus lookups the tests share. The container
environment of a workload can be resolved like the kubelet does (Secret references from the rendered
Secret, ``$(VAR)`` expansion) with :func:`container_env`.
"""

from __future__ import annotations

import base64
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "deploy" / "helm" / "hicache"
RELEASE = "rel"
NAMESPACE = "ml"


class UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that fails on a key repeated within one mapping."""


def _unique_mapping(loader: UniqueKeyLoader, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
    seen: set[Any] = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)  # type: ignore[no-untyped-call]
        if key in seen:
            raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", key_node.start_mark)
        seen.add(key)
    return loader.construct_mapping(node, deep=deep)


UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _unique_mapping)


def load_docs(text: str) -> list[dict[str, Any]]:
    return [d for d in yaml.load_all(text, Loader=UniqueKeyLoader) if d]


@dataclass
class Rendered:
    texts: dict[str, str]  # template path -> rendered text (NOTES.txt included)
    docs: list[dict[str, Any]]  # every manifest, in template order

    @property
    def notes(self) -> str:
        return next(t for p, t in self.texts.items() if p.endswith("NOTES.txt"))

    def kinds(self, kind: str) -> list[dict[str, Any]]:
        return [d for d in self.docs if d["kind"] == kind]

    def get(self, kind: str, name: str) -> dict[str, Any]:
        found = [d for d in self.kinds(kind) if d["metadata"]["name"] == name]
        assert len(found) == 1, f"{kind}/{name}: found {len(found)} in {[d['metadata']['name'] for d in self.docs]}"
        return found[0]

    def component(self, component: str) -> dict[str, Any]:
        """The workload (DaemonSet/StatefulSet/Deployment) of one component (node, router, redis)."""
        found = [d for d in self.docs if d["kind"] in ("DaemonSet", "StatefulSet", "Deployment")
                 and d["metadata"]["labels"].get("app.kubernetes.io/component") == component]
        assert len(found) == 1, f"component {component}: {len(found)} workloads"
        return found[0]

    def secret_data(self) -> dict[str, str]:
        """Decoded data of every Secret the chart renders, by key."""
        out: dict[str, str] = {}
        for s in self.kinds("Secret"):
            for k, v in (s.get("data") or {}).items():
                out[k] = base64.b64decode(v).decode()
        return out

    def config_map(self) -> dict[str, Any]:
        """The ConfigMap with hicache's config (the dashboard's, when enabled, is another)."""
        (cm,) = [c for c in self.kinds("ConfigMap") if "hicache.yaml" in c.get("data", {})]
        return cm

    def config_text(self) -> str:
        return str(self.config_map()["data"]["hicache.yaml"])

    def config_data(self) -> dict[str, Any]:
        data = yaml.safe_load(self.config_text())
        assert isinstance(data, dict)
        return data


def render(values: dict[str, Any] | None = None, *, name: str = RELEASE, namespace: str = NAMESPACE) -> Rendered:
    import helm_python as helm

    with helm.Chart.load(CHART) as chart:
        texts = chart.render(values, name=name, namespace=namespace, is_install=True)
    docs: list[dict[str, Any]] = []
    for path, text in texts.items():
        if path.endswith("NOTES.txt"):
            continue
        docs.extend(load_docs(text))
    return Rendered(texts, docs)


def pod_spec(workload: dict[str, Any]) -> dict[str, Any]:
    spec: dict[str, Any] = workload["spec"]["template"]["spec"]
    return spec


def container(workload: dict[str, Any], name: str | None = None) -> dict[str, Any]:
    cs = pod_spec(workload)["containers"]
    if name is None:
        assert len(cs) == 1
        return dict(cs[0])
    return dict(next(c for c in cs if c["name"] == name))


_VAR = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def container_env(r: Rendered, c: dict[str, Any], external: dict[tuple[str, str], str] | None = None) -> dict[str, str]:
    """The container's environment as the kubelet builds it: secretKeyRef values from the rendered Secret
    (or ``external[(secret, key)]`` for Secrets the chart does not own), then ``$(VAR)`` expanded from
    variables defined earlier in the list. fieldRef variables become ``<fieldPath>``."""
    secrets = {(s["metadata"]["name"], k): base64.b64decode(v).decode()
               for s in r.kinds("Secret") for k, v in (s.get("data") or {}).items()}
    secrets.update(external or {})
    env: dict[str, str] = {}
    for e in c.get("env", []):
        if "value" in e:
            env[e["name"]] = _VAR.sub(lambda m: env.get(m.group(1), m.group(0)), str(e["value"]))
        elif "secretKeyRef" in e.get("valueFrom", {}):
            ref = e["valueFrom"]["secretKeyRef"]
            env[e["name"]] = secrets[(ref["name"], ref["key"])]
        elif "fieldRef" in e.get("valueFrom", {}):
            env[e["name"]] = f"<{e['valueFrom']['fieldRef']['fieldPath']}>"
    return env
