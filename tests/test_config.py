"""Configuration: YAML < environment < overrides; bad values name the field."""

from __future__ import annotations

from pathlib import Path

import pytest

from hicache.config import ConfigError, load_config


def test_defaults_validate() -> None:
    cfg = load_config(env={})
    assert cfg.cache.write_policy == "write_through"
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


@pytest.mark.parametrize(("env", "start"), [
    ({"HICACHE_CACHE__L1_TOKENS": "abc"}, "HICACHE_CACHE__L1_TOKENS=abc: cache.l1_tokens: must be an integer"),
    ({"HICACHE_CACHE__L1_TOKENS": "0"}, "HICACHE_CACHE__L1_TOKENS=0: cache.l1_tokens: must be >= 1"),
    ({"HICACHE_CACHE__L1_TOKENS": "10"}, "HICACHE_CACHE__L1_TOKENS=10: cache.l1_tokens: must be >= layout.page_size"),
    ({"HICACHE_SERVE__PORT": "70000"}, "HICACHE_SERVE__PORT=70000: serve.port: must be in [0, 65535]"),
    ({"HICACHE_SERVE__SHARED_POOL": "maybe"}, "HICACHE_SERVE__SHARED_POOL=maybe: serve.shared_pool"),
    ({"HICACHE_CACHE__BOGUS": "1"}, "HICACHE_CACHE__BOGUS=1: cache.bogus: unknown field"),
    ({"HICACHE_CACHEX__L1_TOKENS": "1"}, "HICACHE_CACHEX__L1_TOKENS=1: cachex: unknown section"),
    ({"HICACHE_CACHE__TRANSFER_OPTIONS": "[1"}, "HICACHE_CACHE__TRANSFER_OPTIONS=[1: cache.transfer_options: "
                                                "must be a mapping"),
    ({"HICACHE_CACHE__TRANSFER_OPTIONS": "{blocks: 0}"},
     "HICACHE_CACHE__TRANSFER_OPTIONS={blocks: 0}: cache.transfer_options.blocks: must be an integer >= 1"),
])
def test_bad_env_value_names_the_variable(env: dict[str, str], start: str) -> None:
    """The operator has to fix the variable, so the message starts with it (and still names the field)."""
    with pytest.raises(ConfigError) as e:
        load_config(env={"HICACHE_CACHE__L2_TOKENS": "4096", **env})
    assert str(e.value).startswith(start), str(e.value)
    assert "\n" not in str(e.value)


def test_env_is_blamed_only_for_what_it_set(tmp_path: Path) -> None:
    # a flag (explicit override) replaces the bad variable: nothing to complain about
    assert load_config(env={"HICACHE_CACHE__L1_TOKENS": "abc"}, overrides={"cache": {"l1_tokens": 4096}})
    # a bad flag beside a good variable of the same section: the field only
    with pytest.raises(ConfigError) as e:
        load_config(env={"HICACHE_CACHE__L2_TOKENS": "4096"}, overrides={"cache": {"l1_tokens": 0}})
    assert str(e.value).startswith("cache.l1_tokens: must be >= 1")
    # a bad file value that no variable touches
    f = tmp_path / "c.yaml"
    f.write_text("cache: {l1_tokens: 0}\n")
    with pytest.raises(ConfigError) as e:
        load_config(f, env={"HICACHE_CACHE__L2_TOKENS": "4096"})
    assert str(e.value).startswith("cache.l1_tokens:")
    # an unknown section the file names too is the file's
    f.write_text("cachex: {a: 1}\n")
    with pytest.raises(ConfigError) as e:
        load_config(f, env={"HICACHE_CACHEX__A": "1"})
    assert str(e.value).startswith("cachex: unknown section")


def test_env_errors_stay_one_line_and_hide_tokens() -> None:
    with pytest.raises(ConfigError) as e:
        load_config(env={"HICACHE_CACHE__WRITE_POLICY": "write_back\nrm -rf /"})
    assert str(e.value).startswith("HICACHE_CACHE__WRITE_POLICY='write_back\\nrm -rf /': cache.write_policy")
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError) as e:  # a bearer token in a misspelt section is still not printed
        load_config(env={"HICACHE_SERVER__AUTH_TOKEN": "s3cret"})
    assert str(e.value).startswith("HICACHE_SERVER__AUTH_TOKEN=<hidden>: server: unknown section")
    assert "s3cret" not in str(e.value)


@pytest.mark.parametrize("env", [
    {"HICACHE_STORAGE__URI": "redis://:hunter2@cache:6379"},  # a misspelt field: the URL is still shown
    {"HICACHE_STORAGES__URL": "redis://user:hunter2@cache:6379/0"},  # a misspelt section
    {"HICACHE_SERVE__AUTHTOKEN": "hunter2"},  # a misspelt token field
    {"HICACHE_STORAGE__OPTIONS": "{sentinel_password: hunter2, ttl_s: [}"},  # not valid YAML
    {"HICACHE_STORAGE__OPTIONS": "sentinel_password=hunter2"},  # not a mapping
])
def test_env_errors_never_repeat_a_credential(env: dict[str, str]) -> None:
    with pytest.raises(ConfigError) as e:
        load_config(env=env)
    assert str(e.value).startswith(next(iter(env)) + "="), str(e.value)
    assert "hunter2" not in str(e.value), str(e.value)
