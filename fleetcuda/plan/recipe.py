"""Recipes: variables with defaults, facts read from targets for `auto` values, and ordered steps."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

from fleetcuda.errors import InputError
from fleetcuda.plan.inventory import SAFE_NAME, VAR_NAME, VAR_NAME_RE, VarValue, var_to_str
from fleetcuda.plan.templating import TemplateError, references
from fleetcuda.plan.yamlsrc import SourceDoc, load_yaml
from fleetcuda.steps import KINDS, StepSpec

AUTO = "auto"
_UNCARRIABLE = re.compile("[\x00\ud800-\udfff]")
# A fact's value must be a plain token (a version, a count): it is used in package names and paths.
# Checked with fullmatch: `$` would also let a value with a trailing newline through.
FACT_VALUE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,63}")
# Values set by fleetcuda itself for each target; a recipe or inventory cannot override them.
BUILTIN_VARS = ("target", "host", "vmid", "container", "venv", "python")

VarName = Annotated[str, StringConstraints(pattern=VAR_NAME)]


class WheelhouseSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    wheels: list[Annotated[str, StringConstraints(min_length=1)]] = Field(default_factory=list)
    sdists: list[Annotated[str, StringConstraints(min_length=1)]] = Field(default_factory=list)
    sdist_env: dict[VarName, str] = Field(default_factory=dict)


class RecipeHead(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: Annotated[str, StringConstraints(pattern=SAFE_NAME)]
    description: str | None = None
    vars: dict[VarName, VarValue] = Field(default_factory=dict)
    facts: dict[VarName, Annotated[str, StringConstraints(min_length=1)]] = Field(
        default_factory=dict, description="read-only shell that prints a var's value when it is `auto`")
    env: dict[VarName, str | int | bool] = Field(default_factory=dict, description="environment of every step")
    wheelhouse: WheelhouseSpec | None = Field(default=None, description="what `fleetcuda wheelhouse build` stages")
    secrets: list[VarName] = Field(default_factory=list, description="variables never printed nor on a command line "
                                                                     "(besides those named like a token or password)")
    steps: list[Any] = Field(min_length=1)


@dataclass
class Recipe:
    path: str
    name: str
    description: str | None
    defaults: dict[str, str]
    facts: dict[str, str]
    env: dict[str, str]
    steps: list[StepSpec]
    source: SourceDoc
    wheelhouse: WheelhouseSpec | None = None
    secrets: tuple[str, ...] = ()

    def step_loc(self, index: int, field: str | None = None) -> tuple:
        return ("steps", index) + ((field,) if field else ())


def load_recipe(path: str | Path) -> Recipe:
    doc = load_yaml(path)
    if not isinstance(doc.data, dict):
        raise doc.error((), "a recipe is a mapping with `name` and `steps`")
    head: RecipeHead = doc.validate(RecipeHead)
    for name in head.vars:
        if name in BUILTIN_VARS:
            raise doc.error(("vars", name), f"{name!r} is set by fleetcuda for each target")
    for i, name in enumerate(head.secrets):
        if name not in head.vars:
            raise doc.error(("secrets", i), f"{name!r} is not a variable declared under `vars`")
    for name in head.facts:
        if name not in head.vars:
            raise doc.error(("facts", name), "a fact fills a variable declared under `vars` (value auto)")
    steps: list[StepSpec] = []
    seen: dict[str, int] = {}
    for i, raw in enumerate(head.steps):
        if not isinstance(raw, dict):
            raise doc.error(("steps", i), "a step is a mapping with at least `name`")
        kind = raw.get("kind", "shell")
        if not isinstance(kind, str) or kind not in KINDS:  # a list or mapping is not hashable
            raise doc.error(("steps", i, "kind"), f"unknown kind {kind!r} (known: {', '.join(KINDS)})")
        step: StepSpec = doc.validate(KINDS[kind], raw, base=("steps", i))
        if step.name in seen:
            raise doc.error(("steps", i, "name"), f"duplicate step name (also step {seen[step.name] + 1})")
        seen[step.name] = i
        steps.append(step)
    recipe = Recipe(
        path=doc.path,
        name=head.name,
        description=head.description,
        defaults={k: var_to_str(v) for k, v in head.vars.items()},
        facts=dict(head.facts),
        env={k: var_to_str(v) for k, v in head.env.items()},
        steps=steps,
        source=doc,
        wheelhouse=head.wheelhouse,
        secrets=tuple(head.secrets),
    )
    _check_references(recipe)
    return recipe


def _check_references(recipe: Recipe) -> None:
    """Every {{ var }} must be declared (or be a per-target builtin), found now rather than mid-run."""
    known = set(recipe.defaults) | set(BUILTIN_VARS)
    doc = recipe.source

    def walk(value: Any, loc: tuple) -> None:
        if isinstance(value, str):
            for ref in references(value):
                if ref not in known:
                    raise doc.error(loc, f"undefined variable {ref!r} (declare it under `vars`)")
        elif isinstance(value, dict):
            for k, v in value.items():
                walk(v, loc + (k,))
        elif isinstance(value, list):
            for i, v in enumerate(value):
                walk(v, loc + (i,))

    walk(doc.data.get("steps"), ("steps",))
    walk(doc.data.get("facts"), ("facts",))
    walk(doc.data.get("env"), ("env",))
    walk(doc.data.get("wheelhouse"), ("wheelhouse",))


def parse_var_overrides(items: list[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in items:
        name, sep, value = item.partition("=")
        # What is said of a bad --var names it by what stands before `=`, never its value: a value may be a secret,
        # and nothing has said yet which values are.
        shown = (name[:40] if name[:40].isprintable() else ascii(name[:40])) + ("=..." if sep else "")
        if bad := _UNCARRIABLE.search(item):
            # Bytes that are not UTF-8 reach argv as lone surrogates (surrogateescape); NUL cannot, but a caller
            # of this function could pass one. Neither can be put in a command.
            why = "is not UTF-8 text" if bad.group() != "\x00" else "contains a NUL character"
            raise InputError("--var", None, shown, f"{why}; expected NAME=VALUE with NAME like cuda_version")
        if not sep or not VAR_NAME_RE.fullmatch(name):
            raise InputError("--var", None, shown, "expected NAME=VALUE with NAME like cuda_version")
        if name in BUILTIN_VARS:
            raise InputError("--var", None, name, "set by fleetcuda for each target; cannot be overridden")
        out[name] = value
    return out


def check_fact_value(name: str, value: str, *, secret: bool = False) -> str:
    if not FACT_VALUE.fullmatch(value):
        shown = "a secret (not shown)" if secret else repr(value[:60])  # a secret is never quoted
        raise TemplateError(f"fact {name!r} printed {shown}, not a plain value")
    return value
