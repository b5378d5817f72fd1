"""`fleetcuda doctor --model` against the default lab (sshd, LXC containers, the pct stand-in), read-only: per
container, what it says about Qwen3.6-27B's 64 layers agrees with what imports there, looked at directly.

The default lab has no transformers: where causal_conv1d or fla does not import (a fresh container) the 48
linear_attention layers are on the reference path whatever transformers it would be; where both import, which
path they take is not known without transformers, and doctor says so rather than guess.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import run_fleetcuda
from tests.test_lab_e2e import INV, TARGETS, ct, lab_is_up  # noqa: F401  (lab_is_up: autouse fixture)

pytestmark = pytest.mark.lab

PYTHON = "/root/venv/bin/python"


def imports(target: str, module: str) -> bool:
    return ct(target, f"{PYTHON} -c 'import {module}'", check=False).returncode == 0


def test_doctor_model_agrees_with_what_imports_in_each_container(tmp_path: Path) -> None:
    model = tmp_path / "Qwen3.6-27B"
    model.mkdir()
    layers = ["linear_attention" if (i + 1) % 4 else "full_attention" for i in range(64)]
    (model / "config.json").write_text(json.dumps({
        "architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
        "text_config": {"model_type": "qwen3_5_text", "num_hidden_layers": 64, "layer_types": layers}}))
    out = run_fleetcuda("doctor", "-i", INV, "--model", str(model), "--format", "json", state=tmp_path / "state")
    doc = json.loads(out.stdout)
    assert sorted(doc) == sorted(TARGETS), out.stderr
    failed = False
    for target in TARGETS:
        verdict = doc[target]["model"]
        assert (verdict["layers"], verdict["layer_types"]) == (64, {"linear_attention": 48, "full_attention": 16})
        missing = [m for m in ("causal_conv1d", "fla") if not imports(target, m)]
        assert not imports(target, "transformers"), "the default lab has no transformers: this test's premise"
        if missing:
            assert (verdict["path"], verdict["status"], verdict["reference_layers"]) == ("reference", "fail", 48)
            assert verdict["message"].startswith("48 of 64 layers (linear_attention) on the reference path: ")
            for m in missing:
                assert f"{m} does not import (" in verdict["message"], (target, verdict["message"])
            if missing == ["causal_conv1d", "fla"]:  # a fresh container
                assert verdict["message"] == (
                    "48 of 64 layers (linear_attention) on the reference path: causal_conv1d does not import "
                    "(ModuleNotFoundError: No module named 'causal_conv1d'); fla does not import "
                    "(ModuleNotFoundError: No module named 'fla'); transformers does not import "
                    "(ModuleNotFoundError: No module named 'transformers')")
            failed = True
        else:
            assert (verdict["path"], verdict["status"], verdict["fast_layers"]) == ("unknown", "warn", 0)
            assert verdict["message"] == (
                "48 of 64 layers (linear_attention): which path is not known: transformers does not import "
                "(ModuleNotFoundError: No module named 'transformers'); causal_conv1d and fla import")
    if failed:
        assert out.returncode == 1
    table = run_fleetcuda("doctor", "-i", INV, "--model", str(model), state=tmp_path / "state")
    lines = table.stdout.splitlines()
    assert f"model {model}/config.json: Qwen3.5 (model_type qwen3_5, Qwen3_5ForConditionalGeneration), 64 layers: " \
           "48 linear_attention (GatedDeltaNet, fast path via causal_conv1d + fla), 16 full_attention (Attention, " \
           "no kernels beyond torch); layer types from layer_types" in lines
    assert lines[-len(TARGETS):] == [f"{t}: {doc[t]['model']['message']}" for t in TARGETS]
