"""The catalogue of every Prometheus metric hicache exports, read off the real metric objects.

A node's ``/metrics`` carries the cache's metrics (:class:`hicache.metrics.Metrics`) and the service's
(:class:`hicache.service.metrics_http.ServiceMetrics`); a router's carries
:class:`hicache.router.server.RouterMetrics`; an SGLang / vLLM process using hicache's store carries the L3
counters of :mod:`hicache.integrations.store`. :func:`catalog` builds each of them on a fresh registry and
lists what they define, so the reference in ``docs/metrics.md`` (:func:`markdown_table`, written by
``scripts/gen_metrics_doc.py``) and the names that alert rules and dashboards may use (:func:`series_names`)
come from the code itself; tests compare them with the committed files.
"""

from __future__ import annotations

from typing import NamedTuple

from prometheus_client import CollectorRegistry
from prometheus_client.metrics import MetricWrapperBase

# exposed sample suffixes per metric type (prometheus_client's text format, without ``_created``)
SUFFIXES = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count")}


class MetricInfo(NamedTuple):
    """One metric family: where it is exported, its name (without ``_total``), type, labels and help."""

    component: str  # "node", "router" or "engine" (an SGLang / vLLM process using hicache's store)
    name: str
    type: str  # counter | gauge | histogram
    labels: tuple[str, ...]
    help: str

    @property
    def series(self) -> tuple[str, ...]:
        """The sample names a scrape shows for it."""
        return tuple(self.name + s for s in SUFFIXES[self.type])


def _families(*owners: object) -> list[tuple[str, str, tuple[str, ...], str]]:
    out = []
    for owner in owners:
        for attr in vars(owner).values():
            for v in attr.values() if isinstance(attr, dict) else (attr,):
                # prometheus_client keeps these as attributes of the metric object only; a labelled
                # child (``labels(...)`` bound once for the hot path) has label values and is skipped
                if isinstance(v, MetricWrapperBase) and not v._labelvalues:
                    out.append((v._name, str(v._type), tuple(v._labelnames), v._documentation))
    return out


def catalog() -> list[MetricInfo]:
    """Every metric of a node, a router and an engine's store, sorted by component then name."""
    from hicache.config import load_config
    from hicache.integrations.store import _Counters
    from hicache.metrics import Metrics
    from hicache.router.config import RouterConfig
    from hicache.router.core import Router
    from hicache.router.server import RouterMetrics
    from hicache.service.metrics_http import ServiceMetrics

    cache = Metrics()
    service = ServiceMetrics(cache.registry)
    router = RouterMetrics(Router(load_config(overrides={"cache": {"device": "cpu"}}), RouterConfig()),
                           CollectorRegistry())
    rows = [MetricInfo("node", *f) for f in _families(cache, service)]
    rows += [MetricInfo("router", *f) for f in _families(router)]
    rows += [MetricInfo("engine", *f) for f in _families(_Counters(CollectorRegistry()))]
    names = [(r.component, r.name) for r in rows]
    dup = {n for n in names if names.count(n) > 1}
    if dup:
        raise AssertionError(f"metrics defined twice: {sorted(dup)}")
    return sorted(rows, key=lambda r: (r.component, r.name))


def series_names() -> set[str]:
    """Every sample name a node or router scrape can show."""
    return {s for m in catalog() for s in m.series}


def markdown_table() -> str:
    """The reference table of ``docs/metrics.md`` (between its ``generated`` markers)."""
    lines = ["| metric | type | labels | component | what |", "|---|---|---|---|---|"]
    for m in catalog():
        name = m.series[0] if m.type == "counter" else m.name
        labels = ", ".join(f"`{x}`" for x in m.labels) or "-"
        lines.append(f"| `{name}` | {m.type} | {labels} | {m.component} | {m.help} |")
    return "\n".join(lines) + "\n"
