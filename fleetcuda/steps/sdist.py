"""`kind: sdist_build`: build a compiled extension from its sdist against the target's own torch.

Like pip_install with --no-build-isolation and no cache, plus what only a source build allows:
restricting the GPU architectures. causal-conv1d's setup.py hard-codes them per nvcc release
(nine with CUDA 13: over ten minutes on 16 cores) and ignores TORCH_CUDA_ARCH_LIST, so the only
way is to edit the unpacked setup.py. The edit filters the extension's nvcc `-gencode` pairs just
before `setup(` is called and refuses loudly if the file no longer looks as expected.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Literal

from pydantic import Field, StringConstraints

from fleetcuda.plan.command import quote
from fleetcuda.remote import program, python_heredoc, shell_text
from fleetcuda.remote.framing import PYTHON_NONCE, frame
from fleetcuda.steps.base import INSTALL_VARS, Scripts, SharedBuild, StepContext, StepSpec, all_of, lines_of
from fleetcuda.steps.pip import MODULE, check_script, installer, sources, truthy

PACKAGE = r"^[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?$"
VERSION = r"^[A-Za-z0-9.+!_-]+$"
ARCHS = re.compile(r"^(upstream|auto|\d{2,3}a?(,\d{2,3}a?)*)$")

# Run on the target with the unpacked setup.py and the wanted archs ("90,120"): fleetcuda/remote/arch_patch.py.
PATCH_ARCHS = program("arch_patch").text
# detect_archs: the GPUs' compute capabilities, as nvcc spells them (fleetcuda/remote/detect_archs.sh).
DETECT_ARCHS = shell_text("detect_archs")


RESOLVE_ARCHS = 'if [ "$archs" = auto ]; then archs=$(detect_archs); archs=${archs:-none}; fi'


class SdistBuildStep(StepSpec):
    kind: Literal["sdist_build"]
    package: Annotated[str, StringConstraints(pattern=PACKAGE)]
    version: str
    imports: list[Annotated[str, StringConstraints(pattern=MODULE)]] = Field(default_factory=list)
    python: str | None = Field(default=None, description="default: the target's venv python")
    uv: str | None = Field(default=None, description="uv binary to prefer (default: the `uv` variable)")
    index_url: str | None = None
    find_links: str | None = Field(default=None, description="a wheelhouse directory holding the sdist")
    no_index: bool | str = False
    cuda_archs: str = Field(default="upstream", description="upstream, auto (the GPUs present) or a list: 90,120")
    share: bool | str = Field(default=True, description="build a wheel once per ABI fingerprint and install it on "
                                                        "every target with the same fingerprint")
    verify: str | None = Field(default=None, description="extra condition for check and verify")

    def scripts(self, ctx: StepContext) -> Scripts:
        version = ctx.raw(self.version)
        if not re.fullmatch(VERSION, version):
            raise ValueError(f"{version!r} is not a version")
        archs = ctx.raw(self.cuda_archs).replace(" ", "")
        if not ARCHS.fullmatch(archs):
            raise ValueError(f"cuda_archs {archs!r}: expected upstream, auto, or a list like 90,120")
        share = truthy(ctx.raw(self.share)) if isinstance(self.share, str) else self.share
        python = ctx.raw(self.python) if self.python else ctx.python
        uv = ctx.raw(self.uv) if self.uv else ctx.values.get("uv", "")
        spec = f"{self.package}=={version}"
        done = all_of(check_script(python, [spec], self.imports), ctx.shell(self.verify) if self.verify else None)
        assert done is not None
        prologue = [f"PYTHON={quote(python)}", f"uv={quote(uv)}", f"archs={quote(archs)}", DETECT_ARCHS]

        def fp_program(mode: str, *args: str) -> str:
            """fleetcuda/remote/fingerprint.py in MODE; `show` and `record` report in a frame (the nonce: theirs)."""
            reports = mode in ("show", "record")
            return python_heredoc('"$PYTHON"', "fingerprint",
                                  " ".join([mode, quote(self.package), quote(version), '"$archs"', *args]),
                                  env=PYTHON_NONCE if reports else "")

        find_links = ctx.raw(self.find_links) if self.find_links else ""
        index_url = ctx.raw(self.index_url) if self.index_url else ""
        no_index = truthy(ctx.raw(self.no_index)) if isinstance(self.no_index, str) else self.no_index
        download = [python, "-m", "pip", "download", "--disable-pip-version-check", "--no-input", "--no-deps",
                    "--no-binary", ":all:", "--no-build-isolation", "-d", '"$work/dl"']
        index_env = f"PIP_INDEX_URL={quote(index_url)} " if index_url else ""  # not in argv: it may hold a token
        if find_links:
            download += ["--find-links", find_links]
        if no_index:
            download.append("--no-index")
        stem = self.package.replace("-", "_")
        lines = [
            "set -e -o pipefail",
            *prologue,
            'work=$(mktemp -d /tmp/fleetcuda-build.XXXXXX); trap \'rm -rf "$work"\' EXIT',
            'mkdir "$work/dl" "$work/src"',
            # The sdist straight from the wheelhouse when it is there; pip download otherwise (which
            # runs setup.py once for metadata: the step's environment must already be complete).
            "sdist=",
            *([f"for f in {quote(find_links)}/{stem}-{version}.tar.gz {quote(find_links)}/{self.package}-{version}"
               '.tar.gz; do [ -f "$f" ] && sdist=$f && break; done'] if find_links else []),
            'if [ -z "$sdist" ]; then',
            "  " + index_env + " ".join(a if a.startswith('"') else quote(a) for a in download) + " " + quote(spec),
            '  sdist=$(ls "$work"/dl/*.tar.gz | head -n 1)',
            "fi",
            'echo "fleetcuda: building $(basename "$sdist")"',
            'tar -xzf "$sdist" -C "$work/src"',
            'src=$(find "$work/src" -mindepth 1 -maxdepth 1 -type d | head -n 1)',
            'if [ "$archs" = auto ]; then',
            "  archs=$(detect_archs)",
            '  [ -n "$archs" ] || { echo "fleetcuda: cuda_archs=auto, but no GPU is visible here;'
            ' set cuda_archs to a list such as 90 or to upstream" >&2; exit 1; }',
            "fi",
            'if [ "$archs" != upstream ]; then',
            python_heredoc('"$PYTHON"', "arch_patch", '"$src/setup.py" "$archs"'),
            "fi",
        ]
        install_wheel = [
            'if [ -n "$uv" ] && [ -x "$uv" ]; then',
            f'  "$uv" pip install --python "$PYTHON" --no-index --no-cache --no-deps --reinstall-package '
            f'{quote(self.package)} "$whl"',
            "else",
            '  "$PYTHON" -m pip install --disable-pip-version-check --no-input --no-index --no-cache-dir --no-deps '
            '--force-reinstall "$whl"',
            "fi",
        ]
        built_for = {"upstream": "", "auto": "; built for the GPUs present"}.get(archs, f"; built for sm_{archs}")
        expect = spec + "".join(f"; import {m}" for m in self.imports) + built_for
        if not share:
            # No build cache and no isolation: built against this venv's torch, never a stale wheel.
            lines += [
                'if [ -n "$uv" ] && [ -x "$uv" ]; then',
                f'  "$uv" pip install --python "$PYTHON" --no-build-isolation --no-cache --no-deps '
                f'--reinstall-package {quote(self.package)} "$src"',
                "else",
                '  "$PYTHON" -m pip install --disable-pip-version-check --no-input --no-build-isolation '
                '--no-cache-dir --no-deps --force-reinstall "$src"',
                "fi",
            ]
            return Scripts(done, "\n".join(lines), done, expect=expect)

        # Shared: a wheel (no cache, no isolation) that this target installs, records, and leaves behind for the
        # control machine to fetch.
        provenance = json.dumps({"source": "built here", "built_on": ctx.values.get("target", "")})
        lines += [
            'mkdir "$work/wheel"',
            'if [ -n "$uv" ] && [ -x "$uv" ]; then',
            '  "$uv" build --wheel --no-build-isolation --no-cache --python "$PYTHON" -o "$work/wheel" "$src"',
            "else",
            '  "$PYTHON" -m pip wheel --disable-pip-version-check --no-input --no-build-isolation --no-cache-dir '
            '--no-deps -w "$work/wheel" "$src"',
            "fi",
            'set -- "$work"/wheel/*.whl',
            '[ "$#" = 1 ] && [ -f "$1" ] || { echo "fleetcuda: the build left no single wheel: $*" >&2; exit 1; }',
            # Left for the control machine only once everything here succeeded; removed on any failure.
            'keep=$(mktemp -d /tmp/fleetcuda-wheel.XXXXXX)',
            'trap \'rm -rf "$work"; [ "${published:-}" = 1 ] || rm -rf "$keep"\' EXIT',
            'whl="$keep/$(basename "$1")"',
            'mv "$1" "$whl"',
            *install_wheel,
            fp_program("record", quote(provenance)),
            'sha=$(sha256sum "$whl" | cut -d " " -f 1)',
            "published=1",
            frame("wheel", "$whl", "$sha"),
        ]
        # Taken just before a build or an install: nothing is changed, so it can be re-sent.
        fingerprint = "\n".join(["set -e", *prologue, RESOLVE_ARCHS, fp_program("show")])

        # What only the run knows (which wheel, its digest, the fingerprint it was built for) comes in the shell
        # variables INSTALL_VARS: the script itself is fixed, so a plan holds it whole.
        wheel, sha, fingerprint_json, provenance_json = (f'"${{{name}}}"' for name in INSTALL_VARS)
        install = "\n".join([
            "set -e -o pipefail", *prologue, RESOLVE_ARCHS,
            f"whl={wheel}",
            'trap \'rm -rf "$(dirname "$whl")"\' EXIT',
            f'if ! printf "%s  %s\\n" {sha} "$whl" | sha256sum -c --status -; then',
            f'  echo "fleetcuda: $whl does not have the sha256 of the cached wheel ({sha[1:-1]}): not installing" >&2',
            "  exit 1",
            "fi",
            fp_program("matches", fingerprint_json),
            *install_wheel,
            fp_program("record", provenance_json),
            'echo "fleetcuda: installed $(basename "$whl") from the control machine\'s cache"',
        ])

        # check and verify: installed and imports, and (when fleetcuda recorded the build) still built for this
        # target's ABI. A stale record is said last, so it is what reports show as found.
        check = "\n".join([
            *prologue, RESOLVE_ARCHS,
            f"stale=$({fp_program('compare', '2>&1')}\n); stale_rc=$?",
            f"if ! (\n{done}\n); then",
            '  [ "$stale_rc" = 0 ] || printf "%s\\n" "$stale"',
            "  exit 1",
            "fi",
            'printf "%s\\n" "$stale"',
            'exit "$stale_rc"',
        ])
        shared = SharedBuild(self.package, version, fingerprint, "\n".join(lines), install)
        return Scripts(check, "\n".join(lines), check, expect=expect + "; built for this target's ABI",
                       shared=shared)

    def describe(self, ctx: StepContext) -> str:
        archs = ctx.raw(self.cuda_archs).replace(" ", "")
        built_for = {"upstream": "setup.py's own archs", "auto": "the GPUs present (nvidia-smi, else torch)"}.get(
            archs, ", ".join(f"sm_{a}" for a in archs.split(",")))
        share = truthy(ctx.raw(self.share)) if isinstance(self.share, str) else self.share
        python = ctx.raw(self.python) if self.python else "the venv"
        where = sources(ctx, self.index_url, self.find_links, self.no_index)
        parts = [f"--no-build-isolation against {python}'s torch, no cache, {installer(ctx, self.uv)}",
                 "built once per ABI fingerprint, other targets install its wheel" if share else
                 "built on every target (share: false)"]
        check = "check: installed" + "".join(f", imports {m}" for m in self.imports) + (
            ", built for this ABI" if share else "")
        return (f"build: {self.package} {ctx.raw(self.version)} (sdist {where}) for {built_for} ("
                + "; ".join([*parts, check]) + (f"; and its verify ({lines_of(self.verify)})"
                                                 if self.verify else "") + ")")
