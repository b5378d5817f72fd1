"""`kind: env_file`: variables exported to later steps and persisted in a profile file for users."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from fleetcuda.command import quote
from fleetcuda.steps.base import EnvName, Scripts, StepContext, StepSpec, all_of


class EnvFileStep(StepSpec):
    kind: Literal["env_file"]
    path: str | None = Field(default=None, description="default /etc/profile.d/<step name>.sh")
    vars: dict[EnvName, str] = Field(default_factory=dict)
    path_prepend: list[str] = Field(default_factory=list)
    verify: str | None = Field(default=None, description="extra condition for check and verify")

    def scripts(self, ctx: StepContext) -> Scripts:
        path = ctx.raw(self.path) if self.path else f"/etc/profile.d/{self.name}.sh"
        exports = {k: ctx.raw(v) for k, v in self.vars.items()}
        prepend = [ctx.raw(p) for p in self.path_prepend]
        lines = [f"# Written by fleetcuda (recipe {ctx.recipe}, step {self.name}); changes are overwritten."]
        lines += [f"export {k}={quote(v)}" for k, v in exports.items()]
        if prepend:
            lines.append("export PATH=" + ":".join(quote(p) for p in prepend) + ':"$PATH"')
        content = "\n".join(lines) + "\n"
        same = f"printf '%s' {quote(content)} | cmp -s - {quote(path)}"
        done = all_of(same, ctx.shell(self.verify) if self.verify else None)
        apply = "\n".join([
            "set -e -o pipefail",
            f"target={quote(path)}",
            'mkdir -p -- "$(dirname -- "$target")"',
            'tmp=$(mktemp "$target.XXXXXX")',
            f"printf '%s' {quote(content)} > \"$tmp\"",
            'chmod 0644 "$tmp"',
            'mv -f -- "$tmp" "$target"',
        ])
        expect = f"{path} exports " + ", ".join([*(f"{k}={v}" for k, v in exports.items()),
                                                 *(f"PATH+={p}" for p in prepend)])
        return Scripts(done, apply, done, exports=exports, path_prepend=prepend, expect=expect)
