"""`kind: shell`: explicit check/apply/verify scripts (bash). A step without apply is an assertion."""

from __future__ import annotations

from typing import Literal

from pydantic import model_validator

from fleetcuda.steps.base import Scripts, StepContext, StepSpec, lines_of

SHOWN = 100  # the longest one-line script a summary shows whole


class ShellStep(StepSpec):
    kind: Literal["shell"] = "shell"
    check: str | None = None
    apply: str | None = None
    verify: str | None = None

    @model_validator(mode="after")
    def _idempotent(self) -> ShellStep:
        if self.apply is not None and self.check is None:
            raise ValueError("a step with `apply` needs a `check`, so that a second run is a no-op")
        if self.check is None and self.verify is None:
            raise ValueError("a shell step needs a `check` or a `verify`")
        return self

    def scripts(self, ctx: StepContext) -> Scripts:
        def render(text: str | None) -> str | None:
            return ctx.shell(text) if text is not None else None

        return Scripts(render(self.check), render(self.apply), render(self.verify))

    def describe(self, ctx: StepContext) -> str:
        def said(phase: str, text: str) -> str:
            # A one-line script is shown, its values in place (a summary to read, not to paste); a longer one counted.
            line = ctx.raw(text.strip())
            return f"{phase} `{line}`" if "\n" not in line and len(line) <= SHOWN else f"{phase} ({lines_of(text)})"

        phases = (("check", self.check), ("apply", self.apply), ("verify", self.verify))
        scripts = "; ".join(said(phase, text) for phase, text in phases if text is not None)
        return ("shell: an assertion: " if self.apply is None else "shell: ") + scripts
