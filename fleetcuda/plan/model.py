"""A model's layers as transformers builds them, read from its config.json on the control machine (pure: no
transformers, no network), for `fleetcuda doctor --model`.

What is known, read from transformers 5.24's sources (configuration_*.py and modeling_*.py of qwen3_5,
qwen3_5_moe and qwen3_next; tests/test_model_layers.py checks the result against its AutoConfig where it is
installed): every decoder layer is `config.layer_types[i]`; a `linear_attention` layer is a GatedDeltaNet,
whose fast path is causal_conv1d's two functions plus fla's two gated-delta-rule functions (one module flag
for all four up to 5.14, each function wrapped on its own from 5.15: remote/fast_path_gate.py reads both),
and a `full_attention` layer needs neither. When `layer_types` is absent transformers derives it from
`full_attention_interval` (4 if absent): layer i is full attention when (i + 1) is a multiple of it.
Qwen3.5 and Qwen3.5-MoE checkpoints hold the text model under `text_config` (model_type qwen3_5_text /
qwen3_5_moe_text); Qwen3-Next holds it at the top. A model type not listed here is said to be unknown,
never guessed from its fields.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fleetcuda.errors import InputError

LINEAR, FULL = "linear_attention", "full_attention"
# transformers' default when a config gives neither layer_types nor full_attention_interval.
DEFAULT_INTERVAL = 4
MAX_CONFIG_BYTES = 4 * 1024 * 1024  # a config.json is a few KB; a weights file named by mistake is not read


@dataclass(frozen=True)
class FastPath:
    """What one layer type's fast path needs: package -> the functions transformers takes from it."""

    layer_type: str
    block: str  # the module transformers builds for it
    needs: tuple[tuple[str, tuple[str, ...]], ...]  # () : no kernels beyond torch's

    @property
    def packages(self) -> tuple[str, ...]:
        return tuple(p for p, _ in self.needs)

    @property
    def functions(self) -> tuple[str, ...]:
        return tuple(f for _, fns in self.needs for f in fns)

    def package_of(self, function: str) -> str:
        return next(p for p, fns in self.needs if function in fns)


GATED_DELTA_NET = FastPath(LINEAR, "GatedDeltaNet", (
    ("causal_conv1d", ("causal_conv1d_fn", "causal_conv1d_update")),
    ("fla", ("chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule")),
))
ATTENTION = FastPath(FULL, "Attention", ())
PATHS = {LINEAR: GATED_DELTA_NET, FULL: ATTENTION}


@dataclass(frozen=True)
class Kind:
    """A model type fleetcuda knows: where its text model's fields are and which modeling module builds it."""

    model_type: str
    name: str
    module: str  # the transformers module whose gate decides (as fast_path_gate.MODULES names it)
    since: str  # the first transformers release that has it
    text_type: str | None  # the nested text config's model_type; None: the fields are at the top


_QWEN3_5 = "transformers.models.qwen3_5.modeling_qwen3_5"
_QWEN3_5_MOE = "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe"
_QWEN3_NEXT = "transformers.models.qwen3_next.modeling_qwen3_next"
KINDS = {k.model_type: k for k in (
    Kind("qwen3_5", "Qwen3.5", _QWEN3_5, "5.2.0", "qwen3_5_text"),
    Kind("qwen3_5_moe", "Qwen3.5-MoE", _QWEN3_5_MOE, "5.2.0", "qwen3_5_moe_text"),
    Kind("qwen3_next", "Qwen3-Next", _QWEN3_NEXT, "4.57.0", None),
    # text-only checkpoints of the same models: the same modeling module, fields at the top
    Kind("qwen3_5_text", "Qwen3.5 (text)", _QWEN3_5, "5.2.0", None),
    Kind("qwen3_5_moe_text", "Qwen3.5-MoE (text)", _QWEN3_5_MOE, "5.2.0", None),
)}


@dataclass(frozen=True)
class Model:
    """One model's layers as transformers would build them."""

    source: str  # the config file, as the user named it
    kind: Kind
    architectures: tuple[str, ...]
    layer_types: tuple[str, ...]  # per decoder layer
    derived: str  # how layer_types was known: "layer_types", or "full_attention_interval N" (+ "default")

    @property
    def layers(self) -> int:
        return len(self.layer_types)

    def count(self, layer_type: str) -> int:
        return sum(1 for t in self.layer_types if t == layer_type)

    def counts(self) -> dict[str, int]:
        """Layer type -> how many layers, in the order they first appear."""
        return dict(Counter(self.layer_types))

    def summary(self) -> str:
        arch = "".join(f", {a}" for a in self.architectures)
        parts = []
        for layer_type, n in self.counts().items():
            path = PATHS[layer_type]
            needs = f"fast path via {' + '.join(path.packages)}" if path.needs else "no kernels beyond torch"
            parts.append(f"{n} {layer_type} ({path.block}, {needs})")
        return (f"{self.source}: {self.kind.name} (model_type {self.kind.model_type}{arch}), {self.layers} layers: "
                f"{', '.join(parts)}; layer types from {self.derived}")

    def as_json(self) -> dict[str, Any]:
        return {"config": self.source, "model_type": self.kind.model_type, "name": self.kind.name,
                "architectures": list(self.architectures), "module": self.kind.module, "layers": self.layers,
                "layer_types": self.counts(), "derived_from": self.derived}


def known_types() -> str:
    tops = [k for k, v in KINDS.items() if not k.endswith("_text")]
    texts = [k for k in KINDS if k.endswith("_text")]
    return f"{', '.join(tops)} (and the text-only {', '.join(texts)})"


def config_path(path: str, cwd: Path | None = None) -> tuple[Path, str]:
    """The config.json that `path` names (a model directory or the file), and how messages show it."""
    given = Path(path)
    real = (cwd / given) if cwd is not None and not given.is_absolute() else given
    if real.is_dir():
        if not (real / "config.json").exists():
            raise InputError(path, None, "", "no config.json in this directory (--model names a model directory "
                                             "or its config.json)")
        return real / "config.json", str(given / "config.json")
    if not real.exists():
        raise InputError("--model", None, "", f"{path}: no such file or directory")
    return real, path


def read_model(path: str, cwd: Path | None = None) -> Model:
    """The model's layers from its config.json; InputError (file, line, field) for what does not say them."""
    from fleetcuda.plan.yamlsrc import read_bounded

    real, shown = config_path(path, cwd)
    try:
        raw = read_bounded(real, MAX_CONFIG_BYTES)
    except InputError as exc:  # named as the user named it, not as this process's cwd resolved it
        raise InputError(shown, exc.line, exc.field, exc.message) from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise InputError(shown, None, "", f"larger than {MAX_CONFIG_BYTES} bytes: not a model's config.json")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InputError(shown, None, "", f"not UTF-8 text (byte {exc.start}): not a model's config.json") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InputError(shown, exc.lineno, "", f"not valid JSON: {exc.msg} (column {exc.colno})") from None
    if not isinstance(data, dict):
        raise InputError(shown, 1, "", f"a config.json holds one JSON object, not {_json_type(data)}")
    return _model(_Doc(shown, text), data)


@dataclass(frozen=True)
class _Doc:
    """The config's text, to name the line a field is on (json gives lines only for syntax errors)."""

    shown: str
    text: str

    def error(self, field: str, message: str, within: tuple[int, int] | None = None) -> InputError:
        return InputError(self.shown, self.line_of(field.rsplit(".", 1)[-1].split("[")[0], within), field, message)

    def line_of(self, key: str, within: tuple[int, int] | None = None) -> int | None:
        start, end = within or (0, len(self.text))
        m = re.compile(r'"' + re.escape(key) + r'"\s*:').search(self.text, start, end)
        return self.text.count("\n", 0, m.start()) + 1 if m else None

    def span_of(self, key: str) -> tuple[int, int] | None:
        """Where the object that is top-level `key`'s value lies in the text."""
        for m in re.compile(r'"' + re.escape(key) + r'"\s*:\s*').finditer(self.text):
            try:
                _, end = json.JSONDecoder().raw_decode(self.text, m.end())
            except json.JSONDecodeError:
                continue
            return m.end(), end
        return None


def _model(doc: _Doc, data: dict[str, Any]) -> Model:
    model_type = data.get("model_type")
    if model_type is None:
        raise doc.error("model_type", f"missing: a transformers config.json names its model type; fleetcuda knows "
                                      f"{known_types()}")
    if not isinstance(model_type, str):
        raise doc.error("model_type", f"must be a string, not {_json_type(model_type)}")
    kind = KINDS.get(model_type)
    if kind is None:
        raise doc.error("model_type", f"{_shown(model_type)} is not a model type fleetcuda knows the layers of "
                                      f"(it knows {known_types()}); it does not guess")
    architectures = data.get("architectures") or []
    if not isinstance(architectures, list) or not all(isinstance(a, str) for a in architectures):
        raise doc.error("architectures", "must be a list of class names")
    fields, prefix, within = data, "", None
    if kind.text_type is not None:
        fields = data.get("text_config")
        if fields is None:
            raise doc.error("text_config", f"missing: a {kind.model_type} config holds its text model's layers "
                                           f"there (model_type {kind.text_type})")
        if not isinstance(fields, dict):
            raise doc.error("text_config", f"must be an object, not {_json_type(fields)}")
        prefix, within = "text_config.", doc.span_of("text_config")
        nested = fields.get("model_type", kind.text_type)
        if nested != kind.text_type:
            raise doc.error("text_config.model_type", f"{_shown(nested)}: a {kind.model_type} config's text model "
                                                      f"is {kind.text_type}", within)
    layer_types, derived = _layer_types(doc, fields, kind, prefix, within)
    return Model(doc.shown, kind, tuple(architectures), layer_types, derived)


def _layer_types(doc: _Doc, fields: dict[str, Any], kind: Kind, prefix: str,
                 within: tuple[int, int] | None) -> tuple[tuple[str, ...], str]:
    n = fields.get("num_hidden_layers")
    if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
        raise doc.error(prefix + "num_hidden_layers", f"must be a positive integer, not {_shown(n)}", within)
    given = fields.get("layer_types")
    if given is not None:
        if not isinstance(given, list) or not given:
            raise doc.error(prefix + "layer_types", f"must be a non-empty list, not {_shown(given)}", within)
        for i, t in enumerate(given):
            if t not in PATHS:
                raise doc.error(f"{prefix}layer_types[{i}]", f"{_shown(t)} is not a layer type of {kind.model_type} "
                                                             f"(it has {', '.join(PATHS)})", within)
        if n is not None and n != len(given):
            raise doc.error(prefix + "layer_types", f"has {len(given)} entries but num_hidden_layers is {n}", within)
        return tuple(given), "layer_types"
    if n is None:
        raise doc.error(prefix + "num_hidden_layers", "missing, and no layer_types: the number of layers is not "
                                                      "said", within)
    interval = fields.get("full_attention_interval")
    derived = f"full_attention_interval {interval}"
    if interval is None:
        interval, derived = DEFAULT_INTERVAL, f"full_attention_interval {DEFAULT_INTERVAL} (transformers' default)"
    elif not isinstance(interval, int) or isinstance(interval, bool) or interval < 1:
        raise doc.error(prefix + "full_attention_interval", f"must be a positive integer, not {_shown(interval)}",
                        within)
    return tuple(LINEAR if (i + 1) % interval else FULL for i in range(n)), derived


def _json_type(value: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", int: "a number",
            float: "a number", type(None): "null"}.get(type(value), type(value).__name__)


def _shown(value: Any) -> str:
    text = json.dumps(value, ensure_ascii=True)
    return text if len(text) <= 60 else text[:57] + "..."
