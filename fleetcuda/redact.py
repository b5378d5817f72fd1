"""Secrets never printed: values of password-like variables, and credentials in URLs, are replaced
by *** in logs, dry-run output, progress lines, reports and history.

A secret never travels on a command line (it is read from stdin by the step's script, see
command.Invocation); everything fleetcuda writes or prints is redacted.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

SECRET_NAME = re.compile(r"(?i)(pass(word|wd|phrase)?|secret|token|api_?key|credential|private_?key|auth"
                         r"|(^|_)keys?(_|$)|(^|_)pwd_|_pwd($|_))")  # hf_key, ACCESS_KEY, db_pwd; not keyring_deb, PWD
# scheme://user:password@host -> scheme://user:***@host
# Bounded repetitions: on one long line of letters an unbounded scheme is tried from every offset (quadratic).
URL_CREDENTIALS = re.compile(r"(?P<scheme>\b[A-Za-z][A-Za-z0-9+.-]{0,31}://)(?P<user>[^/\s:@'\"]{1,256}):"
                             r"(?P<pw>[^/\s@'\"]{1,1024})@")
MASK = "***"
MIN_SECRET = 4  # shorter values would blank out ordinary text


def secret_values(variables: Mapping[str, str]) -> list[str]:
    return [v for k, v in variables.items() if SECRET_NAME.search(k) and len(v) >= MIN_SECRET]


class Redactor:
    def __init__(self, secrets: Iterable[str] = ()):
        # Longest first, so a secret containing another is masked whole. Output is redacted line by line as
        # it streams, so each line of a multi-line secret is a secret of its own too.
        pieces = set()
        for s in secrets:
            pieces.add(s)
            pieces.update(line for line in re.split(r"[\r\n]+", s))
        self.secrets = sorted({s for s in pieces if len(s) >= MIN_SECRET}, key=len, reverse=True)

    def __call__(self, text: str) -> str:
        for secret in self.secrets:
            if secret in text:
                text = text.replace(secret, MASK)
        return URL_CREDENTIALS.sub(lambda m: f"{m['scheme']}{m['user']}:{MASK}@", text)


def for_variables(*maps: Mapping[str, str]) -> Redactor:
    return Redactor(s for m in maps for s in secret_values(m))


# C0 controls but tab and newline, DEL, C1 controls: what would drive a terminal (colours, titles, clearing).
# And Unicode's invisible format characters (bidi overrides, zero-width ones), which reorder or hide text.
_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u200b-\u200f\u202a-\u202e\u2060-\u2069\ufeff]")


def printable(text: str) -> str:
    """Text from a target, made safe to show: control characters as visible escapes (`\\x1b`), so output
    printed on a terminal, in a log read with `cat` or in a report can never drive the terminal."""
    def escape(m: re.Match[str]) -> str:
        c = m.group()
        return "\\r" if c == "\r" else f"\\x{ord(c):02x}" if ord(c) < 0x100 else f"\\u{ord(c):04x}"

    return _CONTROL.sub(escape, text)
