"""`kind: apt_keyring` and `kind: apt_packages`: a repository keyring from a .deb URL, and packages."""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import Field, StringConstraints

from fleetcuda.plan.command import quote
from fleetcuda.remote import shell_text
from fleetcuda.steps.base import Scripts, StepContext, StepSpec, all_of, lines_of

PACKAGE = r"^[a-z0-9][a-z0-9+.-]+(=[A-Za-z0-9.+:~-]+)?$"
# Wait for dpkg's lock (unattended-upgrades) for a bounded time instead of failing or breaking it.
APT = "apt-get -o DPkg::Lock::Timeout={lock} -o Dpkg::Use-Pty=0 -q"
NONINTERACTIVE = "export DEBIAN_FRONTEND=noninteractive NEEDRESTART_MODE=l"

# fetch URL DEST: apt's own fetcher, else curl or wget; local paths copied (fleetcuda/remote/fetch.sh).
FETCH = shell_text("fetch")


def lock_seconds(ctx: StepContext, value: int | str) -> int:
    """dpkg's lock (unattended-upgrades, another apt) is waited for, boundedly, and never removed."""
    text = ctx.raw(value) if isinstance(value, str) else str(value)
    if not text.isdigit() or int(text) > 24 * 3600:
        raise ValueError(f"lock_timeout {text!r}: expected seconds, 0 to 86400")
    return int(text)


def installed(package: str) -> str:
    """Shell condition: package is installed (and at the pinned version, if `name=version`)."""
    name, _, version = package.partition("=")
    status = f"dpkg-query -W -f='${{db:Status-Abbrev}}${{Version}}' {quote(name)} 2>/dev/null"
    if version:
        return f'[ "$({status})" = {quote("ii " + version)} ]'
    return f'case "$({status})" in "ii "*) true ;; *) false ;; esac'


class AptKeyringStep(StepSpec):
    kind: Literal["apt_keyring"]
    package: Annotated[str, StringConstraints(pattern=r"^[a-z0-9][a-z0-9+.-]+$")] = "cuda-keyring"
    repo_url: str = Field(description="base URL; <distro>/<arch>/<filename> is appended")
    filename: str = "cuda-keyring_1.1-1_all.deb"
    distro: str = Field(default="auto", description="like debian12 or ubuntu2404; auto reads /etc/os-release")
    keyring: str = "/usr/share/keyrings/cuda-archive-keyring.gpg"
    lock_timeout: int | str = Field(default=300, description="seconds to wait for dpkg's lock; never broken")
    verify: str | None = Field(default=None, description="extra condition for check and verify")

    def scripts(self, ctx: StepContext) -> Scripts:
        done = all_of(installed(self.package), f"test -s {quote(ctx.raw(self.keyring))}",
                      ctx.shell(self.verify) if self.verify else None)
        distro = ctx.raw(self.distro)
        apply = "\n".join([
            "set -e -o pipefail",
            NONINTERACTIVE,
            FETCH,
            f"distro={quote(distro)}",
            'if [ "$distro" = auto ]; then . /etc/os-release; distro="${ID}${VERSION_ID//./}"; fi',
            'case "$(uname -m)" in x86_64) arch=x86_64 ;; aarch64) arch=sbsa ;; '
            '*) echo "fleetcuda: no NVIDIA repository for $(uname -m)" >&2; exit 1 ;; esac',
            f'url={quote(ctx.raw(self.repo_url).rstrip("/"))}/"$distro/$arch"/{quote(ctx.raw(self.filename))}',
            'tmp=$(mktemp -d); trap \'rm -rf "$tmp"\' EXIT',
            'echo "fetching $url"',
            'fetch "$url" "$tmp/keyring.deb"',
            f"{APT.format(lock=lock_seconds(ctx, self.lock_timeout))} install -y \"$tmp/keyring.deb\"",
            f"{APT.format(lock=lock_seconds(ctx, self.lock_timeout))} update",
        ])
        return Scripts(done, apply, done, expect=f"{self.package} installed, {ctx.raw(self.keyring)} present")

    def describe(self, ctx: StepContext) -> str:
        distro = ctx.raw(self.distro)
        auto = distro == "auto"
        return (f"apt: keyring {self.package} ({ctx.raw(self.keyring)}): {ctx.raw(self.filename)} from "
                f"{'<distro>' if auto else distro}/<arch>/ of {ctx.raw(self.repo_url).rstrip('/')}, then apt-get "
                "update (" + ("<distro> from /etc/os-release, " if auto else "") + "<arch> from uname -m"
                + _extra(self.verify) + ")")


class AptPackagesStep(StepSpec):
    kind: Literal["apt_packages"]
    packages: list[Annotated[str, StringConstraints(min_length=1)]] = Field(min_length=1)
    update: bool = Field(default=True, description="run apt-get update before installing")
    lock_timeout: int | str = Field(default=300, description="seconds to wait for dpkg's lock; never broken")
    verify: str | None = Field(default=None, description="extra condition for check and verify")

    def scripts(self, ctx: StepContext) -> Scripts:
        packages = [ctx.raw(p) for p in self.packages]
        for p in packages:
            if not re.fullmatch(PACKAGE, p):
                raise ValueError(f"{p!r} is not a Debian package name (optionally name=version)")
        # Says which packages are missing, so that a report's `found` names them.
        missing = "\n".join(["fc_apt_missing="]
                            + [f'{installed(p)} || fc_apt_missing="$fc_apt_missing {p}"' for p in packages]
                            + ['[ -z "$fc_apt_missing" ] || { echo "not installed:$fc_apt_missing"; exit 1; }'])
        done = all_of(missing, ctx.shell(self.verify) if self.verify else None)
        apt = APT.format(lock=lock_seconds(ctx, self.lock_timeout))
        apply = "\n".join(filter(None, [
            "set -e -o pipefail",
            NONINTERACTIVE,
            f"{apt} update" if self.update else None,
            # Apply runs only when the check failed: a package that dpkg calls installed but whose files
            # are broken (the step's verify condition) must be reinstalled, not skipped.
            f"{apt} install -y --no-install-recommends --reinstall " + " ".join(quote(p) for p in packages),
        ]))
        return Scripts(done, apply, done, expect="installed: " + ", ".join(packages))

    def describe(self, ctx: StepContext) -> str:
        how = ["apt-get update first"] if self.update else []
        how.append(f"waits up to {ctx.raw(str(self.lock_timeout))} s for dpkg's lock")
        packages = " ".join(ctx.raw(p) for p in self.packages)
        return f"apt: install {packages} (" + "; ".join(how) + _extra(self.verify) + ")"


def _extra(verify: str | None) -> str:
    return f"; and its verify ({lines_of(verify)})" if verify else ""
