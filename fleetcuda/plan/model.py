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
from bisect import bisect_right
from collections import Counter
from dataclasses import dataclass
from json.decoder import scanstring
from pathlib import Path
from typing import Any

from fleetcuda.errors import InputError

LINEAR, FULL = "linear_attention", "full_attention"
# transformers' default when a config gives neither layer_types nor full_attention_interval.
DEFAULT_INTERVAL = 4
MAX_CONFIG_BYTES = 4 * 1024 * 1024  # a config.json is a few KB; a weights file named by mistake is not read
MAX_DEPTH = 64  # a config nests a few levels; json would recurse (RecursionError) on deeper text
MAX_DIGITS = 30  # an integer longer than this is no config value (json refuses past 4300 digits, a ValueError)
MAX_LAYERS = 10_000  # the largest models have a few hundred layers; beyond this is a mistake, not a model


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
    _check_depth(shown, text)
    try:  # an over-long integer is kept as text here; _locate refuses it with its line
        data = json.loads(text, parse_int=lambda s: int(s) if len(s) <= MAX_DIGITS + 1 else s)
    except json.JSONDecodeError as exc:
        raise InputError(shown, exc.lineno, "", f"not valid JSON: {exc.msg} (column {exc.colno})") from None
    if not isinstance(data, dict):
        raise InputError(shown, 1, "", f"a config.json holds one JSON object, not {_json_type(data)}")
    return _model(_Doc(shown, _locate(shown, text)), data)


def _check_depth(shown: str, text: str) -> None:
    """Refuse nesting deeper than a config has before json recurses into it (a RecursionError, not an error)."""
    depth = 0
    for m in _BRACKET_OR_STRING.finditer(text):
        c = m.group()
        if c in ("[", "{"):
            depth += 1
            if depth > MAX_DEPTH:
                raise InputError(shown, _line(text, m.start()), "", f"nested deeper than {MAX_DEPTH} levels: not a "
                                                                    "model's config.json")
        elif c in ("]", "}"):
            depth -= 1


_BRACKET_OR_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|[\[\]{}]', re.DOTALL)
_WS = re.compile(r"[ \t\n\r]*")
_NUMBER = re.compile(r"-?(\d+)(\.\d+)?([eE][-+]?\d+)?")
FieldPath = tuple[str | int, ...]  # a field's path: object keys and list indices


def _line(text: str, pos: int) -> int:
    return text.count("\n", 0, pos) + 1


class _Locator:
    """Walks JSON text that json.loads accepted, noting the line of every key by its path (json gives lines only
    for syntax errors) and refusing what json.loads takes silently: a key given twice, an over-long integer."""

    def __init__(self, shown: str, text: str) -> None:
        self.shown, self.text = shown, text
        self.newlines = [m.start() for m in re.finditer("\n", text)]
        self.lines: dict[FieldPath, int] = {}

    def line(self, pos: int) -> int:
        return bisect_right(self.newlines, pos - 1) + 1

    def ws(self, pos: int) -> int:
        m = _WS.match(self.text, pos)
        assert m is not None  # matches the empty string
        return m.end()

    def value(self, pos: int, path: FieldPath) -> int:
        """Walk the value at `pos`; the position after it."""
        c = self.text[pos]
        if c == "{":
            return self.members(pos + 1, path)
        if c == "[":
            pos, i = self.ws(pos + 1), 0
            if self.text[pos] == "]":
                return pos + 1
            while True:
                pos = self.ws(self.value(pos, (*path, i)))
                if self.text[pos] == "]":
                    return pos + 1
                pos, i = self.ws(pos + 1), i + 1  # past the comma
        if c == '"':
            return scanstring(self.text, pos + 1)[1]
        m = _NUMBER.match(self.text, pos)
        if m is not None:
            if len(m.group(1)) > MAX_DIGITS:
                raise InputError(self.shown, self.line(pos), _field(path), f"a number of {len(m.group(1))} digits: "
                                                                          "not a value of a model's config")
            return m.end()
        word = next(w for w in ("true", "false", "null", "NaN", "Infinity", "-Infinity")
                    if self.text.startswith(w, pos))
        return pos + len(word)

    def members(self, pos: int, path: FieldPath) -> int:
        seen: dict[str, int] = {}
        pos = self.ws(pos)
        if self.text[pos] == "}":
            return pos + 1
        while True:
            key, end = scanstring(self.text, pos + 1)
            line = self.line(pos)
            if key in seen:
                raise InputError(self.shown, line, _field((*path, key)), f"given twice (also on line {seen[key]}): "
                                                                         "json would keep only the last")
            seen[key] = self.lines[(*path, key)] = line
            pos = self.ws(self.ws(end) + 1)  # past the colon
            pos = self.ws(self.value(pos, (*path, key)))
            if self.text[pos] == "}":
                return pos + 1
            pos = self.ws(pos + 1)  # past the comma


def _locate(shown: str, text: str) -> dict[FieldPath, int]:
    loc = _Locator(shown, text)
    loc.value(loc.ws(0), ())
    return loc.lines


def _field(path: FieldPath) -> str:
    """How messages name a path: text_config.layer_types[1]."""
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else f".{part}" if out else part
    return out


@dataclass(frozen=True)
class _Doc:
    """The config's name and where each of its keys is."""

    shown: str
    lines: dict[FieldPath, int]

    def error(self, path: FieldPath, message: str) -> InputError:
        # a list's entry is named by the line of the key that holds the list
        keyed = path
        while keyed and isinstance(keyed[-1], int):
            keyed = keyed[:-1]
        return InputError(self.shown, self.lines.get(keyed), _field(path), message)


def _model(doc: _Doc, data: dict[str, Any]) -> Model:
    model_type = data.get("model_type")
    if model_type is None:
        raise doc.error(("model_type",), f"missing: a transformers config.json names its model type; fleetcuda "
                                         f"knows {known_types()}")
    if not isinstance(model_type, str):
        raise doc.error(("model_type",), f"must be a string, not {_json_type(model_type)}")
    kind = KINDS.get(model_type)
    if kind is None:
        raise doc.error(("model_type",), f"{_shown(model_type)} is not a model type fleetcuda knows the layers of "
                                         f"(it knows {known_types()}); it does not guess")
    architectures = data.get("architectures") or []
    if not isinstance(architectures, list) or not all(isinstance(a, str) for a in architectures):
        raise doc.error(("architectures",), "must be a list of class names")
    fields, at = data, ()
    if kind.text_type is not None:
        fields, at = data.get("text_config"), ("text_config",)
        if fields is None:
            raise doc.error(at, f"missing: a {kind.model_type} config holds its text model's layers there "
                                f"(model_type {kind.text_type})")
        if not isinstance(fields, dict):
            raise doc.error(at, f"must be an object, not {_json_type(fields)}")
        nested = fields.get("model_type", kind.text_type)
        if nested != kind.text_type:
            raise doc.error((*at, "model_type"), f"{_shown(nested)}: a {kind.model_type} config's text model is "
                                                 f"{kind.text_type}")
    layer_types, derived = _layer_types(doc, fields, kind, at)
    return Model(doc.shown, kind, tuple(architectures), layer_types, derived)


def _positive(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _layer_types(doc: _Doc, fields: dict[str, Any], kind: Kind, at: FieldPath) -> tuple[tuple[str, ...], str]:
    n = fields.get("num_hidden_layers")
    if n is not None and not _positive(n):
        raise doc.error((*at, "num_hidden_layers"), f"must be a positive integer, not {_shown(n)}")
    if n is not None and n > MAX_LAYERS:  # refused before a list of that many is built
        raise doc.error((*at, "num_hidden_layers"), f"{_shown(n)} is more layers than a model has (fleetcuda reads "
                                                    f"at most {MAX_LAYERS})")
    given = fields.get("layer_types")
    if given is not None:
        if not isinstance(given, list) or not given:
            raise doc.error((*at, "layer_types"), f"must be a non-empty list, not {_shown(given)}")
        if len(given) > MAX_LAYERS:
            raise doc.error((*at, "layer_types"), f"has {len(given)} entries, more layers than a model has "
                                                  f"(fleetcuda reads at most {MAX_LAYERS})")
        for i, t in enumerate(given):
            if not isinstance(t, str) or t not in PATHS:  # an object or a list cannot be looked up
                raise doc.error((*at, "layer_types", i), f"{_shown(t)} is not a layer type of {kind.model_type} "
                                                         f"(it has {', '.join(PATHS)})")
        if n is not None and n != len(given):
            raise doc.error((*at, "layer_types"), f"has {len(given)} entries but num_hidden_layers is {n}")
        return tuple(given), "layer_types"
    if n is None:
        raise doc.error((*at, "num_hidden_layers"), "missing, and no layer_types: the number of layers is not said")
    interval = fields.get("full_attention_interval")
    derived = f"full_attention_interval {interval}"
    if interval is None:
        interval, derived = DEFAULT_INTERVAL, f"full_attention_interval {DEFAULT_INTERVAL} (transformers' default)"
    elif not _positive(interval):
        raise doc.error((*at, "full_attention_interval"), f"must be a positive integer, not {_shown(interval)}")
    return tuple(LINEAR if (i + 1) % interval else FULL for i in range(n)), derived


def _json_type(value: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", int: "a number",
            float: "a number", type(None): "null"}.get(type(value), type(value).__name__)


def _shown(value: Any) -> str:
    text = json.dumps(value, ensure_ascii=True)
    return text if len(text) <= 60 else text[:57] + "..."
