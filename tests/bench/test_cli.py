"""``hicache bench`` / ``hicache doctor`` end to end: outputs, and exit code 2 with one line on bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hicache.cli import main

SMALL = ["--requests", "40", "--capacities", "10,100", "--quiet"]


def _one_line_error(capsys: pytest.CaptureFixture[str], *needles: str) -> None:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    for n in needles:
        assert n in err


def test_bench_writes_report_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    assert main(["bench", *SMALL, "--workload", "rag", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "Hit rate by tier" in text and "offline optimum" in text and "advice:" in text
    assert "background copies finished" in " ".join(text.split())  # settled: the in-process default
    res = json.loads((out / "result.json").read_text())
    assert res["requests"] == 40 and res["settled"] is True
    assert 0 < res["hit_rate"] <= res["optimal_same_capacity"] + 1e-9 <= res["infinite"] + 2e-9
    assert len(res["curve"]) == 2 and res["curve"][1]["policy"] == pytest.approx(res["infinite"])
    assert (out / "requests.csv").read_text().count("\n") == 41
    assert (out / "hit_rate.png").read_bytes()[:4] == b"\x89PNG"


def test_bench_trace_and_doctor(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "t.jsonl"
    rows = [{"timestamp": i, "prompt": f"Now: 2026-12-02 10:00:{i:02d}\nYou are a helpful assistant. " * 1
             + "Reference text about cache hierarchies and prefix sharing. " * 20 + f"Question {i}?"}
            for i in range(30)]
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["bench", "--trace", str(trace), "--page-size", "4", "--l3", "none", "--doctor", "--quiet",
                 "--capacities", "", "--json", str(tmp_path / "r.json")]) == 0
    out = capsys.readouterr().out
    assert "timestamp" in out
    doc = json.loads((tmp_path / "r.json").read_text())["doctor"]
    assert doc["groups"][0]["kind"] == "timestamp" and doc["after_infinite"] > doc["before_infinite"]
    assert main(["doctor", "--trace", str(trace), "--page-size", "4"]) == 0


def test_bad_json_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "bad.jsonl"
    trace.write_text('{"tokens": [1, 2]}\n{"tokens": [3]}\n{oops\n')
    assert main(["bench", "--trace", str(trace), "--quiet"]) == 2
    _one_line_error(capsys, f"{trace}:3", "not valid JSON")


@pytest.mark.parametrize(("argv", "needles"), [
    (["bench", "--trace", "/nonexistent/trace.jsonl"], ["/nonexistent/trace.jsonl", "no such file"]),
    (["bench", "--workload", "chat"], ["unknown workload 'chat'"]),
    (["bench", "--l1", "lots"], ["--l1", "not a size"]),
    (["bench", "--eviction-policy", "random"], ["unknown policy"]),
    (["bench", "--target", "tcp://x"], ["--target"]),
    (["bench", "--target", "grpc://h:99999"], ["--target grpc://h:99999", "out of range"]),
    (["bench", "--target", "grpc://::1:5"], ["--target", "needs brackets"]),
    (["doctor", "--trace", "/nonexistent/t.jsonl"], ["no such file"]),
    (["doctor", "--workload", "chat"], ["unknown workload"]),
    (["bench", "--requests", "20", "--l3", "ftp://x"], ["unknown scheme 'ftp'"]),
    (["bench", "--requests", "20", "--seed", "-1"], ["non-negative"]),
    (["bench", "--requests", "20", "--l3", "nonsense"], ["--l3 'nonsense'"]),
    (["bench", "--requests", "20", "--l3", "file://relative/x"], ["use file:///absolute/path"]),
    (["bench", "--requests", "20", "--prefill-rate", "nan"], ["--prefill-rate"]),
    (["doctor", "--page-size", "-5"], ["--page-size"]),
])
def test_bad_input_exits_2(argv: list[str], needles: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*argv, "--quiet"] if argv[0] == "bench" else argv) == 2
    _one_line_error(capsys, *needles)


def test_measured_prefill_rate(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", *SMALL, "--model-layout", "tiny", "--prefill-rate", "measure", "--l3", "none"]) == 0
    out = capsys.readouterr().out
    assert "measured prefill:" in out and "tiny shape" in out
    assert main(["bench", *SMALL, "--prefill-rate", "fast"]) == 2
    _one_line_error(capsys, "--prefill-rate", "'fast'")


def test_settle_defaults_and_flag(tmp_path: Path) -> None:
    from hicache.bench.run import BenchOptions

    assert BenchOptions().settles
    assert not BenchOptions(follow_timestamps=True).settles
    assert BenchOptions(target="grpc://127.0.0.1:1").settles  # through the node's Flush
    assert not BenchOptions(settle=False).settles and BenchOptions(follow_timestamps=True, settle=True).settles
    out = tmp_path / "out"
    assert main(["bench", *SMALL, "--workload", "rag", "--no-settle", "--json", str(out / "r.json")]) == 0
    assert json.loads((out / "r.json").read_text())["settled"] is False


def test_outputs_never_overwrite_the_trace(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--json`` or ``--out`` naming the trace being read is refused before anything is written."""
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"tokens": [1, 2, 3, 4]}\n{"tokens": [1, 2, 3, 5]}\n')
    before = trace.read_bytes()
    for argv in (["bench", "--trace", str(trace), "--json", str(trace), "--quiet"],
                 ["doctor", "--trace", str(trace), "--json", str(trace)],
                 ["bench", "--trace", str(tmp_path / "requests.csv"), "--out", str(tmp_path), "--quiet"]):
        if argv[2].endswith("requests.csv"):
            (tmp_path / "requests.csv").write_bytes(before)
        assert main(argv) == 2
        _one_line_error(capsys, "is the trace being read")
        assert trace.read_bytes() == before
    assert (tmp_path / "requests.csv").read_bytes() == before


@pytest.mark.parametrize("line", ['{"tokens": [99999999999999999999999]}',
                                  '{"timestamp": 0, "input_length": 600, "output_length": 1, '
                                  '"hash_ids": [1, 18446744073709551616]}',
                                  '{"tokens": [1, 2], "timestamp": -1}'])
def test_out_of_range_trace_values_exit_2(line: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text(line + "\n")
    assert main(["bench", "--trace", str(trace), "--quiet"]) == 2
    _one_line_error(capsys, f"{trace}:1")


@pytest.mark.parametrize("l3", ["redis://127.0.0.1:{port}/0", "file:///proc/hicache-not-here"])
def test_l3_that_does_not_answer_exits_2_before_replay(l3: str, capsys: pytest.CaptureFixture[str]) -> None:
    from hicache.storage.redis_local import free_port

    url = l3.format(port=free_port())
    assert main(["bench", *SMALL, "--l3", url]) == 2
    _one_line_error(capsys, f"--l3 {url}", "does not answer")


def test_l3_error_does_not_print_the_password(capsys: pytest.CaptureFixture[str]) -> None:
    from hicache.storage.redis_local import free_port

    port = free_port()
    assert main(["bench", *SMALL, "--l3", f"redis://:hunter2@127.0.0.1:{port}/0"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"--l3 redis://127.0.0.1:{port}/0" in err, err
    assert "does not answer" in err and "hunter2" not in err


def test_trace_mixing_formats_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "mixed.jsonl"
    trace.write_text('{"tokens": [1, 2, 3, 4]}\n{"tokens": [1, 2, 3, 5]}\n'
                     '{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [7]}\n')
    assert main(["bench", "--trace", str(trace), "--quiet"]) == 2
    _one_line_error(capsys, f"{trace}:3", "the format changes here", "line 1")
