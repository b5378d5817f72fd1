"""Installed versions and imports, run on a target by `pip_install` and `sdist_build` checks.

    python - "NAME[==VERSION] ..." "MODULE ..."   (this file on stdin)

Exit 0 when every package is installed at the wanted version (a local `+tag` ignored, as PEP 440's `==`
does) and every module imports; each line says what was found.
"""

import importlib
import importlib.metadata as md
import sys


def main(argv):
    wanted = argv[0].split() if argv else []
    modules = argv[1].split() if len(argv) > 1 else []
    bad = 0
    for item in wanted:
        name, _, version = item.partition("==")
        try:
            found = md.version(name)
        except md.PackageNotFoundError:
            print(f"{name}: not installed (want {version or 'any'})")
            bad = 1
            continue
        if version and found.split("+")[0] != version:
            print(f"{name}: found {found}, want {version}")
            bad = 1
        else:
            print(f"{name}: {found}")
    for mod in modules:
        try:
            importlib.import_module(mod)
        except Exception as exc:
            print(f"import {mod}: {type(exc).__name__}: {str(exc)[:300]}")
            bad = 1
    return bad


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
