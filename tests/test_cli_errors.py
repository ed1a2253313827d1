"""Bad input to every ``hicache`` command, as an operator types it: exit code 2 and one line on stderr naming
what is wrong and where (the flag, the config field, the environment variable, the file and line), no
traceback, no credential repeated; Ctrl-C ends with 130.

Each case runs the real command line in its own process; the table's cases run a few at a time, once per
module (:func:`outcomes`). A case that should be refused but starts a server instead is killed after
:data:`TIMEOUT_S` and fails.
"""

from __future__ import annotations

import json
import re
import resource
import socket
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from cli_procs import REPO, cli_env, run_cli

TIMEOUT_S = 25.0
# gRPC's C core logs a failed bind itself ("E1204 22:14:03.965029    5157 add_port.cc:83] ..."), before
# hicache's own line; it is not hicache's to shorten
GRPC_LOG = re.compile(r"^[EWID]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ \S+:\d+\]")
NODE = ["--node", "n0=127.0.0.1:1"]
SERVE = ["serve", "--port", "0", "--metrics-port", "0", "--l1-tokens", "4096", "--l2-tokens", "0", "--no-shared-pool"]
BENCH = ["bench", "--requests", "20", "--quiet", "--capacities", "", "--l3", "none"]


@dataclass(frozen=True)
class Case:
    """``hicache ARGS`` (``{dir}``: a folder of the files below; ``{busy}``: a port something listens on)
    must exit 2 with one line holding every needle and none of ``hidden``."""

    id: str
    args: list[str]
    needles: list[str]
    env: dict[str, str] = field(default_factory=dict)
    hidden: str = ""


FILES = {
    "tab.yaml": "cache:\n\tl1_tokens: 4096\n",  # a tab where YAML wants spaces: line 2, column 1
    "binary.yaml": b"\x9d\xff\x00cache: {}\n",
    "notpem.pem": "not a certificate\n",
    "queue.yaml": "router: {event_queue: -5}\n",
    "trace.jsonl": '{"tokens": [1, 2, 3, 4]}\n{"tokens": [1, 2, 3, 5]}\n',
    "afile": "",
}

CASES = [
    # config files: one line with the file, and the line and column of a YAML error; text that is not UTF-8
    Case("serve-yaml-syntax", ["serve", "--config", "{dir}/tab.yaml"], ["tab.yaml:2:1", "not valid YAML"]),
    Case("route-yaml-syntax", ["route", "--config", "{dir}/tab.yaml", *NODE], ["tab.yaml:2:1", "not valid YAML"]),
    Case("serve-config-binary", ["serve", "--config", "{dir}/binary.yaml"], ["binary.yaml", "not UTF-8"]),
    Case("route-config-binary", ["route", "--config", "{dir}/binary.yaml", *NODE], ["binary.yaml", "not UTF-8"]),
    # serve: values that started a server doing the wrong thing, or failed in a library's words
    Case("serve-ttl-nan", [*SERVE, "--request-ttl-s", "nan"], ["--request-ttl-s", "finite"]),
    Case("serve-ttl-inf", [*SERVE, "--request-ttl-s", "inf"], ["--request-ttl-s", "finite"]),
    Case("serve-l1-absurd", [*SERVE, "--l1-tokens", "99999999999999"], ["cache.l1_tokens", "host memory"]),
    Case("serve-tls-not-pem", [*SERVE, "--tls-cert", "{dir}/notpem.pem", "--tls-key", "{dir}/notpem.pem"],
         ["serve.tls_cert", "notpem.pem", "not a PEM file"]),
    Case("serve-tls-missing", [*SERVE, "--tls-cert", "{dir}/none.pem", "--tls-key", "{dir}/notpem.pem"],
         ["serve.tls_cert", "none.pem", "No such file"]),
    Case("serve-host-unknown", [*SERVE, "--host", "no-such-host.invalid"], ["serve.host", "cannot resolve"]),
    Case("serve-metrics-port-busy", [*SERVE[:3], "--metrics-port", "{busy}", *SERVE[5:]],
         ["metrics http://127.0.0.1:{busy}", "in use"]),
    Case("serve-port-busy", ["serve", "--port", "{busy}", *SERVE[3:-1]], ["127.0.0.1:{busy}", "in use"]),
    Case("serve-token-newline", SERVE, ["HICACHE_SERVE__AUTH_TOKEN=<hidden>", "serve.auth_token", "newline"],
         env={"HICACHE_SERVE__AUTH_TOKEN": "s3cret-value\n"}, hidden="s3cret-value"),
    # route
    Case("route-nan-weight", ["route", "--port", "0", *NODE, "--load-weight", "nan"], ["router.load_weight"]),
    Case("route-nan-env", ["route", "--port", "0", *NODE], ["HICACHE_ROUTER__RECONNECT_MAX_S=nan",
                                                             "router.reconnect_max_s"],
         env={"HICACHE_ROUTER__RECONNECT_MAX_S": "nan"}),
    Case("route-inf-ttl", ["route", "--port", "0", *NODE, "--route-ttl-s", "inf"], ["router.route_ttl_s"]),
    Case("route-event-queue", ["route", "--port", "0", *NODE, "--config", "{dir}/queue.yaml"],
         ["router.event_queue", "-5"]),
    Case("route-host-unknown", ["route", "--port", "0", *NODE, "--host", "no-such-host.invalid"],
         ["router.host", "cannot resolve"]),
    Case("route-metrics-port-busy", ["route", "--port", "0", *NODE, "--metrics-port", "{busy}"],
         ["metrics http://127.0.0.1:{busy}", "in use"]),
    Case("route-token-newline", ["route", "--port", "0", *NODE],
         ["HICACHE_ROUTER__NODE_TOKEN=<hidden>", "router.node_token"],
         env={"HICACHE_ROUTER__NODE_TOKEN": "s3cret-value\n"}, hidden="s3cret-value"),
    # status
    Case("status-token-newline", ["status", "127.0.0.1:{busy}", "--timeout", "1"], ["HICACHE_TOKEN", "newline"],
         env={"HICACHE_TOKEN": "s3cret-value\n"}, hidden="s3cret-value"),
    Case("status-ca-not-pem", ["status", "127.0.0.1:{busy}", "--timeout", "1", "--tls-ca", "{dir}/notpem.pem"],
         ["--tls-ca", "not a PEM file"]),
    # bench and doctor: the flag, not an internal config field; flags the run would ignore; outputs that
    # cannot be written, found before the run rather than after it; an L3 URL its backend cannot open
    Case("bench-write-policy", [*BENCH, "--write-policy", "sometimes"], ["--write-policy", "'sometimes'"]),
    Case("bench-prefetch-policy", [*BENCH, "--prefetch-policy", "never"], ["--prefetch-policy", "'never'"]),
    Case("bench-json-under-a-file", [*BENCH, "--json", "{dir}/afile/r.json"], ["--json", "afile is a file"]),
    Case("bench-out-under-a-file", [*BENCH, "--out", "{dir}/afile/out"], ["--out", "afile is a file"]),
    Case("bench-limit-without-trace", [*BENCH, "--limit", "5"], ["--limit", "--trace only"]),
    Case("doctor-format-without-trace", ["doctor", "--format", "mooncake"], ["--format", "--trace only"]),
    Case("bench-plant-with-trace", ["bench", "--trace", "{dir}/trace.jsonl", "--plant", "timestamp", "--quiet"],
         ["--plant"]),
    Case("bench-l3-bad-port", [*BENCH[:-1], "redis://:s3cret-value@127.0.0.1:99999/0"],
         ["--l3 redis://127.0.0.1:99999/0", "cannot open the store", "out of range"], hidden="s3cret-value"),
    Case("bench-l3-no-host", [*BENCH[:-1], "redis://"], ["--l3 redis://", "cannot open the store"]),
]
if not torch.cuda.is_available():  # a CUDA device this machine does not have
    CASES += [Case("serve-cuda-missing", [*SERVE, "--device", "cuda"], ["cache.device", "no CUDA device"]),
              Case("serve-cuda-env", SERVE, ["HICACHE_CACHE__DEVICE=cuda:1", "cache.device"],
                   env={"HICACHE_CACHE__DEVICE": "cuda:1"})]


Outcome = tuple[Case, "subprocess.CompletedProcess[str]"]


@pytest.fixture(scope="module")
def busy_port() -> Iterator[int]:
    """A loopback port something listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield int(s.getsockname()[1])


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory, busy_port: int) -> dict[str, Outcome]:
    """Every case of the table, run a few at a time: ``{id: (case with placeholders filled, result)}``."""
    d = tmp_path_factory.mktemp("cli-errors")
    for name, content in FILES.items():
        (d / name).write_bytes(content if isinstance(content, bytes) else content.encode())

    def fill(text: str) -> str:
        return text.replace("{dir}", str(d)).replace("{busy}", str(busy_port))

    cases = [Case(c.id, [fill(a) for a in c.args], [fill(n) for n in c.needles], c.env, c.hidden) for c in CASES]
    with ThreadPoolExecutor(4) as pool:
        results = pool.map(lambda c: run_cli(c.args, c.env, TIMEOUT_S, cwd=d), cases)
        return {c.id: (c, r) for c, r in zip(cases, results, strict=True)}


def one_line(stderr: str) -> str:
    """The one line of ``stderr`` (gRPC's own log lines aside); fails when there are more."""
    lines = [line for line in stderr.splitlines() if line.strip() and not GRPC_LOG.match(line)]
    assert len(lines) == 1, f"expected one line, got:\n{stderr}"
    return lines[0]


@pytest.mark.parametrize("case_id", [c.id for c in CASES])
def test_bad_input_is_one_line_and_exit_2(case_id: str, outcomes: dict[str, Outcome]) -> None:
    case, r = outcomes[case_id]
    assert r.returncode == 2, f"hicache {' '.join(case.args)}: exit {r.returncode}\n{r.stderr[-3000:]}"
    line = one_line(r.stderr)
    assert "Traceback" not in r.stderr, r.stderr
    assert line.startswith(f"hicache {case.args[0]}: "), line
    for needle in case.needles:
        assert needle in line, f"{needle!r} not in {line!r}"
    if case.hidden:
        assert case.hidden not in r.stderr + r.stdout, line


def test_bench_capacity_beyond_the_working_set_replays_in_what_the_trace_needs(tmp_path: Path) -> None:
    """``--l1 100g`` (an operator meaning 100 GB) on a small workload replays as an L1 of the whole working
    set does -- the same hit rates -- without asking for the 200 GB the literal size would take (the
    replay's pools stop at what the trace can fill). Held to 4 GiB of address space, as a small machine."""

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))

    rates = []
    for size in ("100g", "1000%"):
        out = tmp_path / f"{size}.json"
        r = run_cli([*BENCH, "--l1", size, "--l2", size, "--json", str(out)], timeout_s=120, preexec_fn=limit)
        assert r.returncode == 0, f"--l1 {size}: exit {r.returncode}\n{r.stderr[-3000:]}"
        res = json.loads(out.read_text())
        rates.append((res["hit_rate"], res["tiers"]))
    assert rates[0] == rates[1]


def test_ctrl_c_while_a_subcommand_loads_exits_130_quietly() -> None:
    """A Ctrl-C that lands while ``hicache bench`` loads its modules (seconds, on a cold machine) ends the
    command with 130 and nothing on stderr, as one during the replay does. The signal is real: the process
    sends itself SIGINT as the bench module's import begins (``os.kill`` runs Python's handler before it
    returns, so the interrupt lands at that import, whatever the machine's load).

    The process starts with SIGINT as a terminal gives it: Python's handler, the signal not blocked. A
    child inherits an ignored SIGINT and a blocked signal mask from its parent, and Python then installs no
    handler: run from a non-interactive shell in the background (``scripts/test.sh &``, a CI runner, a
    ``nohup`` wrapper), the suite's processes ignore SIGINT, the self-sent signal was lost and the whole
    benchmark ran (exit 0), while the same test passed alone in a terminal."""
    code = textwrap.dedent("""
        import os, signal, sys

        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})

        class CtrlC:
            def find_spec(self, name, path=None, target=None):
                if name == "hicache.bench.cli":
                    sys.meta_path.remove(self)
                    os.kill(os.getpid(), signal.SIGINT)
                return None

        from hicache.cli import main
        sys.meta_path.insert(0, CtrlC())
        sys.exit(main(["bench", "--requests", "20", "--quiet"]))
    """)
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=cli_env(), capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 130, f"exit {r.returncode}\n{r.stderr[-3000:]}"
    assert r.stderr == "", r.stderr
