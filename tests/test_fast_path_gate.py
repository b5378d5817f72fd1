"""The flagship recipe's last step, run for real against small stand-in packages that mimic how
transformers resolves its GatedDeltaNet fast path, in both gate styles (a flag up to 5.14; wrapped
functions whose closure holds the implementation from 5.15 on)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from fleetcuda.plan.inventory import load_inventory
from fleetcuda.plan.planner import base_values, make_plan
from fleetcuda.plan.recipe import load_recipe
from tests.conftest import REPO

WRAPPED = '''
import importlib
def use_kernel_func_from_hub_with_fallback(func_name, package, attr=None):
    def decorator(torch_function):
        try:
            implementation = getattr(importlib.import_module(package), attr or func_name)
        except Exception:
            implementation = torch_function
        def wrapped(*args, **kwargs):
            if implementation is torch_function:
                print(f"{func_name} falls back")
            return implementation(*args, **kwargs)
        return wrapped
    return decorator

@use_kernel_func_from_hub_with_fallback("causal_conv1d_fn", "causal_conv1d")
def causal_conv1d_fn(x): return x
@use_kernel_func_from_hub_with_fallback("causal_conv1d_update", "causal_conv1d")
def causal_conv1d_update(x): return x
@use_kernel_func_from_hub_with_fallback("chunk_gated_delta_rule", "fla.ops.gated_delta_rule")
def torch_chunk_gated_delta_rule(x): return x
@use_kernel_func_from_hub_with_fallback("fused_recurrent_gated_delta_rule", "{fused_package}")
def torch_recurrent_gated_delta_rule(x): return x
'''

FLAG = '''
try:
    from causal_conv1d import causal_conv1d_fn
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule
except ImportError:
    causal_conv1d_fn = chunk_gated_delta_rule = None
import torch
is_fast_path_available = all((causal_conv1d_fn, chunk_gated_delta_rule)) and torch.cuda.is_available()
'''

FILES = {
    "torch/__init__.py": "__version__ = '2.11.0+cu130'\nfrom . import cuda, version\n",
    "torch/version.py": "cuda = '13.0'\n",
    "torch/cuda.py": "def is_available():\n    return False\n",
    "causal_conv1d/__init__.py": "__version__ = '1.7.0'\ndef causal_conv1d_fn(*a, **k): pass\n"
                                 "def causal_conv1d_update(*a, **k): pass\n",
    "fla/__init__.py": "__version__ = '0.6.0'\n",
    "fla/ops/__init__.py": "",
    "fla/ops/gated_delta_rule/__init__.py": "def chunk_gated_delta_rule(*a, **k): pass\n"
                                            "def fused_recurrent_gated_delta_rule(*a, **k): pass\n",
    "transformers/models/__init__.py": "",
}


def site(tmp_path: Path, version: str, qwen3_5: str | None, qwen3_next: str | None) -> Path:
    root = tmp_path / "site"
    for name, text in FILES.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    (root / "transformers/__init__.py").write_text(f"__version__ = {version!r}\n")
    for model, text in (("qwen3_5", qwen3_5), ("qwen3_next", qwen3_next)):
        if text is not None:
            d = root / "transformers/models" / model
            d.mkdir(parents=True)
            (d / "__init__.py").write_text("")
            (d / f"modeling_{model}.py").write_text(textwrap.dedent(text))
    return root


def fast_path(tmp_path: Path, root: Path) -> subprocess.CompletedProcess[str]:
    python = tmp_path / "python"
    python.write_text(f"#!/bin/sh\nPYTHONPATH={root} exec {sys.executable} \"$@\"\n")
    python.chmod(0o755)
    inv = tmp_path / "inv.yaml"
    inv.write_text(f"hosts:\n  gpu-box:\n    kind: local\n    python: {python}\n")
    recipe, target = load_recipe(REPO / "recipes/gdn-fastpath.yaml"), load_inventory(inv).targets[0]
    step = next(s for s in make_plan(recipe, target, base_values(recipe, target, {})).steps if s.name == "fast-path")
    assert step.verify is not None and step.apply is None
    return subprocess.run(list(step.verify.argv), capture_output=True, text=True, timeout=120)


def test_wrapped_functions_resolved_to_the_packages_pass(tmp_path: Path) -> None:
    wrapped = WRAPPED.replace("{fused_package}", "fla.ops.gated_delta_rule")
    res = fast_path(tmp_path, site(tmp_path, "5.17.0", wrapped, wrapped))
    assert res.returncode == 0, res.stdout + res.stderr
    assert "ok   import causal_conv1d 1.7.0, fla 0.6.0" in res.stdout
    assert "skip no GPU visible: kernels not run" in res.stdout
    assert "ok   transformers 5.17.0 modeling_qwen3_5: causal_conv1d_fn -> causal_conv1d.causal_conv1d_fn" \
        in res.stdout
    assert res.stdout.count("ok   transformers 5.17.0") == 8  # four functions in each of the two models


def test_a_function_left_on_the_reference_path_fails(tmp_path: Path) -> None:
    broken = WRAPPED.replace("{fused_package}", "fla.ops.no_such_module")
    res = fast_path(tmp_path, site(tmp_path, "5.17.0", broken, None))
    assert res.returncode == 1
    assert ("FAIL transformers 5.17.0 modeling_qwen3_5: fused_recurrent_gated_delta_rule -> "
            "transformers.models.qwen3_5.modeling_qwen3_5.torch_recurrent_gated_delta_rule") in res.stdout


def test_flag_style_needs_a_gpu_to_say_anything(tmp_path: Path) -> None:
    res = fast_path(tmp_path, site(tmp_path, "4.57.1", None, FLAG))
    assert res.returncode == 0, res.stdout + res.stderr
    assert "skip transformers 4.57.1 modeling_qwen3_next: is_fast_path_available needs a GPU" in res.stdout


def test_no_gate_found_is_a_failure_not_a_pass(tmp_path: Path) -> None:
    res = fast_path(tmp_path, site(tmp_path, "6.0.0", "x = 1\n", None))
    assert res.returncode == 1
    assert "no GatedDeltaNet gate found" in res.stdout


@pytest.mark.parametrize("missing", ["causal_conv1d", "fla"])
def test_a_missing_package_fails(tmp_path: Path, missing: str) -> None:
    root = site(tmp_path, "5.17.0", WRAPPED.replace("{fused_package}", "fla.ops.gated_delta_rule"), None)
    for f in sorted((root / missing).rglob("*"), reverse=True):
        f.unlink() if f.is_file() else f.rmdir()
    (root / missing).rmdir()
    res = fast_path(tmp_path, root)
    assert res.returncode == 1
    assert f"No module named '{missing}'" in res.stdout + res.stderr
