"""`{{ name }}` and `{{ name | filter }}` substitution.

In shell text every value is inserted shell-quoted, so a variable can never inject commands; in
module fields (a URL, a package spec) the raw value is inserted and the module quotes it.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping

from fleetcuda.command import quote

_REF = re.compile(r"\{\{\s*([A-Za-z_][A-Za-z0-9_]*)\s*(?:\|\s*([a-z_]+)\s*)?\}\}")

FILTERS: dict[str, Callable[[str], str]] = {
    "dashed": lambda v: v.replace(".", "-"),  # 12.8 -> 12-8, as in cuda-nvcc-12-8
    "nodot": lambda v: v.replace(".", ""),
    "major": lambda v: v.split(".")[0],
}


class TemplateError(ValueError):
    pass


def references(text: str) -> set[str]:
    return {m.group(1) for m in _REF.finditer(text)}


def render(text: str, values: Mapping[str, str], *, shell: bool) -> str:
    def sub(m: re.Match[str]) -> str:
        name, filt = m.group(1), m.group(2)
        if name not in values:
            raise TemplateError(f"undefined variable {name!r}")
        value = values[name]
        if filt:
            if filt not in FILTERS:
                raise TemplateError(f"unknown filter {filt!r} (known: {', '.join(sorted(FILTERS))})")
            value = FILTERS[filt](value)
        return quote(value) if shell else value

    return _REF.sub(sub, text)
