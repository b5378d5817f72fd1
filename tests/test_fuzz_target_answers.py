"""A target's bad answer is that target's failure, never the run's (issue 22, item 7).

`doctor` with a venv that has no interpreter died with `KeyError: 'version'` (exit 70) and lost the other targets'
reports: the probe's record was read as an untyped dict. Here: that case as a user meets it, then a fuzz of CLI
inputs (argv, inventory, recipe and what each target answers, on the fake connector) through `cli.main(argv, env)`
in this process, asserting that none ends in exit 70 (or any code README does not list) or an internal error.

FLEETCUDA_FUZZ_CLI_INPUTS=N runs N inputs (default 2,500: ~30 s on 2 idle cores; 10,000 were run
by hand, see docs/reliability.md); FLEETCUDA_FUZZ_SEED picks other inputs.
"""

from __future__ import annotations

import io
import json
import os
import random
from pathlib import Path
from typing import Any

import pytest

from fleetcuda.cli import Environment, common, main
from fleetcuda.connectors.base import RunResult
from fleetcuda.connectors.fake import Call, FakeTransport, framed, ok
from fleetcuda.results import ExitStatus
from tests.test_cli_doctor_model import cli, frame, probe  # noqa: F401  (fixture)
from tests.test_cli_inprocess import Cli

EXIT_CODES = {0, 1, 2, 3}

# -- the case as a user met it ----------------------------------------------------------------------------------

TWO = "hosts:\n  h:\n    address: 10.0.0.1\n    user: root\n    containers:\n      201:\n        venv: /root/novenv\n" \
      "      202:\n        venv: /root/venv\n"


def test_doctor_with_a_venv_without_an_interpreter_fails_that_target_and_reports_the_others(
        cli: Cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    fake = FakeTransport()

    def reply(call: Call) -> RunResult:
        if call.step == "fleetcuda-doctor" or "gpu_passthrough" in call.script:  # the host's GPU check answers
            return ok(framed(call, "gpu", {"driver": "570.1", "libs": {}, "failures": []}))
        if call.place == 201:  # bash: the venv's python is not there; no frame
            return ok("fleetcuda: line 2: /root/novenv/bin/python: No such file or directory\n")
        doctor, gate = probe(set())
        return ok(frame(call, "doctor", doctor) + frame(call, "gate", gate))

    fake.on(kind="run", reply=reply)
    monkeypatch.setattr(common, "transport_factory", lambda inventory: lambda host: fake)
    inv = tmp_path / "inv.yaml"
    inv.write_text(TWO)
    for fmt in ("table", "json"):
        got = cli("doctor", "-i", inv, "--format", fmt)
        assert got.code == ExitStatus.FAILED, got.err  # that target failed; not exit 70
        assert "internal error" not in got.err
        assert "h/201" in got.out and "h/202" in got.out  # both targets reported
        assert "No such file or directory" in got.out
        if fmt == "json":
            doc = json.loads(got.out)
            assert any(f["status"] == "fail" for f in doc["h/201"]["findings"])
            assert {"torch", "nvcc"} <= {f["check"].split()[0] for f in doc["h/202"]["findings"]}


# -- the fuzz ---------------------------------------------------------------------------------------------------

MODULE = "transformers.models.qwen3_5.modeling_qwen3_5"
WEIRD: list[Any] = [None, True, False, 0, -1, 1.5, "", "x", "2.11.0[/]", "[bold]x[/]", "\x1b[2J", "\u202e", [],
                    {}, [1, "a"], {"error": 3}, {"version": None}, {"error": "E"}, "9" * 200, {"a": {"b": []}}]


def mutate(rng: random.Random, value: Any, depth: int = 0) -> Any:
    """`value` with a few of its parts replaced, removed or retyped (the record a broken probe might print)."""
    if rng.random() < 0.15:
        return rng.choice(WEIRD)
    if isinstance(value, dict) and depth < 6:
        out = {}
        for k, v in value.items():
            r = rng.random()
            if r < 0.1:
                continue  # a field missing
            out[k] = mutate(rng, v, depth + 1) if r < 0.5 else v
        if rng.random() < 0.1:
            out[rng.choice(["error", "version", "extra", "style"])] = rng.choice(WEIRD)
        return out
    if isinstance(value, list) and depth < 6:
        return [mutate(rng, v, depth + 1) for v in value if rng.random() > 0.1]
    return value


def good_records() -> dict[str, Any]:
    doctor, gate = probe(set())
    flag_gate = {"version": "4.57.0", "modules": {MODULE: {"style": "flag", "is_fast_path_available": True}}}
    gpu = {"driver": "570.1", "libs": {"libcuda.so.1": "570.1"}, "failures": [], "devices": ["/dev/nvidia0"]}
    return {"doctor": doctor, "gate": gate, "flag_gate": flag_gate, "gpu": gpu}


def answer(rng: random.Random, call: Call, records: dict[str, Any]) -> RunResult:
    """What a target says to one command: its records (mutated), text, nothing, another nonce, a bad status."""
    parts: list[str] = []
    r = rng.random()
    if call.cmd is None or call.batched:  # a check inside a batch: its own words, framed by the fake
        parts.append(rng.choice(["", "ok\n", "2.11.0[/]\n", "\x1b]8;;x\x07\n", "[link=http://x]y[/link]\n"]))
    elif r < 0.1:
        parts.append(rng.choice(["", "bash: python: command not found\n", "\x00\xff\n", "@@fleetcuda:0000 doctor {}\n",
                                 "| " * 50 + "\n"]))
    else:
        for kind, record in (("doctor", "doctor"), ("gate", rng.choice(["gate", "flag_gate"])), ("gpu", "gpu")):
            if rng.random() < 0.8:
                value = mutate(rng, records[record])
                text = json.dumps(value, separators=(",", ":")).replace(" ", "\\u0020")
                if rng.random() < 0.05:
                    text = text[: rng.randrange(len(text) + 1)]  # cut off
                parts.append(framed(call, kind, text))
    rc = rng.choice([0, 0, 0, 0, 1, 2, 124, 126, 127, 137, 255])
    return RunResult(rc, "".join(parts), rng.random() / 100, timed_out=rc == 124 and rng.random() < 0.5)


INVENTORIES = [
    TWO,
    "vars:\n  check_gpu: false\nhosts:\n  h:\n    address: 10.0.0.1\n    containers:\n      201: {}\n",
    "hosts:\n  a:\n    address: 10.0.0.1\n    venv: /v\n  b:\n    address: 10.0.0.2\n    vars:\n"
    "      gpu_devices_required: 'false'\n",
    "hosts:\n  h:\n    address: 10.0.0.1\n    sudo: true\n    containers:\n      200: {name: c, venv: /root/venv}\n"
    "      300: {python: /usr/bin/python3}\n",
]
RECIPES = [
    "name: r\nsteps:\n  - name: s\n    check: 'true'\n",
    "name: r\nvars:\n  cuda_version: auto\nfacts:\n  cuda_version: echo 12.8\nsteps:\n  - name: s\n"
    "    check: test -n \"{{ cuda_version }}\"\n  - name: t\n    verify: 'true'\n    when: cuda_version == 12.8\n",
    "name: r\nvars:\n  api_token: auto\nfacts:\n  api_token: cat /k\nsteps:\n  - name: s\n"
    "    check: test -n \"{{ api_token }}\"\n    apply: 'true'\n",
]
QWEN = {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
        "text_config": {"model_type": "qwen3_5_text", "num_hidden_layers": 8,
                        "layer_types": ["linear_attention", "linear_attention", "linear_attention",
                                        "full_attention"] * 2}}
FACTS = ["12.8", "13.0", "", " ", "a/b+c=", "x" * 300, "$(id)", "1\n2", "\x1b[31m", "[bold]", "auto", "0"]


def one_input(rng: random.Random, root: Path) -> list[str]:
    """Write this input's inventory and recipe (sometimes mutated text) and return its argv."""
    inv = rng.choice(INVENTORIES)
    recipe = rng.choice(RECIPES)
    if rng.random() < 0.1:
        i = rng.randrange(len(inv))
        inv = inv[:i] + rng.choice(["\n", ":", " [", "{{ x }}", "\t", "'"]) + inv[i + 1:]
    (root / "inv.yaml").write_text(inv)
    (root / "r.yaml").write_text(recipe)
    command = rng.choice(["doctor", "doctor", "doctor", "doctor-model", "verify", "check", "discover"])
    extra: list[str] = []
    if command == "discover":
        (root / "out.yaml").write_text(inv)
        host = "nope" if rng.random() < 0.1 else "h" if "\n  h:\n" in inv else "a"
        argv = ["discover", host, "-i", str(root / "inv.yaml")]
        argv += rng.choice([[], ["--format", "json"], ["--write", str(root / "out.yaml")]])
        return argv
    if rng.random() < 0.2:
        extra += ["--limit", rng.choice(["h", "h/201", "a", "*", "nope", "c"])]
    if command.startswith("doctor"):
        argv = ["doctor", "-i", str(root / "inv.yaml"), "--format", rng.choice(["table", "json"])]
        if command == "doctor-model":
            argv += ["--model", str(root / "config.json")]
        return argv + extra
    argv = ["verify" if command == "verify" else "apply", str(root / "r.yaml"), "-i", str(root / "inv.yaml"),
            "--plain"] + (["--no-history"] if command == "verify" else [])
    if command == "check":
        argv.append("--check")
    if rng.random() < 0.3:
        argv += ["--format", "json"] if command == "verify" else ["--show-output"]
    return argv + extra


STATUSES = ["running", "stopped", "stop\u202eped", "st\x1bop", "[/]", "[link=x]y", "", "mounted", "a" * 50]
NAMES = ["gpu-a", "g[/]", "x\u2028y", "\x1b[2J", "ok-name", "name with space"]


def discover_reply(rng: random.Random, call: Call) -> RunResult:
    """What discover's probes print: a `pct list` of odd rows and configs, then the containers' environments."""
    from tests.discover_support import DEV_CONFIG, LIST_HEADER, ROW, VENV_TORCH, envs_reply, host_reply

    if call.label == "fleetcuda-discover":
        rows = {rng.choice([200, 201, 202, 99999]): (rng.choice(STATUSES), rng.choice(["", "backup", "\u202e"]),
                                                      rng.choice(NAMES)) for _ in range(rng.randint(0, 3))}
        listing = (LIST_HEADER + "".join(ROW % (v, *r) for v, r in sorted(rows.items()))) if rows else ""
        if rng.random() < 0.1:
            listing = rng.choice(["garbage\n", LIST_HEADER + "x y z\n", "\x1b[2J\n"])
        configs: dict[int, Any] = {v: rng.choice([DEV_CONFIG.format(name=r[2], vmid=v), "arch: amd64\n", "\x00:\n",
                                                  (255, "", "no config\n")]) for v, r in rows.items()}
        try:
            return host_reply(listing, configs, done=rng.random() < 0.9)(call)
        except (ValueError, IndexError):  # (the stand-in reads the vmid from a garbage row)
            return ok("")
    mutated = mutate(rng, list(VENV_TORCH))
    env = tuple(mutated) if isinstance(mutated, list) else (str(mutated),)
    return envs_reply(*([tuple(str(x) for x in env)] if rng.random() < 0.8 else []))(call)


def run_one(rng: random.Random, root: Path, records: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    argv = one_input(rng, root)
    fake = FakeTransport(facts={"cuda_version": rng.choice(FACTS), "api_token": rng.choice(FACTS)})
    lock = __import__("threading").Lock()

    def reply(call: Call) -> RunResult:
        with lock:  # the engine calls from a thread per target: one rng, drawn in turn
            if call.label.startswith("fleetcuda-discover"):
                return discover_reply(rng, call)
            return answer(rng, call, records)

    fake.on(kind="run", reply=reply)
    monkeypatch.setattr(common, "transport_factory", lambda inventory: lambda host: fake)
    out, err = io.StringIO(), io.StringIO()
    environ = {"PATH": os.environ.get("PATH", "/bin"), "FLEETCUDA_DEBUG": "1", "COLUMNS": "120"}
    env = Environment.with_streams(out, err, io.StringIO(), environ=environ,
                                   home=root, cwd=root, state_dir=root / "state", stdout_is_terminal=rng.random() < 0.2)
    try:
        code = main(argv, env)
    except SystemExit as exc:
        code = int(exc.code or 0)
    shown = f"argv={argv!r}\nexit {code}\nstdout: {out.getvalue()[-1500:]}\nstderr: {err.getvalue()[-1500:]}"
    assert code in EXIT_CODES, shown
    assert "internal error" not in err.getvalue() and "Traceback" not in err.getvalue(), shown


def test_fuzz_cli_inputs_and_target_answers_never_exit_70(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLEETCUDA_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("FLEETCUDA_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("FLEETCUDA_INVENTORY", raising=False)
    (tmp_path / "config.json").write_text(json.dumps(QWEN))
    import argparse  # speed only, as tests/test_fuzz_inputs.py: no translation catalogs looked up per parser

    monkeypatch.setattr(argparse, "_", lambda text: text)
    monkeypatch.setattr(argparse, "ngettext", lambda one, many, n: one if n == 1 else many)
    records = good_records()
    count = int(os.environ.get("FLEETCUDA_FUZZ_CLI_INPUTS") or 2500)
    rng = random.Random(int(os.environ.get("FLEETCUDA_FUZZ_SEED") or 22))
    for _ in range(count):
        run_one(rng, tmp_path, records, monkeypatch)
