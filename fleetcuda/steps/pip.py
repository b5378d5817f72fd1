"""`kind: pip_install`: packages into the target's venv, with uv when present and pip otherwise.

The check compares installed versions (ignoring a local `+tag`, as PEP 440's `==` does) and imports
the listed modules, so an extension broken by a torch upgrade counts as not installed and is
rebuilt. Apply reinstalls just the listed packages (never their dependencies), so a rebuild never
keeps a stale binary; `no_cache` keeps pip and uv from reusing a wheel built for another torch.
"""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import Field, StringConstraints

from fleetcuda.plan.command import quote
from fleetcuda.remote import python_heredoc
from fleetcuda.steps.base import Scripts, StepContext, StepSpec, all_of, lines_of

REQUIREMENT = re.compile(
    r"^(?P<name>[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?)(?:\[[A-Za-z0-9,._-]+\])?"
    r"(?:(?P<op>==|>=|<=|~=|!=|<|>)(?P<version>[A-Za-z0-9.*+!_-]+))?$"
)
MODULE = r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$"

def truthy(value: str) -> bool:
    return value.strip().lower() not in ("", "0", "false", "no", "off", "none")


def sources(ctx: StepContext, index_url: str | None, find_links: str | None, no_index: bool | str) -> str:
    """Where pip or uv looks for packages, in words (pip_install and sdist_build)."""
    links = ctx.raw(find_links) if find_links else ""
    index = ctx.raw(index_url) if index_url else ""
    only = truthy(ctx.raw(no_index)) if isinstance(no_index, str) else no_index
    where = ("the wheelhouse " if links.startswith("/") else "the links of ") + links if links else ""
    if only:
        return f"only from {where}" if where else "from no index (--no-index) and no wheelhouse"
    index = f"the index {index}" if index else "PyPI"
    return f"from {where}, else {index}" if where else f"from {index}"


def installer(ctx: StepContext, uv: str | None) -> str:
    """Which installer apply runs: uv when the `uv` value names an executable there, pip otherwise."""
    path = ctx.raw(uv) if uv else ctx.values.get("uv", "")
    return f"uv ({path}) if there, else pip" if path else "pip"


def check_script(python: str, wanted: list[str], imports: list[str]) -> str:
    """Exit 0 when every `name` / `name==version` is installed (local +tag ignored) and imports
    (fleetcuda/remote/import_check.py)."""
    return python_heredoc(quote(python), "import_check", f"{quote(' '.join(wanted))} {quote(' '.join(imports))}")


class PipInstallStep(StepSpec):
    kind: Literal["pip_install"]
    packages: list[Annotated[str, StringConstraints(min_length=1)]] = Field(min_length=1)
    imports: list[Annotated[str, StringConstraints(pattern=MODULE)]] = Field(default_factory=list)
    python: str | None = Field(default=None, description="default: the target's venv python")
    uv: str | None = Field(default=None, description="uv binary to prefer (default: the `uv` variable)")
    index_url: str | None = None
    extra_index_url: str | None = None
    find_links: str | None = Field(default=None, description="a local wheelhouse directory or URL")
    no_index: bool | str = Field(default=False, description="true, or a variable such as {{ no_index }}")
    no_build_isolation: bool = False
    no_cache: bool = False
    no_binary: bool = Field(default=False, description="build these packages from source")
    no_deps: bool = False
    verify: str | None = Field(default=None, description="extra condition for check and verify")

    def scripts(self, ctx: StepContext) -> Scripts:
        specs = [ctx.raw(p) for p in self.packages]
        names = []
        for spec in specs:
            m = REQUIREMENT.match(spec)
            if not m:
                raise ValueError(f"{spec!r} is not a requirement like name or name==version")
            names.append(m.group("name"))
        python = ctx.raw(self.python) if self.python else ctx.python
        # Only exact pins are compared; other specifiers just need the package present.
        wanted = [n + ("==" + m.group("version") if m.group("op") == "==" else "")
                  for n, m in zip(names, (REQUIREMENT.match(s) for s in specs), strict=True)]
        done = all_of(check_script(python, wanted, self.imports), ctx.shell(self.verify) if self.verify else None)

        uv = ctx.raw(self.uv) if self.uv else ctx.values.get("uv", "")
        common_uv, common_pip = [], []
        # Indexes go in the installer's environment, not its argv: an index URL often carries a token,
        # and argv is readable by anyone on the target (`ps`).
        env_uv, env_pip = [], []
        for opt, uv_var, pip_var in [(self.index_url, "UV_INDEX_URL", "PIP_INDEX_URL"),
                                     (self.extra_index_url, "UV_EXTRA_INDEX_URL", "PIP_EXTRA_INDEX_URL")]:
            if opt and (value := ctx.raw(opt)):
                env_uv.append(f"{uv_var}={quote(value)}")
                env_pip.append(f"{pip_var}={quote(value)}")
        if self.find_links and (value := ctx.raw(self.find_links)):
            common_uv += ["--find-links", value]
            common_pip += ["--find-links", value]
        for flag, uv_flag, pip_flag in [
            (truthy(ctx.raw(self.no_index)) if isinstance(self.no_index, str) else self.no_index,
             "--no-index", "--no-index"),
            (self.no_build_isolation, "--no-build-isolation", "--no-build-isolation"),
            (self.no_cache, "--no-cache", "--no-cache-dir"),
            (self.no_deps, "--no-deps", "--no-deps"),
        ]:
            if flag:
                common_uv.append(uv_flag)
                common_pip.append(pip_flag)
        if self.no_binary:
            for n in names:
                common_uv += ["--no-binary-package", n]
            common_pip += ["--no-binary", ",".join(names)]
        # Reinstall only the named packages (a broken or stale build must be rebuilt), never their
        # dependencies: a forced reinstall of torch would be a disaster.
        reinstall_uv = [a for n in names for a in ("--reinstall-package", n)]
        uv_cmd = [*env_uv, '"$uv"',
                  *map(quote, ["pip", "install", "--python", python, *reinstall_uv, *common_uv, *specs])]
        pip = [python, "-m", "pip", "install", "--disable-pip-version-check", "--no-input", *common_pip]
        pip_cmds = [" ".join([*env_pip, *map(quote, [*pip, "--force-reinstall", "--no-deps", *specs])])]
        if not self.no_deps:
            pip_cmds.append(" ".join([*env_pip, *map(quote, [*pip, *specs])]))
        apply = "\n".join([
            "set -e -o pipefail",
            f"uv={quote(uv)}",
            'if [ -n "$uv" ] && [ -x "$uv" ]; then',
            "  " + " ".join(uv_cmd),
            "else",
            *("  " + c for c in pip_cmds),
            "fi",
        ])
        expect = ", ".join(wanted) + "".join(f"; import {m}" for m in self.imports)
        return Scripts(done, apply, done, expect=expect)

    def describe(self, ctx: StepContext) -> str:
        flags = [f for f, on in (("--no-build-isolation", self.no_build_isolation), ("--no-cache", self.no_cache),
                                 ("--no-binary", self.no_binary), ("--no-deps", self.no_deps)) if on]
        python = ctx.raw(self.python) if self.python else ""
        extra = ctx.raw(self.extra_index_url) if self.extra_index_url else ""
        parts = [installer(ctx, self.uv) + (f" into {python}" if python else ""),
                 *([f"extra index {extra}"] if extra else []), *flags, "no dependency reinstalled"]
        if self.imports:
            parts.append("check: the pins and import " + ", ".join(self.imports))
        if self.verify:
            parts.append(f"and its verify ({lines_of(self.verify)})")
        return (f"pip: {' '.join(ctx.raw(p) for p in self.packages)} "
                f"{sources(ctx, self.index_url, self.find_links, self.no_index)} ({'; '.join(parts)})")
