"""Router configuration: node lists, the router section next to the nodes' sections, env overrides."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from hicache.cli import build_parser
from hicache.config import ConfigError
from hicache.router.cli import overrides_from_args
from hicache.router.config import NodeSpec, load_router_config, parse_node


def test_parse_node() -> None:
    assert parse_node("gpu0=10.0.0.1:50051") == NodeSpec("gpu0", "10.0.0.1:50051")
    assert parse_node("10.0.0.2:50051") == NodeSpec("10.0.0.2:50051", "10.0.0.2:50051")
    for bad in ("gpu0=10.0.0.1", "gpu0=:50051", "a b=h:1", "x=h:99999"):
        with pytest.raises(ConfigError, match=r"router\.nodes"):
            parse_node(bad)


def test_node_config_file_plus_router_section(tmp_path: Path) -> None:
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump({
        "model": {"name": "llama", "revision": "abc"},
        "layout": {"num_layers": 2, "num_kv_heads": 1, "head_dim": 8, "dtype": "float16", "page_size": 16},
        "cache": {"l1_tokens": 4096}, "serve": {"port": 50051},
        "router": {"port": 0, "nodes": {"g0": "h0:1", "g1": "h1:2"}, "policy": "least_load"},
    }))
    cfg, rc = load_router_config(path, env={"HICACHE_ROUTER__LOAD_WEIGHT": "0.25"})
    assert cfg.namespace().model == "llama" and cfg.layout.page_size == 16
    assert rc.nodes == [NodeSpec("g0", "h0:1"), NodeSpec("g1", "h1:2")]
    assert rc.policy == "least_load" and rc.load_weight == 0.25
    _, rc2 = load_router_config(path, env={"HICACHE_ROUTER__NODES": "a=h:1,b=h:2"},
                                overrides={"router": {"policy": "cache_aware"}})
    assert [n.name for n in rc2.nodes] == ["a", "b"] and rc2.policy == "cache_aware"


@pytest.mark.parametrize("router,match", [
    ({"policy": "random"}, "router.policy"),
    ({"nodes": ["a=h:1", "a=h:2"]}, "unique"),
    ({"bogus": 1}, "router.bogus: unknown field"),
    ({"load_weight": -1}, "load_weight"),
    ({"route_ttl_s": 0}, "route_ttl_s"),
    ({"port": "x"}, "router.port"),
])
def test_bad_values_name_the_field(tmp_path: Path, router: dict[str, object], match: str) -> None:
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump({"router": router}))
    with pytest.raises(ConfigError, match=match):
        load_router_config(path, env={})


def test_cli_flags() -> None:
    args = build_parser("route").parse_args(["route", "--node", "a=h:1", "--node", "b=h:2", "--policy",
                                             "round_robin", "--port", "0"])
    ov = overrides_from_args(args)
    assert ov["router"] == {"nodes": ["a=h:1", "b=h:2"], "policy": "round_robin", "port": 0}
    _, rc = load_router_config(None, env={}, overrides=ov)
    assert [n.address for n in rc.nodes] == ["h:1", "h:2"]


def test_node_addresses_are_checked_like_status_targets() -> None:
    """Node addresses follow hicache.client.address: the rules ``hicache status`` applies to its target."""
    assert parse_node("a=grpc://h:1") == NodeSpec("a", "h:1")  # the scheme status accepts, dropped
    assert parse_node("a=[::1]:50051") == NodeSpec("a", "[::1]:50051")
    assert parse_node("[::1]:50051") == NodeSpec("[::1]:50051", "[::1]:50051")  # bare: its own name
    assert parse_node(" a = h:1 ") == NodeSpec("a", "h:1")
    for bad, why in [("", "empty"), ("a=", "empty"), ("a=h:0", "port 0 is out of range"),
                     ("a=h:65536", "port 65536 is out of range"), ("a=h:\u0661", "is not a number"),
                     ("a=http://h:1", "http:// is not an address scheme"), ("a=::1:5", "needs brackets"),
                     ("a=[zz]:5", "not an IPv6 address"), ("a=h h:1", "not a host name"),
                     ("a=h:1:", "empty port")]:
        with pytest.raises(ConfigError, match=r"router\.nodes: ") as e:
            parse_node(bad)
        assert why in str(e.value), (bad, str(e.value))


def test_one_node_twice_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump({"router": {"nodes": ["a=h:1", "b=H:1"]}}))  # one address, two names
    with pytest.raises(ConfigError, match=r"router\.nodes: H:1 is listed twice \(as 'a' and 'b'\)"):
        load_router_config(path, env={})
    with pytest.raises(ConfigError, match=r"listed twice"):
        load_router_config(None, env={}, overrides={"router": {"nodes": ["h:1", "x=h:1"]}})


def test_bad_router_env_names_the_variable() -> None:
    with pytest.raises(ConfigError) as e:
        load_router_config(None, env={"HICACHE_ROUTER__NODES": "a=h:1,b=h:1"})
    assert str(e.value).startswith("HICACHE_ROUTER__NODES=a=h:1,b=h:1: router.nodes: h:1 is listed twice")
    with pytest.raises(ConfigError) as e:
        load_router_config(None, env={"HICACHE_ROUTER__PORT": "x"})
    assert str(e.value).startswith("HICACHE_ROUTER__PORT=x: router.port: must be an integer")
    with pytest.raises(ConfigError) as e:
        load_router_config(None, env={"HICACHE_LAYOUT__PAGE_SIZE": "0"})
    assert str(e.value).startswith("HICACHE_LAYOUT__PAGE_SIZE=0: layout.page_size")
