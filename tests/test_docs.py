"""The documentation says what the code does.

README is what a new user needs; the rest lives in ``docs/``. These checks hold the two to the code:

- README's commands run: the Quick start is what CI runs, every ``hicache`` command line of README and
  ``docs/`` (and the examples of each ``--help``) parses with the real parser, every default a ``--help``
  states is the parser's; README's Python snippets run as written (the library one on an in-process CPU
  cache through L1, L2 and L3; the client one against a real ``hicache serve``) and its grpcurl payloads
  are requests the node accepts; the engine snippet of ``docs/library.md`` runs on CPU;
- every configuration field (the dataclasses of :mod:`hicache.config` and the router's, enumerated) is
  documented in ``docs/``: ``docs/configuration.md`` has one row per field with the field's default, and
  every transfer option and store option is named with its default;
- the lists of policies, backends, layouts, transfer options, RPCs, metrics and alerts the docs give are
  the code's, and the code layout table of ``docs/architecture.md`` is the tree;
- every link of README, ``docs/`` and ``benchmarks/results/*/README.md`` (and every repository path they
  quote) resolves to a file that exists, anchors included.

Each check fails when a documented key, default, name or link drifts from the code. None requires README
to hold everything: a fact may live in any page of ``docs/``.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import os
import re
import shlex
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import yaml

from hicache import config as hconfig
from hicache.cli import SUBCOMMANDS, build_parser
from hicache.config import HiCacheConfig, config_from_dict, load_config

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()
DOCS = {p.name: p.read_text() for p in sorted((REPO / "docs").glob("*.md"))}
METRICS_DOC = DOCS["metrics.md"]
CONFIG_DOC = DOCS["configuration.md"]
TUNING = DOCS["tuning.md"]
ALL_DOCS = " ".join(DOCS.values())
FLAT = " ".join((README + "\n" + ALL_DOCS).split())  # README and every page of docs/, whitespace folded


# --- reading the docs ----------------------------------------------------------------------------------------


def section(text: str, title: str) -> str:
    """The body of the ``#``-heading ``title`` up to the next heading of the same or a higher level."""
    m = re.search(rf"^(#+) {re.escape(title)}\n", text, re.M)
    assert m, f"no section {title!r}"
    level = len(m.group(1))
    out, fenced = [], False
    for line in text[m.end():].splitlines(keepends=True):
        fenced ^= line.startswith("```")
        if not fenced and re.match(rf"#{{1,{level}}} ", line):
            break
        out.append(line)
    return "".join(out)


def blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", text, re.M | re.S)


def paragraph(text: str, start: str) -> str:
    """The paragraph of ``text`` that ``start`` opens (whitespace folded), up to the next blank line."""
    i = text.index(start)
    return " ".join(text[i:].split("\n\n", 1)[0].split())


def table_rows(text: str) -> list[list[str]]:
    """Cells of the markdown table rows in ``text`` (header and rule rows dropped)."""
    rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in text.splitlines()
            if line.startswith("|")]
    return [r for r in rows[2:] if r] if rows else []


def ticked(text: str) -> list[str]:
    return re.findall(r"`([^`]+)`", text)


def subparser(name: str) -> argparse.ArgumentParser:
    parser = build_parser(name)
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    sub: argparse.ArgumentParser = action.choices[name]
    return sub


def parses(argv: list[str]) -> argparse.Namespace:
    try:
        return build_parser(argv[0]).parse_args(argv)
    except SystemExit:
        pytest.fail(f"does not parse: hicache {shlex.join(argv)}")


# --- Quick start, command lines, --help ----------------------------------------------------------------------


def test_quick_start_is_what_ci_runs() -> None:
    (block,) = blocks(section(README, "Quick start"), "bash")
    commands = [line for line in block.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    assert commands == ["scripts/install.sh && hicache bench", "scripts/test.sh"]
    ci = [line for line in (REPO / ".ci" / "run").read_text().splitlines()
          if line and not line.startswith(("#", "set ", "cd "))]
    assert ci == ["bash scripts/test.sh"]
    for script in ("scripts/install.sh", "scripts/test.sh"):  # "as written": run without `bash` in front
        assert os.access(REPO / script, os.X_OK), script
    test_sh = (REPO / "scripts" / "test.sh").read_text()
    # README: "installs the test tools, and Debian's redis-server and prometheus when missing; lint, types, tests"
    for step in ("scripts/install.sh --dev", "ruff check hicache tests benchmarks", "mypy", "pytest"):
        assert step in test_sh, step
    install = (REPO / "scripts" / "install.sh").read_text()
    assert "redis-server" in install and "prometheus" in install and "download.pytorch.org/whl/cpu" in install


def commands_of(text: str) -> list[list[str]]:
    """The ``hicache`` command lines of ``text``'s bash blocks (continuations joined, ``&&`` split)."""
    out = []
    for block in blocks(text, "bash"):
        for line in block.replace("\\\n", " ").splitlines():
            for part in line.split("&&"):
                argv = shlex.split(part, comments=True)
                if argv[:1] == ["hicache"]:
                    out.append(argv[1:])
    return out


def help_examples(name: str) -> list[list[str]]:
    """The ``hicache NAME ...`` example lines of a subcommand's ``--help`` (optional ``[...]`` parts kept)."""
    out = []
    for line in (subparser(name).description or "").splitlines():
        line = line.strip()
        if line.startswith(f"hicache {name}"):
            line = re.split(r"\s{2,}|\s#", line)[0]  # drop a description beside the example
            out.append(shlex.split(line.replace("[", "").replace("]", "").replace("...", ""))[1:])
    return out


def test_every_command_line_shown_parses() -> None:
    commands = commands_of(README)
    assert {c[0] for c in commands} >= {"bench", "doctor", "serve", "route"}
    for text in DOCS.values():
        commands += commands_of(text)
    for name in SUBCOMMANDS:
        examples = help_examples(name)
        assert examples, f"hicache {name} --help shows no example"
        commands += examples
    deploy = (REPO / "deploy" / "README.md").read_text()
    for block in blocks(deploy, "bash"):
        for m in re.finditer(r"hicache:\S+ (serve .*)", block.replace("\\\n", " ")):
            commands.append(shlex.split(m.group(1)))
    for argv in commands:
        parses(argv)
    # the values the README's own lines rely on
    args = parses(["bench", "--workload", "rag", "--l1", "64k", "--l2", "2GiB", "--eviction-policy", "lru"])
    assert (args.l1, args.l2, args.eviction_policy) == ("64k", "2GiB", "lru")


def stated_default(text: str) -> str | None:
    m = re.search(r"\bdefault[:\s]+([^\s;:)]+)", text.replace("%%", "%"))
    return m.group(1).rstrip(",") if m else None


def test_help_texts_state_the_parsers_defaults() -> None:
    checked = 0
    for name in SUBCOMMANDS:
        for action in subparser(name)._actions:
            if not action.help or action.default in (None, False, argparse.SUPPRESS):
                continue
            stated = stated_default(action.help)
            if stated is None:
                continue
            checked += 1
            where = f"hicache {name} {'/'.join(action.option_strings)}"
            if isinstance(action.default, int | float) and not isinstance(action.default, bool):
                assert float(stated) == float(action.default), f"{where}: help says {stated}, default {action.default}"
            else:
                assert stated == str(action.default), f"{where}: help says {stated}, default {action.default!r}"
    assert checked >= 15


def test_help_texts_carry_no_docstring_markup() -> None:
    """Descriptions are module docstrings (reStructuredText): ``--help`` prints them plain."""
    for name in SUBCOMMANDS:
        text = subparser(name).format_help()
        assert not re.search(r"``|:(mod|func|class|meth|attr):`", text), f"hicache {name} --help:\n{text}"


# --- Configuration ---------------------------------------------------------------------------------------------

CONFIG = section(README, "Configuration")


def config_fields() -> dict[str, Any]:
    """Every configuration field as ``section.field`` -> its default: the node's sections and the router's."""
    from hicache.router.config import RouterConfig

    default = HiCacheConfig()
    out: dict[str, Any] = {}
    for sec in hconfig._SECTIONS:
        for f in dataclasses.fields(getattr(default, sec)):
            out[f"{sec}.{f.name}"] = getattr(getattr(default, sec), f.name)
    router = RouterConfig()
    for f in dataclasses.fields(RouterConfig):
        out[f"router.{f.name}"] = getattr(router, f.name)
    return out


def reference_rows(text: str) -> dict[str, str]:
    """``name -> default cell`` of the tables of ``text`` whose first cells are backticked names (a cell
    naming several, ``a`, `b`, gives each the same default)."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not line.startswith("| `") or len(cells) < 3:
            continue
        for name in ticked(cells[0]):
            out[name] = cells[1]
    return out


def cell_value(cell: str, like: Any) -> Any:
    """The value of a default cell (one backticked value: YAML, or the text itself where the default is a
    string; ``""`` is the empty string)."""
    m = re.fullmatch(r"`([^`]*)`", cell)
    assert m, f"a default cell is one backticked value, got {cell!r}"
    if isinstance(like, str):
        return "" if m.group(1) == '""' else m.group(1)
    return yaml.safe_load(m.group(1))


def test_config_example_loads() -> None:
    (example,) = blocks(CONFIG, "yaml")
    config_from_dict(yaml.safe_load(example))  # an unknown field or a bad value raises


def test_every_config_field_is_documented_with_its_default() -> None:
    fields = config_fields()
    assert len(fields) > 60
    for name in fields:  # somewhere in docs/, by its dotted name
        assert f"`{name}`" in ALL_DOCS, f"docs/: the configuration field {name} is documented nowhere"
    rows = {k: v for k, v in reference_rows(CONFIG_DOC).items() if "." in k}
    assert set(rows) == set(fields), (f"docs/configuration.md: missing {sorted(set(fields) - set(rows))}, "
                                      f"not fields {sorted(set(rows) - set(fields))}")
    for name, cell in rows.items():
        expected = fields[name]
        assert cell_value(cell, expected) == expected, f"docs/configuration.md: {name}: {cell}, default {expected!r}"


def test_every_store_option_is_documented_with_its_default() -> None:
    from hicache.storage.file_backend import FileBackend
    from hicache.storage.redis_options import RedisOptions

    rows = reference_rows(section(CONFIG_DOC, "`storage.options`, per store"))
    redis = {f.name: f.default for f in dataclasses.fields(RedisOptions)}
    sig = inspect.signature(FileBackend.__init__).parameters
    file = {n: p.default for n, p in sig.items()
            if p.kind is p.POSITIONAL_OR_KEYWORD and n not in ("self", "url", "ctx", "filesystem")}
    for name in {**redis, **file}:
        assert name in rows, f"docs/configuration.md: the store option {name} is not documented"
    redis_table, file_table = section(CONFIG_DOC, "`storage.options`, per store").split("| file store option |")
    for table, options in ((redis_table, redis), ("| file store option |" + file_table, file)):
        for name, cell in reference_rows(table).items():
            assert name in options, f"docs/configuration.md: {name} is not a store option"
            default = options[name]
            assert cell_value(cell, default) == default, f"docs/configuration.md: {name}: {cell}, default {default!r}"


def test_defaults_named_in_prose() -> None:
    from hicache.client._common import DEFAULT_RECONNECT_MAX_S, DEFAULT_TIMEOUT_S, RetryPolicy
    from hicache.pool import default_block_pages
    from hicache.router.config import RouterConfig
    from hicache.service.server import STORAGE_PROBE_S

    c, s = HiCacheConfig().cache, HiCacheConfig().storage
    facts = {  # phrase of README or docs/ -> does the code agree
        f"`{c.write_policy}` (default)": True,
        f"`{c.eviction_policy}` (default:": True,
        f"`{c.host_layout}` (default:": True,
        f"`{c.io_backend}` (default:": True,
        f"`{c.io_backend}` (default), `kernel`": True,
        f"`{RouterConfig().policy}` (default;": True,
        "`cache.max_pinned_fraction`, default half": c.max_pinned_fraction == 0.5,
        f"batches of {s.io_batch_pages} pages": True,
        f"`{s.writeback_when_full}` or counted `drop` when full": s.writeback_when_full == "block",
        f"(`timeout_s`, {DEFAULT_TIMEOUT_S:g} s by default)": True,
        "The default policy (4 attempts, 50 ms doubling)": (RetryPolicy().attempts, RetryPolicy().base_s) == (4, 0.05),
        f"`reconnect_max_s`, {DEFAULT_RECONNECT_MAX_S:g} s": True,
        f"A node checks every {STORAGE_PROBE_S:g} s that its store answers": True,
        "16 pages of 4 KiB pieces": default_block_pages(4096) == 16,
        "the bearer token comes from `HICACHE_TOKEN`": True,
        f"(`timeout` policy: {s.prefetch_timeout_base_s:g} s + {s.prefetch_timeout_per_1k_tokens_s:g} s per 1k "
        f"tokens, capped at {s.prefetch_timeout_max_s:g} s": True,
    }
    for phrase, agrees in facts.items():
        assert phrase in FLAT, f"README and docs/ no longer say: {phrase}"
        assert agrees, f"the docs say {phrase!r}, the code does not"
    status = {a.dest: a.default for a in subparser("status")._actions}
    assert status["token_env"] == "HICACHE_TOKEN"
    assert "`HICACHE_CACHE__WRITE_POLICY=write_back`" in " ".join(README.split())
    assert load_config(env={"HICACHE_CACHE__WRITE_POLICY": "write_back"}).cache.write_policy == "write_back"
    # the example of config.py's docstring: an environment variable's error starts with that variable
    with pytest.raises(hconfig.ConfigError) as e:
        load_config(env={"HICACHE_CACHE__L1_TOKENS": "abc"})
    assert str(e.value) in " ".join((hconfig.__doc__ or "").split())


def test_named_choices_are_the_codes() -> None:
    from hicache.eviction import policy_names
    from hicache.layout import HOST_LAYOUTS
    from hicache.router.scoring import policy_names as route_policies
    from hicache.storage.base import BACKENDS

    plain = lambda ws: {w for w in ws if re.fullmatch(r"[a-z][a-z0-9_]*", w)}  # noqa: E731
    writes = {r[0].strip("`").split("`")[0] for r in table_rows(section(TUNING, "Write policies"))}
    assert writes == set(hconfig.WRITE_POLICIES)
    evictions = paragraph(DOCS["eviction.md"], "`cache.eviction_policy` picks the order")
    assert plain(ticked(evictions)) == set(policy_names())
    chosen = {r[0].strip("`") for r in table_rows(section(DOCS["eviction.md"], "Choosing an eviction policy"))}
    assert chosen == set(policy_names())
    io = paragraph(TUNING, "`cache.io_backend` picks how")
    assert plain(ticked(io)) == set(hconfig.IO_BACKENDS)
    layouts = paragraph(TUNING, "`cache.host_layout` lays out L2")
    assert plain(ticked(layouts)) & {"page_first", "layer_first", "block_first"} == set(HOST_LAYOUTS)
    assert "with the same `best_effort`, `wait_complete`, `timeout`" in FLAT
    assert set(hconfig.PREFETCH_POLICIES) == {"best_effort", "wait_complete", "timeout"}
    routing = paragraph(section(README, "Routing: `hicache route`"), "The router keeps")
    assert plain(ticked(routing.split("Policies:")[1])) == set(route_policies())
    schemes = set(BACKENDS.names())
    urls = re.findall(r"`([a-z0-9+]+)://", section(DOCS["storage.md"], "L3 stores"))
    assert urls
    for url in urls:
        assert url in schemes, url


def test_transfer_options_table_is_the_engines_defaults() -> None:
    from hicache import cli
    from hicache.transfer import cuda_kernels, cuda_tuning
    from hicache.transfer.cuda import CudaTransferEngine

    text = TUNING.split("`cache.transfer_options` tunes the GPU engine:", 1)[1].split("\n\n", 1)[1].split("\n\n")[0]
    cells: dict[str, str] = {}
    for row in table_rows(text):
        names = [n.strip().strip("`") for n in row[0].split(",")]
        values = [v.strip() for v in row[1].split(",")] if len(names) > 1 else [row[1]]
        assert len(values) == len(names), row
        cells.update(zip(names, values, strict=True))
    sig = inspect.signature(CudaTransferEngine.__init__).parameters
    assert set(hconfig.TRANSFER_OPTIONS) <= set(sig)
    t = cuda_tuning
    derived = {  # options whose default (None) the engine derives: what the table says of them
        "stage_lanes": f"{getattr(t, 'STAGE_LANES', None)} where `CUDA_DEVICE_MAX_CONNECTIONS` >= "
                       f"{getattr(t, 'WIDE_QUEUES', None)}, else 1",
        "backup_slots": f"{getattr(t, 'WIDE_BACKUP_SLOTS', None)} with lanes, else {getattr(t, 'STAGE_SLOTS', None)}",
        "blocks": str(cuda_kernels.DEFAULT_BLOCKS),
    }
    for name, cell in cells.items():
        assert name in hconfig.TRANSFER_OPTIONS, f"docs/tuning.md: {name} is not a transfer option"
        default = sig[name].default
        if default is None:
            assert name in derived and cell == derived[name], f"docs/tuning.md: {name}: {cell}"
        elif isinstance(default, str):
            assert cell == f"`{default}`", f"docs/tuning.md: {name}: {cell}, default {default!r}"
        elif cell.endswith(" MiB"):
            assert int(cell.split()[0]) << 20 == default, f"docs/tuning.md: {name}: {cell}, default {default}"
        else:
            assert cell == str(default), f"docs/tuning.md: {name}: {cell}, default {default}"
    flat = " ".join(text.split())
    for name in set(hconfig.TRANSFER_OPTIONS) - set(cells):  # named in a row's prose, with its default
        assert f"`{name}` SMs (default {sig[name].default})" in flat, f"docs/tuning.md: {name} is not documented"
    if "blocks" in cells:
        assert cuda_kernels.DEFAULT_LOAD_BLOCKS == cuda_kernels.DEFAULT_BLOCKS
    if "staging_bytes" in cells:
        assert f"({t.LOAD_SLOT_BYTES >> 20} MiB each)" in flat
    if "stage_lanes" in cells:
        assert f"backups gather on at most {t.BACKUP_LANES}" in flat
        assert (f"`hicache` sets `CUDA_DEVICE_MAX_CONNECTIONS={cli.CUDA_QUEUES}` and "
                f"`CUDA_SCALE_LAUNCH_QUEUES={cli.CUDA_LAUNCH_QUEUES}` at start unless the environment does") in flat
        assert int(cli.CUDA_QUEUES) >= t.WIDE_QUEUES


def test_hicache_sets_the_cuda_environment_it_documents(monkeypatch: pytest.MonkeyPatch) -> None:
    from hicache import cli

    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    monkeypatch.setenv("CUDA_SCALE_LAUNCH_QUEUES", "2x")  # what the environment says wins
    with pytest.raises(SystemExit):
        cli.main(["--version"])
    assert os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] == cli.CUDA_QUEUES
    assert os.environ["CUDA_SCALE_LAUNCH_QUEUES"] == "2x"


def test_store_urls_named_exist() -> None:
    from hicache.storage.file_backend import FileBackend
    from hicache.storage.redis_options import RedisOptions

    rows = {r[0]: r[1] for r in table_rows(section(DOCS["storage.md"], "L3 stores"))}
    file_row = next(k for k in rows if k.startswith("`file://"))
    file_opts = set(ticked(file_row.split("(options", 1)[1].split(")", 1)[0]))
    assert file_opts and file_opts <= set(inspect.signature(FileBackend.__init__).parameters)
    redis_row = next(k for k in rows if k.startswith("`redis://"))
    redis_opts = set(re.findall(r"[?&](\w+)=", redis_row)) | set(re.findall(r"`(\w+_\w+)`", rows[redis_row]))
    assert redis_opts and redis_opts <= {f.name for f in dataclasses.fields(RedisOptions)}


# --- the gRPC API, metrics, alerts -------------------------------------------------------------------------------


def test_rpc_table_is_the_service() -> None:
    from hicache.proto_gen.hicache.v1 import hicache_pb2 as pb

    table = "| RPC | what |" + section(README, "Serving: `hicache serve`").split("| RPC | what |", 1)[1]
    rows = table_rows(table.split("\n\n")[0])
    named = {n for r in rows for n in ticked(r[0])} - {"grpc.health.v1"}
    assert named == set(pb.DESCRIPTOR.services_by_name["HiCache"].methods_by_name)


def test_metric_names_in_the_docs_are_exported() -> None:
    from hicache.metrics.catalog import catalog, series_names

    exported = series_names() | {m.name for m in catalog() if m.type == "histogram"}  # a histogram by its name
    for doc, text in (("README.md", README), *((f"docs/{n}", t) for n, t in DOCS.items())):
        names = set(re.findall(r"\bhicache_[a-z0-9_]+\b(?!\()", text))  # `hicache_stats()`: a function
        prefixes = {n for n in names if n.endswith("_")}  # `hicache_storage_*`: a family of them
        assert names - prefixes <= exported, f"{doc}: not exported: {sorted(names - prefixes - exported)}"
        for p in prefixes:
            assert any(e.startswith(p) for e in exported), f"{doc}: no metric starts with {p}"
    assert re.findall(r"\bhicache_[a-z0-9_]+\b", METRICS_DOC)


def test_alert_table_is_the_rules() -> None:
    template = (REPO / "deploy" / "helm" / "hicache" / "templates" / "prometheusrule.yaml").read_text()
    rules = dict(re.findall(r"- alert: (\w+)\n(?:.*\n)*?\s+severity: (\w+)", template))
    rows = table_rows(section(METRICS_DOC, "Alerts"))
    assert {r[0].strip("`"): r[2] for r in rows} == rules
    values = yaml.safe_load((REPO / "deploy" / "helm" / "hicache" / "values.yaml").read_text())
    pr = values["metrics"]["prometheusRule"]
    flat = " ".join(METRICS_DOC.split())
    assert f"`matchLatencyP99Seconds` ({pr['matchLatencyP99Seconds'] * 1000:g} ms)" in flat
    assert pr["hitRateBelow"] == 0  # "only with `hitRateBelow` > 0"
    assert f"`hicache serve --metrics-port`, {values['metrics']['port']} in the Helm chart" in flat
    assert values["metrics"]["port"] == HiCacheConfig().serve.metrics_port
    assert f"`hicache route --metrics-port` ({values['router']['metrics']['port']} in the chart)" in flat


# --- Layout of the code, links -------------------------------------------------------------------------------


def test_layout_table_is_the_tree() -> None:
    rows = table_rows(section(DOCS["architecture.md"], "Layout of the code"))
    named: set[str] = set()
    for row in rows:
        base = ""
        for p in ticked(row[0]):
            path = p if "/" in p.rstrip("/") or not base else base + p  # `hicache/keys.py`, `layout.py`
            base = path.rsplit("/", 1)[0] + "/" if "/" in path.rstrip("/") else base
            assert (REPO / path).exists(), f"docs/architecture.md layout table: {path} does not exist"
            named.add(path.rstrip("/"))
    for entry in (REPO / "hicache").iterdir():  # every module and package (kernels: a link to kernels/)
        if entry.name in ("__init__.py", "py.typed") or entry.name.startswith((".", "__")) or entry.is_symlink():
            continue
        if entry.is_dir() or entry.suffix == ".py":
            assert f"hicache/{entry.name}" in named, f"docs/architecture.md layout: hicache/{entry.name} is missing"
    tracked = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True).stdout.split()
    for top in {f.split("/", 1)[0] for f in tracked if "/" in f and not f.startswith(".")}:
        assert any(n == top or n.startswith(top + "/") for n in named), f"docs/architecture.md: {top}/ is missing"


def slug(heading: str) -> str:
    """The anchor a markdown renderer gives a heading: lower case, punctuation dropped, spaces as ``-``."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


LINKED = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")),
          *sorted((REPO / "benchmarks" / "results").glob("*/README.md"))]
QUOTED_PATH = re.compile(r"`((?:docs|benchmarks|deploy|scripts|proto|kernels|tests|data|hicache)/[\w./-]*)`")


@pytest.mark.parametrize("doc", LINKED, ids=lambda p: str(p.relative_to(REPO)))
def test_links_resolve(doc: Path) -> None:
    text = doc.read_text()
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):  # https://..., mailto:
            continue
        path, _, anchor = target.partition("#")
        file = (doc.parent / path).resolve() if path else doc
        assert file.exists(), f"{doc.relative_to(REPO)}: the link {target} names no file"
        if anchor and file.suffix == ".md":
            headings = {slug(h) for h in re.findall(r"^#+ (.+)$", file.read_text(), re.M)}
            assert anchor in headings, f"{doc.relative_to(REPO)}: the link {target} names no heading"
    for path in QUOTED_PATH.findall(text):  # a repository path quoted as code
        assert (REPO / path).exists(), f"{doc.relative_to(REPO)}: {path} does not exist"


def test_readme_is_a_newcomers_page() -> None:
    """README stays short and points to every page of docs/, so none is found only by browsing."""
    assert len(README.splitlines()) <= 300
    for name in DOCS:
        assert f"(docs/{name})" in README, f"README links nowhere to docs/{name}"


# --- the Python snippets, executed -------------------------------------------------------------------------


def kv_value(token: int, layer: int, c: int) -> float:
    return float(token) + 0.5 * layer + 0.25 * c


def check_l1(pool: Any, tokens: list[int], pages: np.ndarray, page_size: int) -> None:
    """Every page ``pages[p]`` of L1 holds what was written for the page starting at ``tokens[p * page_size]``."""
    for p, page in enumerate(pages):
        for layer, kv in enumerate(pool.kv):
            for c, t in enumerate(kv):
                assert torch.all(t[int(page)] == kv_value(tokens[p * page_size], layer, c)), (p, layer, c)


def test_library_snippet_runs_through_every_tier(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from hicache import HiCache
    from hicache.cache_types import CacheFullError

    (code,) = blocks(section(README, "Using the library"), "python")
    # the one line a reader fills in: "write the suffix's K/V into cache.device_pool.kv[layer][0/1][new]"
    code, n = re.subn(r"^( +)\.\.\. +# write the suffix's K/V into cache\.device_pool\.kv\[layer\]\[0/1\]\[new\]$",
                      r"\1fill(cache, layer, new)", code, flags=re.M)
    assert n == 1, "README's library snippet changed: update this test"
    head, body = code.split("req = cache.match(tokens)", 1)
    body = "req = cache.match(tokens)" + body
    ps = 4
    monkeypatch.chdir(tmp_path)
    (tmp_path / "hicache.yaml").write_text(yaml.safe_dump({
        "layout": {"num_layers": 2, "num_kv_heads": 2, "head_dim": 4, "dtype": "float32", "page_size": ps},
        "cache": {"l1_tokens": 64, "l2_tokens": 128, "write_policy": "write_through"},
        "storage": {"url": (tmp_path / "l3").as_uri(), "prefetch_threshold_tokens": 0},
    }))
    scope: dict[str, Any] = {}

    def fill(cache: HiCache, layer: int, new: np.ndarray) -> None:
        tokens, first = scope["tokens"], len(scope["tokens"]) // ps - len(new)
        for c, t in enumerate(cache.device_pool.kv[layer]):
            for i, page in enumerate(new):
                t[int(page)] = kv_value(tokens[(first + i) * ps], layer, c)

    def run(code: str, tokens: list[int], n_new_pages: int) -> Any:
        scope.update(tokens=tokens, n_new_pages=n_new_pages, num_layers=2, fill=fill)
        exec(compile(code, "README.md", "exec"), scope)
        cache = scope["cache"]
        pages = np.concatenate([scope["load"].device_indices, scope["new"]])
        assert len(pages) == len(tokens) // ps  # only whole pages: the trailing partial one is recomputed
        check_l1(cache.device_pool, tokens, pages, ps)
        cache.check_integrity()
        return scope["req"]

    a = [1000 + i for i in range(13)]  # 3 whole pages and a partial one
    req = run(head + body, a, 3)
    assert (req.l1_pages, req.l2_pages, req.l3_pages) == (0, 0, 0)
    cache = scope["cache"]
    try:
        cache.evict(l1_pages=3)  # backed up at commit (write_through): L2 keeps them
        b = a[:12] + [2000 + i for i in range(9)]
        req = run(body, b, 2)
        assert (req.l1_pages, req.l2_pages) == (0, 3)
        report = cache.flush()
        assert report is not None and report.complete
        cache.clear()  # L1 and L2 dropped, L3 untouched
        c = b[:20] + [3000 + i for i in range(4)]
        req = run(body, c, 1)
        assert (req.l1_pages, req.l2_pages, req.l3_pages) == (0, 0, 5)

        # pins: kept through clear() until unpinned; a whole load on request
        pin = cache.pin(c)
        assert pin.l1_pages == 6
        cache.clear()
        r = cache.match(c)
        assert r.l1_pages == 6
        load = cache.load_back(r, layer_wise=False)
        load.wait()
        cache.release(r)
        cache.unpin(pin.pin_id)
        assert cache.clear()[0] == 6
        cache.check_integrity()
        assert cache.config.cache.max_pinned_fraction == 0.5
        assert issubclass(CacheFullError, RuntimeError)
    finally:
        cache.close()


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from service.service_harness import start_server

    server = start_server(tmp_path_factory.mktemp("docs"))
    try:
        yield server
    finally:
        try:
            server.terminate(15)
        except subprocess.TimeoutExpired:
            server.proc.kill()


def test_client_snippet_runs_against_a_node(node: Any) -> None:
    from hicache.client import HiCacheClient, RetryPolicy

    code = blocks(section(README, "Serving: `hicache serve`"), "python")[0]
    code, n = re.subn(r"^( +)# the engine writes the suffix's K/V into shared\.pool\.kv\[layer\]\[0/1\]\[new\]$",
                      r"\1fill(shared, new)", code, flags=re.M)
    assert n == 1, "README's client snippet changed: update this test"
    assert code.count('"127.0.0.1:50051"') == 1
    code = code.replace('"127.0.0.1:50051"', f'"{node.target}"')
    ps = node.config["layout"]["page_size"]
    tokens = [500 + i for i in range(2 * ps + 3)]

    def fill(shared: Any, new: np.ndarray) -> None:
        first = len(tokens) // ps - len(new)
        for layer, kv in enumerate(shared.pool.kv):
            for c, t in enumerate(kv):
                for i, page in enumerate(new):
                    t[int(page)] = kv_value(tokens[(first + i) * ps], layer, c)

    scope: dict[str, Any] = {"tokens": tokens, "fill": fill}
    exec(compile(code, "README.md", "exec"), scope)
    assert (scope["m"].l1_pages, scope["m"].num_pages) == (0, 2)
    exec(compile(code, "README.md", "exec"), scope)  # the same prompt again: a hit on L1, served as written
    m = scope["m"]
    assert (m.l1_pages, m.num_pages, len(scope["new"])) == (2, 2, 0)
    with HiCacheClient(node.target, retry=RetryPolicy(attempts=200, max_s=0.25)) as c, c.attach() as shared:
        check_l1(shared.pool, tokens, m.device_indices, ps)
        assert c.stats().open_requests == 0


def test_grpcurl_examples_are_requests_the_node_takes(node: Any) -> None:
    import grpc
    from google.protobuf import json_format
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    from hicache.proto_gen.hicache.v1 import hicache_pb2 as pb
    from hicache.proto_gen.hicache.v1 import hicache_pb2_grpc as pb_grpc

    (code,) = [b for b in blocks(section(README, "Serving: `hicache serve`"), "bash") if "grpcurl" in b]
    calls = [shlex.split(line) for line in code.splitlines() if line.startswith("grpcurl")]
    assert [c[-1] for c in calls if "list" not in c] == [
        "hicache.v1.HiCache/Match", "hicache.v1.HiCache/Stats", "hicache.v1.HiCache/WatchEvents"]
    service = pb.DESCRIPTOR.services_by_name["HiCache"]
    with grpc.insecure_channel(node.target) as channel:
        assert "hicache.v1.HiCache" in ProtoReflectionDescriptorDatabase(channel).get_services()  # `list`
        stub = pb_grpc.HiCacheStub(channel)
        for argv in calls:
            if "-d" not in argv:
                continue
            method = service.methods_by_name[argv[-1].rsplit("/", 1)[1]]
            request = json_format.Parse(argv[argv.index("-d") + 1], getattr(pb, method.input_type.name)())
            call = getattr(stub, method.name)
            if method.server_streaming:
                stream = call(request, timeout=10)
                assert next(stream).sequence >= 0  # the snapshot at subscribe
                stream.cancel()
            else:
                reply = call(request, timeout=10)
                if method.name == "Match":
                    assert reply.num_pages == 0 and reply.request_id == ""  # 4 tokens; a peek opens nothing
    assert "-H authorization: Bearer $TOKEN" in " ".join(calls[2])


def test_engine_snippet_runs_on_cpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from hicache.engine import preset

    code = blocks(section(DOCS["library.md"], "The reference serving node"), "python")[0]
    for old, new in (('preset("llama-8b")', 'preset("tiny")'), ("torch.bfloat16", "torch.float32"),
                     ('device="cuda"', 'device="cpu"')):  # the 8B model on a GPU -> a tiny one on CPU
        assert code.count(old) == 1, f"docs/library.md's engine snippet changed: update this test ({old})"
        code = code.replace(old, new)
    layout = preset("tiny").kv_layout(16, "float32")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "hicache.yaml").write_text(yaml.safe_dump({
        "layout": {"num_layers": layout.num_layers, "num_kv_heads": layout.num_kv_heads,
                   "head_dim": layout.head_dim, "dtype": "float32", "page_size": 16},
        "cache": {"l1_tokens": 1024, "l2_tokens": 1024}}))
    scope: dict[str, Any] = {"doc": list(range(1, 50)), "questions": [[60, 61, 62], [70, 71]]}
    exec(compile(code, "docs/library.md", "exec"), scope)
    try:
        results = scope["results"]
        assert [len(r.output) for r in results] == [8, 8]
        again = scope["node"].generate([scope["GenRequest"](scope["doc"] + [60, 61, 62], max_new_tokens=8)])
        assert again[0].hit_tokens["l1"] >= 48 and again[0].output == results[0].output  # doc's 3 pages hit
    finally:
        scope["node"].port.close()
