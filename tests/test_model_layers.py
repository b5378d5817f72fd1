"""`fleetcuda doctor --model`: a model's layers read from config files the tests write (no hub, no transformers),
and per target how many of them take the fast path, decided from doctor's report as transformers decides."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fleetcuda import remote
from fleetcuda.errors import InputError
from fleetcuda.plan.model import KINDS, Model, read_model
from fleetcuda.run.doctor import model_verdict

# Qwen3.6-27B's shape (the seeds' model): 64 layers, every fourth full attention.
LAYERS_27B = ["linear_attention" if (i + 1) % 4 else "full_attention" for i in range(64)]


def qwen3_5(**text: object) -> dict:
    """A Qwen3.5 config.json as the hub has it: the text model nested under text_config."""
    return {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
            "text_config": {"model_type": "qwen3_5_text", "hidden_size": 5120, "num_hidden_layers": 64,
                            "layer_types": LAYERS_27B, "full_attention_interval": 4, **text},
            "vision_config": {"model_type": "qwen3_5_vision", "depth": 27}}


def write_config(tmp_path: Path, doc: dict | str, name: str = "model") -> Path:
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(doc if isinstance(doc, str) else json.dumps(doc, indent=2))
    return d


def error_of(path: Path) -> InputError:
    with pytest.raises(InputError) as exc:
        read_model(str(path))
    return exc.value


# -- reading a config --------------------------------------------------------------------------------------------


def test_qwen3_5_dense_layers_come_from_text_config_layer_types(tmp_path: Path) -> None:
    d = write_config(tmp_path, qwen3_5())
    model = read_model(str(d))
    assert (model.layers, model.counts()) == (64, {"linear_attention": 48, "full_attention": 16})
    assert model.source == f"{d}/config.json" and model.derived == "layer_types"
    assert model.kind.module == "transformers.models.qwen3_5.modeling_qwen3_5"
    assert model.summary() == (
        f"{d}/config.json: Qwen3.5 (model_type qwen3_5, Qwen3_5ForConditionalGeneration), 64 layers: "
        "48 linear_attention (GatedDeltaNet, fast path via causal_conv1d + fla), 16 full_attention (Attention, "
        "no kernels beyond torch); layer types from layer_types")
    assert read_model(str(d / "config.json")).layer_types == model.layer_types  # the file itself, too


def test_a_relative_path_is_read_from_the_callers_directory(tmp_path: Path) -> None:
    write_config(tmp_path, qwen3_5())
    assert read_model("model", cwd=tmp_path).source == "model/config.json"
    os.mkfifo(tmp_path / "fifo")  # refused without waiting for a writer, and named as the user named it
    with pytest.raises(InputError, match=r"^fifo: cannot read: a FIFO, not a regular file$"):
        read_model("fifo", cwd=tmp_path)


def test_qwen3_5_moe_nests_its_text_model_and_may_give_only_the_interval(tmp_path: Path) -> None:
    doc = {"architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
           "text_config": {"model_type": "qwen3_5_moe_text", "num_hidden_layers": 40, "full_attention_interval": 4,
                           "num_experts": 256}}
    model = read_model(str(write_config(tmp_path, doc)))
    assert model.kind.module == "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe"
    assert model.counts() == {"linear_attention": 30, "full_attention": 10}
    assert model.layer_types[:4] == ("linear_attention",) * 3 + ("full_attention",)
    assert model.derived == "full_attention_interval 4"


def test_qwen3_next_derives_layer_types_from_full_attention_interval(tmp_path: Path) -> None:
    doc = {"architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "num_hidden_layers": 48,
           "full_attention_interval": 4}
    model = read_model(str(write_config(tmp_path, doc)))
    assert (model.kind.name, model.counts()) == ("Qwen3-Next", {"linear_attention": 36, "full_attention": 12})
    assert [i for i, t in enumerate(model.layer_types) if t == "full_attention"] == list(range(3, 48, 4))
    three = read_model(str(write_config(tmp_path, {**doc, "full_attention_interval": 3}, "three")))
    assert three.counts() == {"linear_attention": 32, "full_attention": 16}
    default = read_model(str(write_config(tmp_path, {"model_type": "qwen3_next", "num_hidden_layers": 8}, "dflt")))
    assert default.counts() == {"linear_attention": 6, "full_attention": 2}
    assert default.derived == "full_attention_interval 4 (transformers' default)"


def test_an_unknown_model_type_is_said_with_the_known_ones_not_guessed(tmp_path: Path) -> None:
    d = write_config(tmp_path, '{\n  "architectures": ["LlamaForCausalLM"],\n  "model_type": "llama",\n'
                               '  "num_hidden_layers": 32\n}\n')
    err = error_of(d)
    assert str(err) == (f"{d}/config.json:3: model_type: \"llama\" is not a model type fleetcuda knows the layers "
                        "of (it knows qwen3_5, qwen3_5_moe, qwen3_next (and the text-only qwen3_5_text, "
                        "qwen3_5_moe_text)); it does not guess")


def test_broken_json_names_the_file_and_line(tmp_path: Path) -> None:
    d = write_config(tmp_path, '{\n  "model_type": "qwen3_next",\n  "num_hidden_layers": 48,,\n}\n')
    assert str(error_of(d)) == f"{d}/config.json:3: not valid JSON: Expecting property name enclosed in double " \
                               "quotes (column 27)"
    assert str(error_of(write_config(tmp_path, "[1, 2]", "list"))) == \
        f"{tmp_path}/list/config.json:1: a config.json holds one JSON object, not a list"


def test_a_directory_without_config_json_and_a_missing_path(tmp_path: Path) -> None:
    (tmp_path / "weights").mkdir()
    (tmp_path / "weights" / "model.safetensors").write_bytes(b"\0" * 16)
    assert str(error_of(tmp_path / "weights")) == (f"{tmp_path}/weights: no config.json in this directory (--model "
                                                   "names a model directory or its config.json)")
    assert str(error_of(tmp_path / "nowhere")) == f"--model: {tmp_path}/nowhere: no such file or directory"


@pytest.mark.parametrize(("doc", "line", "says"), [
    ({"architectures": ["X"]}, None, "model_type: missing: a transformers config.json names its model type"),
    ({"model_type": 7}, 2, "model_type: must be a string, not a number"),
    ({"model_type": "qwen3_5"}, None, "text_config: missing: a qwen3_5 config holds its text model's layers there "
                                      "(model_type qwen3_5_text)"),
    ({"model_type": "qwen3_5", "text_config": []}, 3, "text_config: must be an object, not a list"),
    (qwen3_5(model_type="qwen3_next"), 7, "text_config.model_type: \"qwen3_next\": a qwen3_5 config's text model "
                                          "is qwen3_5_text"),
    (qwen3_5(num_hidden_layers=60), 10, "text_config.layer_types: has 64 entries but num_hidden_layers is 60"),
    (qwen3_5(layer_types=["linear_attention", "sliding_attention"], num_hidden_layers=2), 10,
     "text_config.layer_types[1]: \"sliding_attention\" is not a layer type of qwen3_5 (it has linear_attention, "
     "full_attention)"),
    ({"model_type": "qwen3_next", "full_attention_interval": 4}, None,
     "num_hidden_layers: missing, and no layer_types: the number of layers is not said"),
    ({"model_type": "qwen3_next", "num_hidden_layers": True}, 3, "num_hidden_layers: must be a positive integer, "
                                                                 "not true"),
    ({"model_type": "qwen3_next", "num_hidden_layers": 8, "full_attention_interval": 0}, 4,
     "full_attention_interval: must be a positive integer, not 0"),
], ids=lambda v: "" if not isinstance(v, str) else v.split(":")[0])
def test_missing_or_wrong_fields_name_file_line_and_field(tmp_path: Path, doc: dict, line: int | None,
                                                          says: str) -> None:
    d = write_config(tmp_path, doc)
    where = f"{d}/config.json:{line}" if line else f"{d}/config.json"
    assert str(error_of(d)).startswith(f"{where}: {says}")


def test_a_key_given_twice_is_named_with_both_lines(tmp_path: Path) -> None:
    # json keeps the last of two; a config saying two things of one field is refused wherever the key is
    text = '{"model_type": "qwen3_next", "num_hidden_layers": 4,\n "rope": {"theta": 1,\n  "theta": 2}}\n'
    assert str(error_of(write_config(tmp_path, text))) == \
        f"{tmp_path}/model/config.json:3: rope.theta: given twice (also on line 2): json would keep only the last"
    same_name = '{"model_type": "qwen3_next", "num_hidden_layers": 4, "a": {"num_hidden_layers": 4}}'
    assert read_model(str(write_config(tmp_path, same_name, "nested"))).layers == 4  # one per object is fine


def test_a_field_nested_under_text_config_is_named_by_its_own_line(tmp_path: Path) -> None:
    text = '{"model_type": "qwen3_5", "num_hidden_layers": 64,\n "text_config": {\n  "num_hidden_layers": 0}}\n'
    assert str(error_of(write_config(tmp_path, text))) == (f"{tmp_path}/model/config.json:3: "
                                                           "text_config.num_hidden_layers: must be a positive "
                                                           "integer, not 0")


def test_nesting_and_numbers_beyond_a_configs_are_refused_with_their_line(tmp_path: Path) -> None:
    head = '{"model_type": "qwen3_next", "num_hidden_layers": 4,\n "x": '
    deep = write_config(tmp_path, head + "[" * 64 + "]" * 64 + "}", "deep")
    assert str(error_of(deep)) == f"{deep}/config.json:2: nested deeper than 64 levels: not a model's config.json"
    # 64 levels in all is read; brackets inside strings are text, not nesting
    assert read_model(str(write_config(tmp_path, head + "[" * 63 + "]" * 63 + "}", "ok"))).layers == 4
    assert read_model(str(write_config(tmp_path, head + '"' + "[" * 100 + '\\"{"}', "str"))).layers == 4
    long = write_config(tmp_path, head + "[1,\n -" + "9" * 40 + "]}", "long")
    assert str(error_of(long)) == f"{long}/config.json:3: x[1]: a number of 40 digits: not a value of a model's config"


def test_a_layer_count_no_model_has_is_refused(tmp_path: Path) -> None:
    doc = {"model_type": "qwen3_next", "num_hidden_layers": 10_001}
    assert str(error_of(write_config(tmp_path, doc))).endswith(
        "num_hidden_layers: 10001 is more layers than a model has (fleetcuda reads at most 10000)")
    assert read_model(str(write_config(tmp_path, {**doc, "num_hidden_layers": 10_000}, "max"))).layers == 10_000
    listed = write_config(tmp_path, {"model_type": "qwen3_next", "layer_types": ["full_attention"] * 10_001}, "l")
    assert "layer_types: has 10001 entries, more layers than a model has" in str(error_of(listed))


def test_a_weights_file_named_by_mistake_is_not_read_whole(tmp_path: Path) -> None:
    big = tmp_path / "model.safetensors"
    with big.open("wb") as f:
        f.truncate(64 * 1024 * 1024)
    assert str(error_of(big)) == f"{big}: larger than 4194304 bytes: not a model's config.json"


def test_the_modules_named_are_the_ones_the_gate_reads() -> None:
    gate = remote.program("fast_path_gate").text
    for kind in KINDS.values():
        assert f'"{kind.module}"' in gate, kind.model_type


# -- per target: how many layers take the fast path --------------------------------------------------------------

MODULE = "transformers.models.qwen3_5.modeling_qwen3_5"
FUNCTIONS = {"causal_conv1d_fn": "causal_conv1d.cpp_functions.causal_conv1d_fn",
             "causal_conv1d_update": "causal_conv1d.cpp_functions.causal_conv1d_update",
             "chunk_gated_delta_rule": "fla.ops.gated_delta_rule.chunk.chunk_gated_delta_rule",
             "fused_recurrent_gated_delta_rule": "fla.ops.gated_delta_rule.fused_recurrent."
                                                 "fused_recurrent_gated_delta_rule"}
NO_CONV = "ModuleNotFoundError: No module named 'causal_conv1d'"
NO_FLA = "ModuleNotFoundError: No module named 'fla'"


def report(*, conv: str | None = None, fla: str | None = None, gate: dict | None = None,
           gpu: bool = True) -> dict:
    """doctor.parse's report: the probe's imports and the gate of transformers 5.24 (wrapped style)."""
    if gate is None:
        picked = {f: (f"{MODULE}.{f}" if (conv and f.startswith("causal")) or (fla and not f.startswith("causal"))
                      else where) for f, where in FUNCTIONS.items()}
        gate = {"style": "wrapped", "functions": picked, "fast": {f: not w.startswith("transformers.")
                                                                   for f, w in picked.items()}}
    return {"torch": {"version": "2.11.0+cu130", "cuda": "13.0", "gpu": gpu},
            "causal_conv1d": {"error": conv} if conv else {"version": "1.7.0"},
            "fla": {"error": fla} if fla else {"version": "0.6.0"},
            "transformers": {"version": "5.24.0", "modules": {MODULE: gate}}}


@pytest.fixture
def model(tmp_path: Path) -> Model:
    return read_model(str(write_config(tmp_path, qwen3_5())))


def test_all_four_functions_fast_is_every_layer_on_the_fast_path(model: Model) -> None:
    v = model_verdict(model, report())
    assert (v.path, v.status, v.fast_layers, v.reference_layers) == ("fast", "ok", 64, 0)
    assert v.message == ("64 of 64 layers on the fast path (48 linear_attention via causal_conv1d+fla, "
                         "16 full_attention unaffected)")


def test_the_seeds_story_causal_conv1d_missing_puts_48_of_64_on_the_reference_path(model: Model) -> None:
    v = model_verdict(model, report(conv=NO_CONV))
    assert (v.path, v.status, v.fast_layers, v.reference_layers) == ("partly-reference", "fail", 16, 48)
    assert v.message == ("48 of 64 layers (linear_attention) partly on the reference path: causal_conv1d_fn, "
                         f"causal_conv1d_update fall back: causal_conv1d does not import ({NO_CONV}); "
                         "chunk_gated_delta_rule, fused_recurrent_gated_delta_rule via fla")
    both = model_verdict(model, report(conv=NO_CONV, fla=NO_FLA))
    assert (both.path, both.reference_layers) == ("reference", 48)
    assert both.message == (f"48 of 64 layers (linear_attention) on the reference path: causal_conv1d does not "
                            f"import ({NO_CONV}); fla does not import ({NO_FLA})")


def test_a_package_that_imports_but_is_not_picked_is_named_with_what_was(model: Model) -> None:
    gate = {"style": "wrapped", "functions": {**FUNCTIONS, "causal_conv1d_update": f"{MODULE}.causal_conv1d_update"},
            "fast": {f: f != "causal_conv1d_update" for f in FUNCTIONS}}
    v = model_verdict(model, report(gate=gate))
    assert v.path == "partly-reference" and v.reasons == [
        f"causal_conv1d_update fall back: causal_conv1d imports, but transformers 5.24.0 picked "
        f"{MODULE}.causal_conv1d_update"]


def test_the_flag_style_is_all_or_nothing_and_needs_a_gpu(model: Model) -> None:
    up = model_verdict(model, report(gate={"style": "flag", "is_fast_path_available": True}))
    assert (up.path, up.fast_layers) == ("fast", 64)
    no_gpu = model_verdict(model, report(gate={"style": "flag", "is_fast_path_available": False}, gpu=False))
    assert (no_gpu.path, no_gpu.status) == ("reference", "fail")
    assert no_gpu.message == ("48 of 64 layers (linear_attention) on the reference path: transformers 5.24.0's "
                              "is_fast_path_available is False: no GPU visible (the flag needs "
                              "torch.cuda.is_available())")
    no_fla = model_verdict(model, report(fla=NO_FLA, gate={"style": "flag", "is_fast_path_available": False}))
    assert no_fla.reasons == [f"fla does not import ({NO_FLA})"]


def test_a_transformers_without_the_model_cannot_load_it(model: Model) -> None:
    old = report(gate={"error": "ModuleNotFoundError: No module named 'transformers.models.qwen3_5'"})
    v = model_verdict(model, old)
    assert (v.path, v.status, v.fast_layers) == ("cannot-load", "fail", 0)
    assert v.message == ("the model cannot load: modeling_qwen3_5 does not import in transformers 5.24.0 "
                         "(ModuleNotFoundError: No module named 'transformers.models.qwen3_5'); Qwen3.5 came in "
                         "transformers 5.2.0")


def test_without_transformers_missing_packages_still_decide_and_otherwise_it_is_not_known(model: Model) -> None:
    bare = {**report(conv=NO_CONV, fla=NO_FLA), "transformers": {"error": "ModuleNotFoundError: No module named "
                                                                          "'transformers'"}}
    v = model_verdict(model, bare)
    assert (v.path, v.status, v.reference_layers) == ("reference", "fail", 48)
    assert v.message.startswith(f"48 of 64 layers (linear_attention) on the reference path: causal_conv1d does "
                                f"not import ({NO_CONV}); fla does not import")
    kernels_only = {**report(), "transformers": bare["transformers"]}
    unknown = model_verdict(model, kernels_only)
    assert (unknown.path, unknown.status) == ("unknown", "warn")
    assert "which path is not known: transformers does not import" in unknown.message


def test_no_gate_found_and_no_report_are_not_known_never_fast(model: Model) -> None:
    v = model_verdict(model, report(gate={"style": "wrapped", "functions": {}, "fast": {}}))
    assert (v.path, v.status) == ("unknown", "warn") and "no GatedDeltaNet gate found" in v.message
    gone = model_verdict(model, {"error": "lab-a: unreachable"})
    assert (gone.path, gone.fast_layers) == ("unknown", 0)


def test_a_model_of_full_attention_only_needs_no_kernels(tmp_path: Path) -> None:
    full = read_model(str(write_config(tmp_path, {"model_type": "qwen3_next", "num_hidden_layers": 4,
                                                  "full_attention_interval": 1})))
    v = model_verdict(full, report(conv=NO_CONV, fla=NO_FLA))
    assert (v.path, v.status, v.message) == ("no-kernels", "ok", "4 of 4 layers need no fast-path kernels "
                                                                 "(all full_attention)")


# -- against transformers itself, where the lab's real topology has installed it -----------------------------------

REAL_SITE = Path(f"/var/lib/fleetcuda-lab/real/base/root/venv/lib/python3.{sys.version_info.minor}/site-packages")


@pytest.mark.skipif(not (REAL_SITE / "transformers").is_dir(),
                    reason="no transformers of the lab's real topology for this Python (tests/lab/labctl.py)")
def test_the_layer_types_read_are_the_ones_transformers_builds(tmp_path: Path) -> None:
    """transformers' own AutoConfig over the same config files: its text config's layer_types, layer by layer."""
    cases = {"q35": qwen3_5(),
             "q35-interval": {"model_type": "qwen3_5", "text_config": {"model_type": "qwen3_5_text",
                                                                       "num_hidden_layers": 64,
                                                                       "full_attention_interval": 4}},
             "moe": {"model_type": "qwen3_5_moe", "text_config": {"model_type": "qwen3_5_moe_text",
                                                                  "num_hidden_layers": 40}},
             "next": {"model_type": "qwen3_next", "num_hidden_layers": 48, "full_attention_interval": 4},
             "next3": {"model_type": "qwen3_next", "num_hidden_layers": 12, "full_attention_interval": 3},
             "text": {"model_type": "qwen3_5_text", "num_hidden_layers": 8, "full_attention_interval": 2}}
    for name, doc in cases.items():
        write_config(tmp_path, doc, name)
    script = ("import json, sys\nfrom transformers import AutoConfig\n"
              "print(json.dumps({n: list(AutoConfig.from_pretrained(sys.argv[1] + '/' + n).get_text_config()"
              ".layer_types) for n in sys.argv[2:]}))\n")
    res = subprocess.run([sys.executable, "-c", script, str(tmp_path), *cases], capture_output=True, text=True,
                         env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REAL_SITE), "HF_HUB_OFFLINE": "1",
                              "PYTHONDONTWRITEBYTECODE": "1"}, timeout=300)
    assert res.returncode == 0, res.stderr
    theirs = json.loads(res.stdout.splitlines()[-1])
    for name in cases:
        assert read_model(str(tmp_path / name)).layer_types == tuple(theirs[name]), name
