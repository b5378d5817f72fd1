"""What every step kind shares. A kind is a module that turns its fields into check/apply/verify scripts."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Annotated, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StrictInt, StringConstraints

from fleetcuda.plan.inventory import SAFE_NAME, VAR_NAME
from fleetcuda.plan.templating import render, render_shell

StepName = Annotated[str, StringConstraints(pattern=SAFE_NAME)]
EnvName = Annotated[str, StringConstraints(pattern=VAR_NAME)]
# pydantic's regex engine: `\A`/`\z` are the very start and end of the text (never `$`, which Python's re lets
# match before a trailing newline).
WHEN = r"\A\s*!?\s*[A-Za-z_][A-Za-z0-9_]*\s*((==|!=)\s*\S.*)?\z"


def _not_bool(value: object) -> object:
    # `retry_delay: true` is a mistake, not 1.0 seconds. (Numbers arrive as YAML text, so the float is not strict.)
    if isinstance(value, bool):
        raise ValueError(f"expected a number of seconds, not {str(value).lower()}")
    return value


Seconds = Annotated[float, BeforeValidator(_not_bool)]


class StepSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: StepName
    kind: str = "shell"
    description: str | None = None
    when: Annotated[str, StringConstraints(pattern=WHEN)] | None = Field(
        default=None, description="`var`, `!var`, `var == value` or `var != value`")
    env: dict[EnvName, str | int | bool] = Field(default_factory=dict)
    # Strict: `timeout: true` or `retries: true` must not become 1.
    timeout: StrictInt = Field(default=1800, ge=1, le=24 * 3600, description="seconds, per command")
    retries: StrictInt = Field(default=0, ge=0, le=10, description="extra tries of apply, for retryable steps")
    retry_delay: Seconds = Field(default=5.0, ge=0, le=600, description="first backoff, doubled each try")
    satisfied_if: str | None = Field(
        default=None, description="shell condition that, when it holds, satisfies the step whatever its check says "
                                  "(e.g. a CUDA toolchain installed some other way)")
    on: Literal["container", "host"] = Field(
        default="container", description="where check/apply/verify run: in the container, or on its Proxmox host "
                                         "(the same machine for a target without containers)")

    def describe(self, ctx: StepContext) -> str:
        """What the step does, in an operator's words, from its own fields with `ctx`'s values (the dry-run's
        summary: plan/view.py). A value read from the target at run time reads as `<name>` there."""
        return f"{self.kind}"


@dataclass
class StepContext:
    """What a kind may read while planning: the variables and the target's Python. One per step: it
    collects the shell variables that the step's scripts refer to (see templating.render_shell)."""

    values: Mapping[str, str]
    python: str
    recipe: str
    shell_vars: dict[str, str] = field(default_factory=dict)  # shell variable -> value
    sources: dict[str, str] = field(default_factory=dict)  # shell variable -> the variable it comes from
    # For a step that runs on the host: the argv, on the host, that runs a script inside the target (its
    # `[sudo -n] pct exec VMID -- env -i ... bash -c`, or just `env -i ... bash -c` without containers), and
    # the argv of `[sudo -n --] pct COMMAND VMID` (None without containers). Set by the planner.
    in_target: Callable[[str], list[str]] | None = None
    pct: Callable[[str], list[str]] | None = None

    def shell(self, text: str) -> str:
        """Shell text with each {{ }} as a reference to a variable the step's commands set first."""
        rendered = render_shell(text, self.values)
        self.shell_vars.update(rendered.vars)
        self.sources.update(rendered.names)
        return rendered.text

    def raw(self, text: str) -> str:
        return render(text, self.values)

    def var(self, source: str, value: str) -> str:
        """A shell variable holding `value` (named after `source`, e.g. an env_file's variable), for
        scripts that must not contain the value itself (it may be a secret)."""
        name = f"fce_{source}"
        self.shell_vars[name] = value
        self.sources[name] = source
        return name


@dataclass
class SharedBuild:
    """A compiled extension built once per ABI fingerprint: scripts for the engine, which decides per target
    whether to build (then fetch the wheel into its cache) or to install the cached wheel."""

    package: str
    version: str
    fingerprint: str  # read-only: prints the target's fingerprint
    build: str  # builds the wheel, installs it, records it, and leaves it for the control machine to fetch
    # Installs the cached wheel: a script, like the others, that reads what is only known at run time from the
    # shell variables INSTALL_VARS (the wheel's path in the target, its sha256, the fingerprint and provenance
    # JSON), which the engine sets (planner.install_command).
    install: str


INSTALL_VARS = ("fc_wheel", "fc_wheel_sha256", "fc_fingerprint", "fc_provenance")


@dataclass
class Scripts:
    check: str | None
    apply: str | None
    verify: str | None
    # Variables later steps see (and PATH entries they get first).
    exports: dict[str, str] = field(default_factory=dict)
    path_prepend: list[str] = field(default_factory=list)
    expect: str = ""  # what the check proves, in words
    shared: SharedBuild | None = None


def lines_of(script: str | None) -> str:
    """`N lines`, for summaries that name a script without showing it."""
    n = len((script or "").strip("\n").splitlines())
    return f"{n} line{'s' if n != 1 else ''}"


def all_of(*conditions: str | None) -> str | None:
    """Join shell conditions so the script fails at the first unmet one."""
    parts = [c.strip() for c in conditions if c and c.strip()]
    if len(parts) <= 1:
        return parts[0] if parts else None
    return "\n".join(f"{{\n{p}\n}} || exit 1" for p in parts)
