"""``hicache serve`` with no config starts on an ordinary machine, fast: tiers it is not given are sized from
the memory there is (one line says what and why), every tier is checked against the machine before any is
allocated (one line naming the knob and the largest value that fits), building a pool touches none of its
memory, and the ``listening`` line says how long the start took."""

from __future__ import annotations

import gc
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cli_procs import REPO, cli_env

import hicache.pool as pool_mod
from hicache.config import ConfigError, HiCacheConfig, load_config
from hicache.layout import KVLayout
from hicache.pool import DevicePool, HostPool, lazy_host_bytes
from hicache.service.preflight import check_memory, size_tiers
from hicache.service.shared_pool import SharedPool

GiB = 1 << 30
PAGE = 8 << 20  # a page of the default layout (32 layers, 8 KV heads of 128, bfloat16, 64 tokens)
NOTHING_SET: set[str] = set()


def cfg(**cache: object) -> HiCacheConfig:
    return load_config(env={}, overrides={"cache": dict(cache)} if cache else None)


# ---------------------------------------------------------------------------------------------- sizing


def test_a_laptop_gets_tiers_that_fit_and_one_line_saying_why() -> None:
    """24 GiB available: L1 (CPU) the largest power of two of pages within 1/8 of it, L2 within half of it
    beside L1; the line names both fields, the sizes, what was available and the rule."""
    s = size_tiers(cfg(), NOTHING_SET, available=24 * GiB)
    assert (s.config.cache.l1_tokens, s.config.cache.l2_tokens) == (256 * 64, 1024 * 64)  # 2 + 8 GiB
    assert "\n" not in s.line and s.line.startswith("hicache serve: cache.l1_tokens and cache.l2_tokens not set:")
    for part in ("L1 16384 tokens (2.0 GiB, cpu)", "L2 65536 tokens (8.0 GiB)", "24.0 GiB of host memory available",
                 "1/8", "1/2", "65536 / 262144"):
        assert part in s.line, (part, s.line)
    check_memory(s.config, available=24 * GiB, shm_free=24 * GiB)  # what was chosen fits


def test_a_large_host_keeps_the_defaults_and_given_sizes_are_kept() -> None:
    s = size_tiers(cfg(), NOTHING_SET, available=512 * GiB)
    assert (s.config.cache.l1_tokens, s.config.cache.l2_tokens) == (65536, 262144)
    s = size_tiers(cfg(l1_tokens=4096), {"cache.l1_tokens"}, available=24 * GiB)
    assert s.config.cache.l1_tokens == 4096 and s.config.cache.l2_tokens == 1024 * 64
    assert s.line.startswith("hicache serve: cache.l2_tokens not set: L2 65536 tokens") and "L1 4096" not in s.line
    both = {"cache.l1_tokens", "cache.l2_tokens"}
    s = size_tiers(cfg(l1_tokens=4096, l2_tokens=0), both, available=1 * GiB)
    assert s.line == "" and (s.config.cache.l1_tokens, s.config.cache.l2_tokens) == (4096, 0)


def test_an_l1_on_a_gpu_keeps_its_default_and_l2_takes_the_half() -> None:
    s = size_tiers(cfg(device="cuda"), NOTHING_SET, available=24 * GiB)
    assert s.config.cache.l1_tokens == 65536 and s.config.cache.l2_tokens == 1024 * 64
    assert "cuda" in s.line


def test_the_files_environment_and_flags_all_count_as_setting_a_size(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from hicache.service.cli import given_fields

    for k in [k for k in os.environ if k.startswith("HICACHE_")]:
        monkeypatch.delenv(k)
    path = tmp_path / "node.yaml"
    path.write_text("cache: {l1_tokens: 4096}\n")
    monkeypatch.setenv("HICACHE_CACHE__L2_TOKENS", "0")
    assert {"cache.l1_tokens", "cache.l2_tokens"} <= given_fields(str(path), {})
    monkeypatch.delenv("HICACHE_CACHE__L2_TOKENS")
    assert "cache.l2_tokens" in given_fields(None, {"cache": {"l2_tokens": 0}})
    assert not {"cache.l1_tokens", "cache.l2_tokens"} & given_fields(None, {"serve": {"port": 0}})


# ---------------------------------------------------------------------------------------------- refusals


def fit_of(e: pytest.ExceptionInfo[ConfigError]) -> int:
    m = re.search(r"at most (\d+)", str(e.value))
    assert m is not None, str(e.value)
    return int(m.group(1))


AVAIL = 20 * GiB + 3 * PAGE


def test_an_l1_too_large_is_refused_naming_the_largest_value_that_fits() -> None:
    with pytest.raises(ConfigError) as e:
        check_memory(cfg(l1_tokens=64 * 4096, l2_tokens=0), available=AVAIL, shm_free=None)
    msg = str(e.value)
    assert e.value.field == "cache.l1_tokens" and msg.startswith("cache.l1_tokens: 262144 tokens") and "\n" not in msg
    assert "host memory" in msg and "set a smaller cache.l1_tokens" in msg, msg
    fit = fit_of(e)
    assert fit == AVAIL // PAGE * 64
    check_memory(cfg(l1_tokens=fit, l2_tokens=0), available=AVAIL, shm_free=None)


def test_an_l2_too_large_beside_the_l1_is_refused_naming_the_largest_value_that_fits() -> None:
    """L1 on the CPU and L2 share the host memory: what L2 may take is what the L1 leaves."""
    l1 = 64 * 512  # 4 GiB
    with pytest.raises(ConfigError) as e:
        check_memory(cfg(l1_tokens=l1, l2_tokens=64 * 2052), available=AVAIL, shm_free=None)
    msg = str(e.value)
    assert e.value.field == "cache.l2_tokens" and msg.startswith("cache.l2_tokens: 131328 tokens"), msg
    assert "beside the 4.0 GiB of L1" in msg and "0 disables L2" in msg and "\n" not in msg, msg
    fit = fit_of(e)
    assert fit == 64 * 2051
    check_memory(cfg(l1_tokens=l1, l2_tokens=fit), available=AVAIL, shm_free=None)
    with pytest.raises(ConfigError):
        check_memory(cfg(l1_tokens=l1, l2_tokens=fit + 64), available=AVAIL, shm_free=None)


def test_the_shared_pool_must_fit_in_shared_memory_and_a_gpu_l1_in_the_gpu() -> None:
    with pytest.raises(ConfigError) as e:
        check_memory(cfg(l1_tokens=64 * 512, l2_tokens=0), available=100 * GiB, shm_free=2 * GiB)
    assert e.value.field == "cache.l1_tokens" and "/dev/shm" in str(e.value) and "serve.shared_pool" in str(e.value)
    assert fit_of(e) == 256 * 64
    gpu = cfg(device="cuda", l1_tokens=64 * 2048, l2_tokens=0)
    with pytest.raises(ConfigError) as e:
        check_memory(gpu, available=1 * GiB, gpu_free=lambda device: 10 * GiB)
    assert e.value.field == "cache.l1_tokens" and "cuda" in str(e.value) and fit_of(e) == 1280 * 64
    check_memory(gpu, available=1 * GiB, gpu_free=lambda device: 17 * GiB)  # GPU memory is not host memory


def test_serve_refuses_before_allocating_any_tier(monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    from hicache.cli import main

    built: list[str] = []
    for cls in (DevicePool, HostPool, SharedPool):
        monkeypatch.setattr(cls, "__init__", lambda *a, name=cls.__name__, **k: built.append(name))
    monkeypatch.setattr(pool_mod, "host_zeros", lambda *a: built.append("host_zeros"))
    for k in [k for k in os.environ if k.startswith("HICACHE_")]:
        monkeypatch.delenv(k)
    monkeypatch.setattr(pool_mod, "available_host_memory", lambda: 12 * GiB)
    args = ["serve", "--port", "0", "--metrics-port", "0", "--l1-tokens", str(64 * 512), "--l2-tokens", str(64 * 2048)]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("hicache serve: config: cache.l2_tokens: "), err
    assert built == []


# ---------------------------------------------------------------------------------------------- lazy pools


def rss() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * 4096


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="reads the resident set from /proc")
def test_building_large_pools_touches_none_of_their_memory() -> None:
    """A 2 GiB L1 on the CPU, a 2 GiB shared L1 and a 2 GiB L2 take next to no time and no memory until
    written; they read as zeros (L1) and are counted as host memory still to come while they live."""
    layout = KVLayout(32, 8, 128, "bfloat16", 64)
    before, lazy0 = rss(), lazy_host_bytes()
    t0 = time.perf_counter()
    dev = DevicePool(layout, 256)
    shared = SharedPool(layout, 256, "cpu")
    host = HostPool(layout, 256, pin_memory=False)
    took = time.perf_counter() - t0
    try:
        assert rss() - before < 256 << 20, "building the pools touched their pages"
        assert took < 2.0, took  # zero-filling 4 GiB page by page took seconds
        assert lazy_host_bytes() - lazy0 == dev.nbytes + shared.nbytes == 4 * GiB
        assert not dev.kv[31][1][255].any() and not shared.pool.kv[0][0][0].any()
        dev.kv[3][0][7].fill_(1.5)
        assert float(dev.kv[3][0][7].sum()) == 1.5 * 64 * 8 * 128
    finally:
        shared.close()
    del dev, shared, host
    gc.collect()
    assert lazy_host_bytes() == lazy0


def test_an_l2_beside_a_lazy_l1_counts_what_the_l1_will_take(monkeypatch: pytest.MonkeyPatch) -> None:
    layout = KVLayout(32, 8, 128, "bfloat16", 64)
    lazy0 = lazy_host_bytes()
    dev = DevicePool(layout, 64)  # 512 MiB, not touched
    assert lazy_host_bytes() - lazy0 == dev.nbytes
    monkeypatch.setattr(pool_mod, "available_host_memory", lambda: lazy_host_bytes() + 100 * PAGE)
    HostPool(layout, 100, pin_memory=False).release()
    with pytest.raises(pool_mod.HostMemoryError):
        HostPool(layout, 101, pin_memory=False)
    del dev


# ---------------------------------------------------------------------------------------------- the command


@pytest.mark.skipif(not Path("/proc").exists(), reason="reads the server's resident set from /proc")
def test_serve_with_no_tier_config_listens_and_says_how_long_it_took() -> None:
    """No config file, no size: the tiers are sized from this machine (one line), the server listens, the
    line says after how long, and the tiers are not resident (building them touched nothing)."""
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "hicache.cli", "serve", "--port", "0", "--metrics-port", "0"],
                            cwd=REPO, env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("hicache serve: listening on"):
                break
        waited = time.monotonic() - t0
        out = "".join(lines)
        m = re.search(r"listening on 127\.0\.0\.1:\d+ after (\d+\.\d) s$", lines[-1].rstrip())
        assert m is not None, out
        assert 0 < float(m.group(1)) <= waited + 0.1, (m.group(1), waited)
        sized = next(line for line in lines if "not set:" in line)
        l1, l2 = (int(x) for x in re.findall(r"L[12] (\d+) tokens", sized))
        tiers = (l1 + l2) // 64 * PAGE
        status = Path(f"/proc/{proc.pid}/status").read_text()
        resident = int(re.search(r"VmRSS:\s+(\d+) kB", status).group(1)) << 10  # type: ignore[union-attr]
        if tiers >= 2 * GiB:
            assert resident < tiers // 2, (resident, tiers)
    finally:
        proc.terminate()
        proc.wait(30)
    assert proc.returncode == 0, "".join(lines) + (proc.stdout.read() if proc.stdout else "")
