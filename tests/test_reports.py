"""Report writers: JSON schema and key order, JUnit XML, Prometheus text format, atomic private files."""

from __future__ import annotations

import io
import json
import os
import re
import stat
import xml.etree.ElementTree as ET
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path

import pytest
from rich.console import Console

from fleetcuda.reports.formats import (
    SCHEMA,
    RunInfo,
    escape_label_value,
    render_table,
    to_json,
    to_junit,
    to_prometheus,
    write_atomically,
)
from fleetcuda.run.engine import StepResult, TargetResult, exit_code

T0 = datetime(2025, 6, 1, 3, 0, 0, tzinfo=UTC)
NASTY_TAIL = ["nvcc: release 12.6, V12.6.77", "\x1b[31merror\x1b[0m [/red] <tag> & \"quoted\" \x00 end"]


def make_results() -> list[TargetResult]:
    return [
        TargetResult("pve-gpu1/200", "ok", [
            StepResult("cuda-keyring", "ok", 0.2, "verified", expected="cuda-keyring installed",
                       found="ii  cuda-keyring 1.1-1"),
            StepResult("cuda-compiler", "ok", 0.41, "verified", expected="nvcc reports release 12.8",
                       found="Cuda compilation tools, release 12.8, V12.8.93"),
        ], None, "/state/runs/r/pve-gpu1_200.log", 3.25),
        TargetResult("pve-gpu1/201", "drift", [
            StepResult("cuda-keyring", "ok", 0.2, "verified", expected="cuda-keyring installed",
                       found="ii  cuda-keyring 1.1-1"),
            StepResult("cuda-compiler", "drift", 0.4, "verification failed", list(NASTY_TAIL),
                       expected="nvcc reports release 12.8", found="Cuda compilation tools, release 12.6, V12.6.77"),
            StepResult("fast-path", "skipped", 0.0, "when: require_gpu is false"),
            StepResult("fla-core", "failed", 1.5, "check: not satisfied", ["ImportError: fla"],
                       expected="fla imports", found="ImportError: fla"),
        ], None, "/state/runs/r/pve-gpu1_201.log", 4.0),
        TargetResult("lab-b/300", "unreachable", [], "lab-b/300: ssh: connect to host 10.250.2.2 port 22: "
                     "No route to host", "/state/runs/r/lab-b_300.log", 10.0),
    ]


def make_info(results: list[TargetResult]) -> RunInfo:
    return RunInfo(mode="verify", recipe_path="recipes/gdn-fastpath.yaml", recipe_name="gdn-fastpath",
                   inventory_path="inventories/lab.yaml", started_at=T0, finished_at=T0 + timedelta(seconds=72.5),
                   exit_code=exit_code(results), run_dir="/state/runs/r", version="0.1.0")


# -- RunInfo ------------------------------------------------------------------------------------


def test_run_info_needs_aware_datetimes_and_stores_utc() -> None:
    with pytest.raises(ValueError, match="timezone-aware"):
        RunInfo("verify", "r.yaml", "r", "i.yaml", datetime(2025, 6, 1), T0, 0)
    plus2 = timezone(timedelta(hours=2))
    info = RunInfo("verify", "r.yaml", "r", "i.yaml", datetime(2025, 6, 1, 5, 0, tzinfo=plus2),
                   datetime(2025, 6, 1, 5, 1, tzinfo=plus2), 0)
    assert info.started_at == T0 and info.started_at.tzinfo is UTC
    assert info.duration_s == 60.0


# -- JSON ---------------------------------------------------------------------------------------


def test_json_schema_keys_order_and_values() -> None:
    results = make_results()
    text = to_json(make_info(results), results)
    assert text.endswith("}\n")
    doc = json.loads(text)
    assert list(doc) == ["schema", "fleetcuda_version", "mode", "recipe", "inventory", "started_at", "finished_at",
                         "duration_s", "exit_code", "run_dir", "summary", "targets"]
    assert doc["schema"] == SCHEMA == "fleetcuda.verify/1"
    assert doc["recipe"] == {"name": "gdn-fastpath", "path": "recipes/gdn-fastpath.yaml"}
    assert (doc["started_at"], doc["finished_at"], doc["duration_s"]) == ("2025-06-01T03:00:00Z",
                                                                          "2025-06-01T03:01:12Z", 72.5)
    assert doc["exit_code"] == 1
    assert doc["summary"] == {
        "targets": 3,
        "target_status": {"ok": 1, "changed": 0, "would-change": 0, "drift": 1, "failed": 0, "unreachable": 1,
                          "interrupted": 0, "skipped": 0},
        "checks": 6,
        "check_status": {"ok": 3, "changed": 0, "skipped": 1, "would-change": 0, "drift": 1, "failed": 1},
    }
    assert list(doc["summary"]["target_status"]) == ["ok", "changed", "would-change", "drift", "failed",
                                                     "unreachable", "interrupted", "skipped"]
    for target in doc["targets"]:
        assert list(target) == ["target", "status", "error", "duration_s", "log", "checks"]
        for check in target["checks"]:
            base = ["step", "status", "detail", "expected", "found", "duration_s"]
            if check["status"] in ("drift", "failed"):
                assert list(check) == [*base, "output_tail"]
            else:
                assert list(check) == base
    drift = doc["targets"][1]["checks"][1]
    assert drift == {"step": "cuda-compiler", "status": "drift", "detail": "verification failed",
                     "expected": "nvcc reports release 12.8",
                     "found": "Cuda compilation tools, release 12.6, V12.6.77", "duration_s": 0.4,
                     "output_tail": NASTY_TAIL}
    unreachable = doc["targets"][2]
    assert unreachable["status"] == "unreachable" and unreachable["checks"] == []
    assert unreachable["error"].startswith("lab-b/300: ssh")


def test_json_is_stable_and_counts_unknown_statuses_after_the_fixed_ones() -> None:
    results = make_results() + [TargetResult("x/1", "pending")]
    info = make_info(results)
    assert to_json(info, results) == to_json(info, results)
    status = json.loads(to_json(info, results))["summary"]["target_status"]
    assert list(status)[-1] == "pending" and status["pending"] == 1


# -- JUnit --------------------------------------------------------------------------------------


def test_junit_parses_with_right_counts() -> None:
    results = make_results()
    text = to_junit(make_info(results), results)
    root = ET.fromstring(text.encode("utf-8"))
    assert root.tag == "testsuites"
    assert {k: root.get(k) for k in ("tests", "failures", "errors", "skipped")} == \
        {"tests": "7", "failures": "2", "errors": "1", "skipped": "1"}
    suites = root.findall("testsuite")
    assert [s.get("name") for s in suites] == ["pve-gpu1/200", "pve-gpu1/201", "lab-b/300"]

    ok, drift, unreachable = suites
    assert ok.get("failures") == "0" and len(ok.findall("testcase")) == 2
    assert not ok.findall(".//failure") and not ok.findall(".//error")

    assert {k: drift.get(k) for k in ("tests", "failures", "errors", "skipped")} == \
        {"tests": "4", "failures": "2", "errors": "0", "skipped": "1"}
    cases = {c.get("name"): c for c in drift.findall("testcase")}
    assert list(cases) == ["cuda-keyring", "cuda-compiler", "fast-path", "fla-core"]
    failure = cases["cuda-compiler"].find("failure")
    assert failure is not None
    assert failure.get("message") == "drift: verification failed" and failure.get("type") == "drift"
    body = failure.text or ""
    assert "expected: nvcc reports release 12.8" in body
    assert "found: Cuda compilation tools, release 12.6, V12.6.77" in body
    assert "nvcc: release 12.6, V12.6.77" in body
    # Characters XML cannot carry are spelled out; markup-like text survives escaping.
    assert '\\x1b[31merror\\x1b[0m [/red] <tag> & "quoted" \\x00 end' in body
    assert "full log: /state/runs/r/pve-gpu1_201.log" in body
    assert cases["fla-core"].find("failure") is not None
    skipped = cases["fast-path"].find("skipped")
    assert skipped is not None and skipped.get("message") == "when: require_gpu is false"
    assert cases["cuda-keyring"].find("failure") is None

    only = unreachable.findall("testcase")
    assert len(only) == 1 and only[0].get("name") == "(target)"
    error = only[0].find("error")
    assert error is not None and error.get("type") == "unreachable"
    assert "No route to host" in (error.get("message") or "")
    assert unreachable.get("errors") == "1" and unreachable.get("failures") == "0"


def test_junit_reports_a_target_error_outside_its_checks() -> None:
    results = [TargetResult("gpu-box", "failed", [StepResult("a", "ok", 0.1)], "template: undefined 'x'", None, 1),
               TargetResult("pve/1", "interrupted", [StepResult("a", "ok", 0.1)], "interrupted", None, 1)]
    root = ET.fromstring(to_junit(make_info(results), results).encode())
    assert root.get("errors") == "2" and root.get("failures") == "0" and root.get("tests") == "4"


# -- Prometheus ---------------------------------------------------------------------------------

_NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
_LABEL = r'[a-zA-Z_][a-zA-Z0-9_]*="(?:\\[\\"n]|[^"\\\n])*"'
_VALUE = r"[-+]?(?:[0-9]+(?:\.[0-9]*)?(?:[eE][-+]?[0-9]+)?|NaN|Inf)"
SAMPLE = re.compile(rf"({_NAME})(?:\{{({_LABEL}(?:,{_LABEL})*)?\}})? ({_VALUE})")
HELP = re.compile(rf"# HELP ({_NAME}) .*")
TYPE = re.compile(rf"# TYPE ({_NAME}) (counter|gauge|histogram|summary|untyped)")


def parse_prometheus(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Check the text format's grammar line by line and return {(metric, labels): value}."""
    assert text.endswith("\n")
    samples: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    typed: list[str] = []
    for line in text.splitlines():
        if line.startswith("# HELP"):
            assert HELP.fullmatch(line), line
        elif line.startswith("# TYPE"):
            m = TYPE.fullmatch(line)
            assert m, line
            assert m.group(1) not in typed, f"TYPE twice for {m.group(1)}"
            typed.append(m.group(1))
        else:
            m = SAMPLE.fullmatch(line)
            assert m, f"not a sample line: {line!r}"
            name = m.group(1)
            assert typed and typed[-1] == name, f"{name} outside its family"
            labels = tuple((k, re.sub(r'\\([\\"n])', lambda e: "\n" if e.group(1) == "n" else e.group(1), v))
                           for k, v in re.findall(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:\\[\\"n]|[^"\\\n])*)"',
                                                  m.group(2) or ""))
            key = (name, labels)
            assert key not in samples, f"duplicate series {key}"
            samples[key] = float(m.group(3))
    return samples


def test_prometheus_lines_follow_the_exposition_grammar() -> None:
    results = make_results()
    info = make_info(results)
    samples = parse_prometheus(to_prometheus(info, results))
    r = ("recipe", "gdn-fastpath")

    def t(target: str) -> tuple[tuple[str, str], ...]:
        return (r, ("target", target))

    assert samples[("fleetcuda_verify_check_ok", (*t("pve-gpu1/200"), ("step", "cuda-compiler")))] == 1
    assert samples[("fleetcuda_verify_check_ok", (*t("pve-gpu1/201"), ("step", "cuda-compiler")))] == 0
    assert samples[("fleetcuda_verify_check_ok", (*t("pve-gpu1/201"), ("step", "fla-core")))] == 0
    assert ("fleetcuda_verify_check_ok", (*t("pve-gpu1/201"), ("step", "fast-path"))) not in samples  # skipped
    assert samples[("fleetcuda_verify_target_up", t("pve-gpu1/201"))] == 1
    assert samples[("fleetcuda_verify_target_up", t("lab-b/300"))] == 0
    assert samples[("fleetcuda_verify_target_ok", t("pve-gpu1/200"))] == 1
    assert samples[("fleetcuda_verify_target_ok", t("pve-gpu1/201"))] == 0
    assert samples[("fleetcuda_verify_target_drift_checks", t("pve-gpu1/201"))] == 2
    assert samples[("fleetcuda_verify_target_drift_checks", t("pve-gpu1/200"))] == 0
    assert samples[("fleetcuda_verify_last_run_timestamp_seconds", (r,))] == (T0 + timedelta(seconds=72.5)).timestamp()
    assert samples[("fleetcuda_verify_last_run_duration_seconds", (r,))] == 72.5
    assert samples[("fleetcuda_verify_exit_code", (r,))] == 1


def test_prometheus_escapes_label_values() -> None:
    assert escape_label_value('a\\b"c\nd') == 'a\\\\b\\"c\\nd'
    odd = 'we"ird\\name\nx'
    results = [TargetResult(odd, "ok", [StepResult('st"ep', "ok", 0.5)], None, None, 1.0),
               TargetResult(odd, "ok", [StepResult('st"ep', "ok", 0.5)], None, None, 1.0)]  # duplicate: dropped
    info = RunInfo("verify", "r.yaml", "re\"cipe", "i.yaml", T0, T0, 0)
    text = to_prometheus(info, results)
    assert 'target="we\\"ird\\\\name\\nx"' in text
    samples = parse_prometheus(text)
    assert samples[("fleetcuda_verify_check_ok", (("recipe", 're"cipe'), ("target", odd), ("step", 'st"ep')))] == 1


# -- files --------------------------------------------------------------------------------------


def test_write_atomically_is_private_and_replaces(tmp_path: Path) -> None:
    old_umask = os.umask(0)  # even with a permissive umask the report is private
    try:
        path = write_atomically(tmp_path / "report.json", "one\n")
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        write_atomically(str(path), "two\n")
        assert path.read_text() == "two\n" and stat.S_IMODE(path.stat().st_mode) == 0o600
        prom = write_atomically(tmp_path / "fleetcuda.prom", "x 1\n", mode=0o644)
        assert stat.S_IMODE(prom.stat().st_mode) == 0o644
    finally:
        os.umask(old_umask)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fleetcuda.prom", "report.json"]  # no temp files left


def test_write_atomically_leaves_nothing_on_failure(tmp_path: Path) -> None:
    (tmp_path / "dir").mkdir()
    with pytest.raises(IsADirectoryError):
        write_atomically(tmp_path / "dir", "x")
    assert [p.name for p in tmp_path.iterdir()] == ["dir"]
    with pytest.raises(FileNotFoundError):
        write_atomically(tmp_path / "missing" / "report.json", "x")


# -- terminal -----------------------------------------------------------------------------------


def test_render_table_prints_remote_text_literally() -> None:
    results = make_results()
    buf = io.StringIO()
    console = Console(file=buf, width=200, color_system=None, force_terminal=False)
    render_table(make_info(results), results, console)
    out = buf.getvalue()
    for text in ("pve-gpu1/201", "cuda-compiler", "nvcc reports release 12.8",
                 "Cuda compilation tools, release 12.6, V12.6.77", "[/red] <tag>", "No route to host",
                 "full log: /state/runs/r/pve-gpu1_201.log", "3 target(s): 1 ok, 1 drift, 1 unreachable; exit 1"):
        assert text in out, text
