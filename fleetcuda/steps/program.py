"""`kind: program`: a Python program that ships with fleetcuda (fleetcuda/remote/, see `remote.catalog()`) as
the step's verify: an assertion, nothing to apply.

    - name: fast-path
      kind: program
      program: fast_path_gate
      args: []                    # its argv, each rendered ({{ }}) and quoted
      env: {REQUIRE_TRANSFORMERS: "{{ require_transformers_fast_path }}"}

The program's text is sent as it is in the package (the same text doctor or any other user of it sends),
run by the target's venv python unless `python` says otherwise; its exit status is the step's answer.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from fleetcuda.plan.command import quote
from fleetcuda.remote import PROGRAMS, program, python_heredoc
from fleetcuda.steps.base import Scripts, StepContext, StepSpec


class ProgramStep(StepSpec):
    kind: Literal["program"]
    program: str = Field(description="a Python program of fleetcuda/remote/, by name (e.g. fast_path_gate)")
    args: list[str] = Field(default_factory=list)
    python: str | None = Field(default=None, description="default: the target's venv python")

    @field_validator("program")
    @classmethod
    def _known(cls, name: str) -> str:
        known = [n for n, (_, language) in PROGRAMS.items() if language == "python"]
        if name not in known:
            raise ValueError(f"no program {name!r} ships with fleetcuda (known: {', '.join(known)})")
        return name

    def scripts(self, ctx: StepContext) -> Scripts:
        python = ctx.raw(self.python) if self.python else ctx.python
        args = " ".join(quote(ctx.raw(a)) for a in self.args)
        verify = python_heredoc(quote(python), self.program, args)
        return Scripts(None, None, verify, expect=self.description or f"{self.program} exits 0")

    def describe(self, ctx: StepContext) -> str:
        python = ctx.raw(self.python) if self.python else ""
        args = " ".join(quote(ctx.raw(a)) for a in self.args)
        return (f"program: {self.program} (sha256:{program(self.program).sha256[:12]})"
                + (f" run by {python}" if python else "") + (f" with {args}" if args else "")
                + ", an assertion: exit 0 or the step fails")
