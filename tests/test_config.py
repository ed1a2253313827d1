"""Configuration: YAML < environment < overrides; bad values name the field."""

from __future__ import annotations

from pathlib import Path

import pytest

from hicache.config import ConfigError, load_config


def test_defaults_validate() -> None:
    cfg = load_config(env={})
    assert cfg.cache.write_policy == "write_through_selective"
    assert cfg.layout.page_size == 64
    assert cfg.storage.prefetch_timeout(1000) == pytest.approx(2.1)
    assert cfg.storage.prefetch_timeout(10**7) == 30.0


def test_yaml_env_and_overrides(tmp_path: Path) -> None:
    f = tmp_path / "c.yaml"
    f.write_text("cache:\n  l1_tokens: 4096\n  write_policy: write_back\nlayout:\n  page_size: 16\n")
    env = {"HICACHE_CACHE__L2_TOKENS": "8192", "HICACHE_STORAGE__URL": "memory://", "OTHER": "x"}
    cfg = load_config(f, env=env, overrides={"model": {"name": "llama"}})
    assert (cfg.cache.l1_tokens, cfg.cache.l2_tokens, cfg.cache.write_policy) == (4096, 8192, "write_back")
    assert cfg.storage.url == "memory://" and cfg.model.name == "llama" and cfg.l1_pages == 256


@pytest.mark.parametrize(
    "data,field",
    [
        ({"cache": {"write_policy": "sometimes"}}, "cache.write_policy"),
        ({"cache": {"l1_tokens": 0}}, "cache.l1_tokens"),
        ({"cache": {"eviction_policy": "random"}}, "cache.eviction_policy"),
        ({"layout": {"dtype": "float64"}}, "layout.dtype"),
        ({"layout": {"attention": "mla", "num_kv_heads": 8}}, "layout.num_kv_heads"),
        ({"storage": {"prefetch_policy": "never"}}, "storage.prefetch_policy"),
        ({"model": {"tp_rank": 3, "tp_size": 2}}, "model.tp_rank"),
        ({"serve": {"port": 70000}}, "serve.port"),
        ({"cache": {"l1_tokens": "many"}}, "cache.l1_tokens"),
        ({"cache": {"unknown_knob": 1}}, "cache.unknown_knob"),
        ({"caches": {}}, "caches"),
        ({"cache": {"transfer_options": {"stagger": 2}}}, "cache.transfer_options"),
        ({"cache": {"transfer_options": {"stagger_ways": 0}}}, "cache.transfer_options.stagger_ways"),
        ({"cache": {"transfer_options": {"backup_streams": 0}}}, "cache.transfer_options.backup_streams"),
        ({"cache": {"transfer_options": {"load_head_layers": -1}}}, "cache.transfer_options.load_head_layers"),
        ({"cache": {"transfer_options": {"staging_bytes": "64M"}}}, "cache.transfer_options.staging_bytes"),
        ({"cache": {"transfer_options": {"layer_signal": "polling"}}}, "cache.transfer_options.layer_signal"),
        ({"cache": {"transfer_options": [1]}}, "cache.transfer_options"),
        ({"cache": {"host_layout": "block"}}, "cache.host_layout"),
        ({"serve": {"tls_client_ca": "/ca.pem"}}, "serve.tls_client_ca"),
        ({"serve": {"shutdown_grace_s": -5}}, "serve.shutdown_grace_s"),
        ({"cache": {"host_block_pages": -1}}, "cache.host_block_pages"),
    ],
)
def test_bad_values_name_the_field(data: dict, field: str) -> None:
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        load_config(env={}, overrides=data)


def test_transfer_options_from_yaml_and_env(tmp_path: Path) -> None:
    f = tmp_path / "c.yaml"
    f.write_text("cache:\n  transfer_options: {stagger_ways: 2, layer_signal: events}\n")
    assert load_config(f, env={}).cache.transfer_options == {"stagger_ways": 2, "layer_signal": "events"}
    env = {"HICACHE_CACHE__TRANSFER_OPTIONS": "{ce_min_copy_bytes: 32768}"}
    assert load_config(f, env=env).cache.transfer_options == {"ce_min_copy_bytes": 32768}


def test_bad_env_value_names_the_field() -> None:
    with pytest.raises(ConfigError, match=r"cache\.l1_tokens"):
        load_config(env={"HICACHE_CACHE__L1_TOKENS": "lots"})


def test_bad_yaml_file(tmp_path: Path) -> None:
    f = tmp_path / "c.yaml"
    f.write_text("cache: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(f, env={})
    with pytest.raises(ConfigError, match=r"missing\.yaml"):
        load_config(tmp_path / "missing.yaml", env={})
