"""`fleetcuda doctor --model` through `cli.main(argv, env)` in this process, on the fake connector: one container
whose fast path is whole, one where causal_conv1d does not import (the seeds' 48 of 64 layers), what a user reads
(the exit status, the per-target lines, the JSON) and that a config it cannot read stops it before any round trip."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from fleetcuda.cli import common
from fleetcuda.connectors.base import RunResult
from fleetcuda.connectors.fake import Call, FakeTransport, framed, ok
from fleetcuda.results import ExitStatus
from tests.test_cli_inprocess import Cli

# No GPU passthrough check here (its own round trip, on the host): what is counted is what --model adds.
INVENTORY = ("vars:\n  check_gpu: false\nhosts:\n  h:\n    address: 10.0.0.1\n    user: root\n    containers:\n"
             "      201:\n        venv: /root/venv\n      202:\n        venv: /root/venv\n")
MODULE = "transformers.models.qwen3_5.modeling_qwen3_5"
FUNCTIONS = {"causal_conv1d_fn": ("causal_conv1d", "causal_conv1d.cpp_functions.causal_conv1d_fn"),
             "causal_conv1d_update": ("causal_conv1d", "causal_conv1d.cpp_functions.causal_conv1d_update"),
             "chunk_gated_delta_rule": ("fla", "fla.ops.gated_delta_rule.chunk.chunk_gated_delta_rule"),
             "fused_recurrent_gated_delta_rule": ("fla", "fla.ops.gated_delta_rule.fused_recurrent."
                                                         "fused_recurrent_gated_delta_rule")}
NO_CONV = "ModuleNotFoundError: No module named 'causal_conv1d'"


def probe(missing: set[str]) -> tuple[dict, dict]:
    """What doctor_probe and fast_path_gate (transformers 5.24, one function at a time) report on an H200 container
    where the packages in `missing` do not import."""
    doctor = {"python": "3.12.3", "cuda_home": "", "gpus": "NVIDIA H200, 9.0", "cached_causal_conv1d": [],
              "nvcc": [{"where": "/usr/local/cuda-13.0", "path": "/usr/local/cuda-13.0/bin/nvcc", "release": "13.0"}],
              "torch": {"version": "2.11.0+cu130", "cuda": "13.0", "gpu": True, "arch_list": ["sm_90"],
                        "capability": "9.0", "installed_at": 1.0},
              "causal_conv1d": {"error": NO_CONV} if "causal_conv1d" in missing else {"version": "1.7.0",
                                                                                      "kernel": "ran"},
              "fla": {"version": "0.6.0", "kernel": "ran"}}
    picked = {f: f"{MODULE}.{f}" if package in missing else impl for f, (package, impl) in FUNCTIONS.items()}
    fast = {f: not where.startswith("transformers.") for f, where in picked.items()}
    gate = {"version": "5.24.0", "modules": {MODULE: {"style": "wrapped", "functions": picked, "fast": fast}}}
    return doctor, gate


def frame(call: Call, kind: str, value: dict) -> str:
    """A JSON frame as the programs' emit_json writes it (no whitespace: a space is \\u0020)."""
    return framed(call, kind, json.dumps(value, sort_keys=True, separators=(",", ":")).replace(" ", "\\u0020"))


@pytest.fixture
def cli(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Cli:
    """main() with a fresh Environment per call (as tests/test_cli_inprocess.py's fixture)."""
    monkeypatch.setenv("FLEETCUDA_STATE_DIR", str(tmp_path / "process-state"))
    monkeypatch.delenv("FLEETCUDA_INVENTORY", raising=False)
    (tmp_path / "home").mkdir()
    return Cli(tmp_path, tmp_path / "state", {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "COLUMNS": "200"})


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeTransport:
    """Container 201 has everything; on 202 causal_conv1d does not import."""
    fake = FakeTransport()

    def reply(call: Call) -> RunResult:
        doctor, gate = probe(set() if call.place == 201 else {"causal_conv1d"})
        return ok("transformers says something at import\n" + frame(call, "doctor", doctor) + frame(call, "gate", gate))

    fake.on(kind="run", reply=reply)
    monkeypatch.setattr(common, "transport_factory", lambda inventory: lambda host: fake)
    return fake


@pytest.fixture
def inventory(tmp_path: Path) -> Path:
    path = tmp_path / "inv.yaml"
    path.write_text(INVENTORY)
    return path


@pytest.fixture
def qwen(tmp_path: Path) -> Path:
    """Qwen3.6-27B's config.json, as far as layers go: 64 of them, every fourth full attention."""
    d = tmp_path / "Qwen3.6-27B"
    d.mkdir()
    layers = ["linear_attention" if (i + 1) % 4 else "full_attention" for i in range(64)]
    (d / "config.json").write_text(json.dumps({
        "architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
        "text_config": {"model_type": "qwen3_5_text", "num_hidden_layers": 64, "layer_types": layers}}, indent=2))
    return d


FAST = "64 of 64 layers on the fast path (48 linear_attention via causal_conv1d+fla, 16 full_attention unaffected)"
SLOW = (f"48 of 64 layers (linear_attention) partly on the reference path: causal_conv1d_fn, causal_conv1d_update fall "
        f"back: causal_conv1d does not import ({NO_CONV}); chunk_gated_delta_rule, "
        f"fused_recurrent_gated_delta_rule via fla")


def test_each_target_says_how_many_layers_take_the_fast_path(cli: Cli, fake: FakeTransport, inventory: Path,
                                                              qwen: Path) -> None:
    got = cli("doctor", "-i", inventory, "--model", qwen)
    assert got.code == ExitStatus.FAILED, got.out + got.err  # a fallback fails doctor, as a missing package does
    lines = got.out.splitlines()
    assert f"model {qwen}/config.json: Qwen3.5 (model_type qwen3_5, Qwen3_5ForConditionalGeneration), 64 layers: " \
           "48 linear_attention (GatedDeltaNet, fast path via causal_conv1d + fla), 16 full_attention (Attention, " \
           "no kernels beyond torch); layer types from layer_types" in lines
    assert lines[-2:] == [f"h/201: {FAST}", f"h/202: {SLOW}"]
    assert len(fake.calls_for(kind="run")) == 2  # one round trip a target, as without --model

    fast_only = cli("doctor", "-i", inventory, "--limit", "h/201", "--model", qwen)
    assert fast_only.code == ExitStatus.OK, fast_only.out
    assert fast_only.out.splitlines()[-1] == f"h/201: {FAST}"


def test_the_json_holds_each_targets_verdict_and_the_model(cli: Cli, fake: FakeTransport, inventory: Path,
                                                            qwen: Path) -> None:
    got = cli("doctor", "-i", inventory, "--format", "json", "--model", qwen / "config.json")
    assert got.code == ExitStatus.FAILED and got.err == ""
    doc = json.loads(got.out)
    fast, slow = doc["h/201"]["model"], doc["h/202"]["model"]
    assert {k: fast[k] for k in ("model_type", "layers", "layer_types", "path", "status", "fast_layers",
                                 "reference_layers", "message")} == {
        "model_type": "qwen3_5", "layers": 64, "layer_types": {"linear_attention": 48, "full_attention": 16},
        "path": "fast", "status": "ok", "fast_layers": 64, "reference_layers": 0, "message": FAST}
    assert (slow["path"], slow["status"], slow["fast_layers"], slow["reference_layers"]) == (
        "partly-reference", "fail", 16, 48)
    assert slow["reasons"] == [f"causal_conv1d_fn, causal_conv1d_update fall back: causal_conv1d does not "
                               f"import ({NO_CONV})"]
    assert {"check": "model qwen3_5", "value": SLOW, "status": "fail"} in doc["h/202"]["findings"]
    plain = json.loads(cli("doctor", "-i", inventory, "--format", "json").out)
    assert "model" not in plain["h/201"] and not any(f["check"].startswith("model") for f in plain["h/201"]["findings"])


@pytest.mark.parametrize(("config", "says"), [
    ('{\n  "model_type": "llama",\n  "num_hidden_layers": 32\n}\n',
     ":2: model_type: \"llama\" is not a model type fleetcuda knows the layers of (it knows qwen3_5, qwen3_5_moe, "
     "qwen3_next (and the text-only qwen3_5_text, qwen3_5_moe_text)); it does not guess\n"),
    ('{\n  "model_type": "qwen3_next",\n  "num_hidden_layers": 48,\n}\n',
     ":4: not valid JSON: Expecting property name enclosed in double quotes (column 1)\n"),
], ids=["unknown type", "broken json"])
def test_a_config_it_cannot_read_is_exit_2_before_any_round_trip(cli: Cli, fake: FakeTransport, inventory: Path,
                                                                  tmp_path: Path, config: str, says: str) -> None:
    path = tmp_path / "config.json"
    path.write_text(config)
    got = cli("doctor", "-i", inventory, "--model", path)
    assert (got.code, got.out, got.err) == (ExitStatus.INPUT, "", f"fleetcuda: {path}{says}")
    assert fake.calls == []
    empty = tmp_path / "empty"
    empty.mkdir()
    got = cli("doctor", "-i", inventory, "--model", "empty")  # relative: to the environment's cwd
    assert got.err == ("fleetcuda: empty: no config.json in this directory (--model names a model directory or its "
                       "config.json)\n")
