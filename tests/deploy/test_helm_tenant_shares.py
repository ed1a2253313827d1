"""``config.cache.tenant_shares`` through the Helm chart: values.schema.json accepts what hicache accepts
(tenant names YAML would read as something else included: ``*``, ``""``, ``yes``, ``null``, ``1.0``)
and the ConfigMap hands the node exactly those shares; it rejects, naming the key, what hicache would
refuse (a share outside (0, 1], not a number, shares not given as a mapping), and tenant names Helm's
``toYaml`` cannot write (DEL, C1 controls, U+FFFE, U+FFFF: it would render an empty hicache.yaml, and
the node would start on the defaults)."""

from __future__ import annotations

import re
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

helm = pytest.importorskip("helm_python")

from helm_render import CHART, render  # noqa: E402

from hicache.config import config_from_dict  # noqa: E402

OLDEST_KUBE = "1.27.0"
AWKWARD = ["*", "", "yes", "no", "on", "null", "~", "1.0", "0x1F", "a: b", "#x", "batch-jobs", "&anchor", "é", " ",
           "a\tb", "\x01", "\ufeff", "\U0001f600"]
UNWRITABLE = re.compile("[\x7f-\x9f\ufffe\uffff]")  # what toYaml cannot write in a key
share_st = st.one_of(st.sampled_from([1, 1.0, 0.5, 0.001, 0.29]),
                     st.floats(0, 1, exclude_min=True).map(lambda f: round(f, 4)).filter(lambda f: f > 0))
shares_st = st.dictionaries(st.one_of(st.sampled_from(AWKWARD), st.text(min_size=0, max_size=12)), share_st,
                            max_size=5)


def rendered_shares(shares: dict[str, Any]) -> dict[str, float]:
    r = render({"config": {"cache": {"tenant_shares": shares}}})
    return config_from_dict(r.config_data()).cache.tenant_shares


def test_lint_is_clean_with_tenant_shares() -> None:
    values = {"config": {"cache": {"tenant_shares": {"batch-jobs": 0.2, "*": 0.5, "": 0.25, "yes": 1}}}}
    report = helm.lint(CHART, values, strict=True, kube_version=f"v{OLDEST_KUBE}")
    assert report["errors"] == []
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


@settings(max_examples=15, deadline=None)
@given(shares=shares_st)
def test_the_node_gets_the_shares_the_values_give(shares: dict[str, Any]) -> None:
    bad = [t for t in shares if UNWRITABLE.search(t)]
    if bad:
        with pytest.raises(helm.HelmValuesError, match="tenant_shares': additional properties"):
            rendered_shares(shares)
    else:
        assert rendered_shares(shares) == shares


@pytest.mark.parametrize("tenant", ["a\x7fb", "\x85", "\x9f", "x\ufffe", "\uffff"])
def test_tenant_names_toyaml_cannot_write_are_refused(tenant: str) -> None:
    with pytest.raises(helm.HelmValuesError, match="at '/config/cache/tenant_shares': additional properties"):
        rendered_shares({tenant: 0.5, "ok": 0.5})


def test_the_default_is_no_shares() -> None:
    assert rendered_shares({}) == {}
    assert config_from_dict(render().config_data()).cache.tenant_shares == {}


BAD = [
    ({"a": 0}, "tenant_shares/a"),
    ({"a": -0.5}, "tenant_shares/a"),
    ({"a": 1.01}, "tenant_shares/a"),
    ({"a": "half"}, "tenant_shares/a"),
    ({"a": "0.5"}, "tenant_shares/a"),
    ({"*": True}, "tenant_shares/\\*"),
    ({"a": None}, "tenant_shares/a"),
    ({"a": [0.5]}, "tenant_shares/a"),
    ({"a": {"b": 0.5}}, "tenant_shares/a"),
    (["a"], "tenant_shares"),
    ("a=0.5", "tenant_shares"),
    (0.5, "tenant_shares"),
]


@pytest.mark.parametrize(("shares", "where"), BAD, ids=[repr(s) for s, _ in BAD])
def test_schema_rejects_bad_shares(shares: Any, where: str) -> None:
    with pytest.raises(helm.HelmValuesError, match=where):
        render({"config": {"cache": {"tenant_shares": shares}}})


@pytest.mark.parametrize("where", [{"model": {"name": "a\x7fb"}}, {"storage": {"options": {"prefix": "p\x7f"}}},
                                   {"model": {"tenant": "\uffff"}}])
def test_a_config_string_toyaml_cannot_write_fails_the_render(where: dict[str, Any]) -> None:
    """Anywhere in ``config`` (not only tenant names): the render fails, naming why, instead of handing the
    node an empty hicache.yaml (it would start on the defaults)."""
    with pytest.raises(helm.HelmRenderError, match="Helm cannot write it as YAML"):
        render({"config": where})
