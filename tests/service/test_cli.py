"""``hicache serve`` flags override the config file, which overrides nothing it does not name."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

from hicache.cli import build_parser
from hicache.config import ConfigError, load_config
from hicache.service.cli import overrides_from_args, run


def test_flags_override_the_file(tmp_path: Path) -> None:
    path = tmp_path / "node.yaml"
    path.write_text(yaml.safe_dump({"serve": {"port": 6000, "max_concurrency": 8, "auth_token": "from-file"},
                                    "cache": {"l1_tokens": 8192}}))
    args = build_parser("serve").parse_args(["serve", "--config", str(path), "--port", "7000",
                                             "--no-shared-pool", "--storage-url", "memory://", "--l2-tokens", "0",
                                             "--compression", "zstd"])
    cfg = load_config(args.config, env={}, overrides=overrides_from_args(args))
    assert cfg.serve.port == 7000 and cfg.serve.shared_pool is False
    assert cfg.serve.max_concurrency == 8 and cfg.serve.auth_token == "from-file"  # from the file
    assert cfg.cache.l1_tokens == 8192 and cfg.cache.l2_tokens == 0 and cfg.storage.url == "memory://"
    assert cfg.storage.compression == "zstd"


def test_bad_values_are_config_errors(tmp_path: Path) -> None:
    args = build_parser("serve").parse_args(["serve", "--port", "70000"])
    with pytest.raises(ConfigError, match=r"serve\.port"):
        run(args)
    args = build_parser("serve").parse_args(["serve", "--request-ttl-s", "0"])
    with pytest.raises(ConfigError, match="request-ttl-s"):
        run(args)
    args = build_parser("serve").parse_args(["serve", "--compression", "gzip"])
    with pytest.raises(ConfigError, match=r"storage\.compression"):
        run(args)


@pytest.mark.parametrize("preset", [None, "1"])
def test_cli_widens_cuda_hardware_queues_unless_set(preset: str | None, monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """``hicache`` asks for 32 hardware queues and 4x command buffers before CUDA starts (the staged
    path's lanes and its many queued copies need them), and leaves values the environment gives alone."""
    from hicache.cli import main

    for var, value in (("CUDA_DEVICE_MAX_CONNECTIONS", preset), ("CUDA_SCALE_LAUNCH_QUEUES", preset and "2x")):
        if value is None:
            monkeypatch.delenv(var, raising=False)
        else:
            monkeypatch.setenv(var, value)
    assert main([]) == 0
    assert "serve" in capsys.readouterr().out
    import os

    assert os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] == (preset or "32")
    assert os.environ["CUDA_SCALE_LAUNCH_QUEUES"] == ("2x" if preset else "4x")


def test_l2_larger_than_the_host_is_one_line_naming_l2_tokens(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    """An L2 the host cannot hold stops ``hicache serve`` at start with one line naming cache.l2_tokens and
    the bytes, exit code 2. The pool asks for a pebibyte (64 MiB pages), which no machine has; it is refused
    before anything is allocated for it (the L1 here is one 64 MiB page)."""
    from hicache.cli import main

    for k in [k for k in os.environ if k.startswith("HICACHE_")]:
        monkeypatch.delenv(k)
    layout = {"num_layers": 64, "num_kv_heads": 8, "head_dim": 256, "dtype": "bfloat16", "page_size": 128}
    page_bytes = 64 * 2 * 128 * 8 * 256 * 2
    assert page_bytes == 64 << 20
    l2_tokens = 128 << 24  # 2**24 pages: 1 PiB
    path = tmp_path / "node.yaml"
    path.write_text(yaml.safe_dump({"layout": layout, "cache": {"l1_tokens": 128, "l2_tokens": l2_tokens},
                                    "serve": {"port": 0, "metrics_port": 0, "shared_pool": False}}))
    assert main(["serve", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith(f"hicache serve: config: cache.l2_tokens: {l2_tokens} tokens"), err
    assert f"{page_bytes << 24} bytes" in err and "set a smaller cache.l2_tokens" in err, err
