"""`kind: env_file`: variables exported to later steps and persisted in a profile file for users."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from fleetcuda.plan.command import quote
from fleetcuda.steps.base import EnvName, Scripts, StepContext, StepSpec, all_of, lines_of


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
        # The file's text is made on the target from shell variables, so that a secret value is in no
        # script (nor on a command line): `sq` single-quotes a value for the sh that reads profile.d.
        header = f"# Written by fleetcuda (recipe {ctx.recipe}, step {self.name}); changes are overwritten."
        lines = ["sq() {",
                 "  case $1 in",  # plain words stay bare, as command.quote leaves them
                 "    ''|[!A-Za-z0-9_/.:@%+,-]*|*[!A-Za-z0-9_/.:@%+,=-]*)",
                 "      local s=${1//\\'/\\'\\\\\\'\\'}; printf \"'%s'\" \"$s\" ;;",
                 "    *) printf '%s' \"$1\" ;;",
                 "  esac",
                 "}", "content() {",
                 f"  printf '%s\\n' {quote(header)}"]
        for k, v in exports.items():
            lines.append(f'  printf \'export {k}=%s\\n\' "$(sq "${{{ctx.var(k, v)}}}")"')
        if prepend:
            path_line = "export PATH=" + ":".join(quote(p) for p in prepend) + ':"$PATH"'
            lines.append(f"  printf '%s\\n' {quote(path_line)}")
        lines.append("}")
        content = "\n".join(lines)
        same = f"{content}\ncontent | cmp -s - {quote(path)}"
        done = all_of(same, ctx.shell(self.verify) if self.verify else None)
        apply = "\n".join([
            "set -e -o pipefail",
            content,
            f"target={quote(path)}",
            'mkdir -p -- "$(dirname -- "$target")"',
            'tmp=$(mktemp "$target.XXXXXX")',
            'content > "$tmp"',
            'chmod 0644 "$tmp"',
            'mv -f -- "$tmp" "$target"',
        ])
        expect = f"{path} exports " + ", ".join([*(f"{k}={v}" for k, v in exports.items()),
                                                 *(f"PATH+={p}" for p in prepend)])
        return Scripts(done, apply, done, exports=exports, path_prepend=prepend, expect=expect)

    def describe(self, ctx: StepContext) -> str:
        path = ctx.raw(self.path) if self.path else f"/etc/profile.d/{self.name}.sh"
        values = [f"{k}={ctx.raw(v)}" for k, v in self.vars.items()]
        if self.path_prepend:
            values.append("PATH=" + ":".join(ctx.raw(p) for p in self.path_prepend) + ":$PATH")
        return (f"file: {path} (0644, replaced atomically): " + " ".join(values)
                + "; later steps get them too" + (f"; and its verify ({lines_of(self.verify)})" if self.verify else ""))
