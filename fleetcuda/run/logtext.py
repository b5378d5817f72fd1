"""What a run log says of a command: fleetcuda's own programs by name and digest, not their source.

A command as logged (`BuiltCommand.display`) carries every remote program it sends (fleetcuda/remote/, some
thousands of lines together), verbatim or quoted once or twice (bash -c inside the SSH login shell) and then
written for pasting. Each of those forms is replaced by `<program NAME sha256:<12 hex>>`, the reference the
dry-run uses too (plan/view.py), so a no-op verify's log is the commands and answers, not the catalog again."""

from __future__ import annotations

import functools
import hashlib
import json


@functools.cache
def _forms() -> tuple[tuple[str, str], ...]:
    """(text to find, reference), longest first."""
    from fleetcuda.plan.command import quote_for_paste
    from fleetcuda.remote import catalog

    def once(text: str) -> str:  # what plan.command.quote does to the inside of a word
        return text.replace("'", "'\"'\"'")

    def pasted(text: str) -> str:  # quote_for_paste's ANSI-C escaping of the inside of a word
        return quote_for_paste(text + "\\")[2:-3]

    from fleetcuda.plan import planner

    texts = {name: (program.text, program.digest) for name, program in catalog().items()}
    # The batch's client of the interpreter server: a fixed shell function, the same in every batch.
    client = getattr(planner, "_PY_CLIENT", "")
    if client:
        texts["fc_py"] = (client, hashlib.sha256(client.encode()).hexdigest()[:12])
    forms: dict[str, str] = {}
    for name, (text, digest) in texts.items():
        if len(text) < 200:
            continue  # too short to be worth a reference, and it may occur by accident
        ref = f"<program {name} sha256:{digest}>"
        for quoted in (text, once(text), once(once(text)), json.dumps(text)[1:-1]):
            forms.setdefault(quoted, ref)
            forms.setdefault(pasted(quoted), ref)
    return tuple(sorted(forms.items(), key=lambda f: len(f[0]), reverse=True))


def by_reference(command: str) -> str:
    """`command` with each of fleetcuda's programs it holds replaced by its name and digest."""
    for text, ref in _forms():
        if text in command:
            command = command.replace(text, ref)
    return command
