"""Secrets never printed: values of password-like variables, and credentials in URLs, are replaced
by *** in logs, dry-run output, progress lines, reports and history.

A secret never travels on a command line (it is read from stdin by the step's script, see
command.Invocation); everything fleetcuda writes or prints is redacted.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

SECRET_NAME = re.compile(r"(?i)(pass(word|wd|phrase)?|secret|token|api_?key|credential|private_?key|auth"
                         r"|(^|_)keys?(_|$)|(^|_)pwd_|_pwd($|_))")  # hf_key, ACCESS_KEY, db_pwd; not keyring_deb, PWD
MASK = "***"
MIN_SECRET = 4  # shorter values would blank out ordinary text
# A message may quote a secret cut short (`value[:40]!r`): from this many characters on, a secret's beginning is
# masked wherever it stands, as far as the text goes on matching it.
HEAD = 16

# scheme://user:password@host: found by scanning, not by a pattern. The authority runs to the first `/`, `?`,
# `#`, whitespace or end of text (RFC 3986), so a password holding quotes, `:` or `@` is found whole; the
# userinfo is what comes before its last `@`, and the password what follows the userinfo's first `:`.
_SCHEME_END = re.compile(r"[A-Za-z][A-Za-z0-9+.-]{0,31}://\Z")
_AUTHORITY_END = re.compile(r"[/?#\s]")
# What can start a host after the `@` (any name, an address, a variable a script expands; not a quote, a space or
# what ends an authority), and what no user name holds (RFC 3986 allows `'` and `,` in one): `{"a":"https://h",
# "b":"u:p@h"}` has no user; a password may hold them all.
_HOST_START = re.compile(r"[^\s\"<>@/?#`]")
_NOT_USER = re.compile(r"[\"<>\s]")
_REFERENCE = re.compile(r"""(["']?)\$(\{[A-Za-z_][A-Za-z0-9_]*\}|[A-Za-z_][A-Za-z0-9_]*)\1""")
MAX_AUTHORITY = 4096  # bounded: a line of `a://a://...` costs linear time, not quadratic


@dataclass(frozen=True)
class UrlCredential:
    user: str
    password: str
    start: int  # where the password starts in the text
    end: int  # where it ends (the `@`)


def url_credentials(text: str) -> list[UrlCredential]:
    """Every `scheme://user:password@host` in `text`, whatever characters the password holds."""
    found: list[UrlCredential] = []
    pos = 0
    while (i := text.find("://", pos)) >= 0:
        pos = i + 3
        if not _SCHEME_END.search(text[max(0, i - 32):i + 3]):
            continue
        end = _AUTHORITY_END.search(text, pos, min(len(text), pos + MAX_AUTHORITY))
        authority = text[pos:end.start() if end else min(len(text), pos + MAX_AUTHORITY)]
        at = authority.rfind("@")
        while at > 0 and not _HOST_START.match(authority, at + 1):
            at = authority.rfind("@", 0, at)  # `...@"` is no host: an earlier `@` may end the userinfo
        colon = authority.find(":", 0, at) if at > 0 else -1
        if colon < 0 or colon + 1 == at or _NOT_USER.search(authority, 0, colon):
            continue
        if _REFERENCE.fullmatch(authority, colon + 1, at):
            continue  # `https://u:"${fc_token}"@h`: the script reads it from a variable, it is not in the text
        found.append(UrlCredential(authority[:colon], authority[colon + 1:at], pos + colon + 1, pos + at))
        pos += at + 1
    return found


def mask_url_credentials(text: str) -> str:
    out, last = [], 0
    for c in url_credentials(text):
        out += [text[last:c.start], MASK]
        last = c.end
    return "".join(out) + text[last:] if out else text


def secret_values(variables: Mapping[str, str]) -> list[str]:
    return [v for k, v in variables.items() if SECRET_NAME.search(k) and len(v) >= MIN_SECRET]


_BASH_Q = re.compile(r"""([ \t'"$`\\|&;()<>!{}*\[\]?^,])""")


def shown_forms(secret: str) -> set[str]:
    """The ways a message, a log or a report can spell a secret: as it is, quoted by Python's repr (either
    quote), escaped for JSON, as printable() shows it, as bash shows a word (`set -x`: 'a'\\''b'; printf %q:
    a\\'b) and percent-encoded (in a URL or a form)."""
    from urllib.parse import quote, quote_plus

    body = repr(secret)[1:-1]
    return {secret, body, body.replace("\\'", "'"), body.replace('"', '\\"'), json.dumps(secret)[1:-1],
            json.dumps(secret, ensure_ascii=False)[1:-1], printable(secret), secret.replace("'", "'\\''"),
            _BASH_Q.sub(r"\\\1", secret), quote(secret, safe=""), quote_plus(secret, safe="")}


class Redactor:
    def __init__(self, secrets: Iterable[str] = ()):
        # Longest first, so a secret containing another is masked whole. Output is redacted line by line as
        # it streams, so each line of a multi-line secret is a secret of its own too.
        pieces = set()
        for s in secrets:
            pieces.add(s)
            pieces.update(line for line in re.split(r"[\r\n]+", s))
        self.secrets = sorted({s for s in pieces if len(s) >= MIN_SECRET}, key=len, reverse=True)
        self.forms = sorted({f for s in self.secrets for f in shown_forms(s) if len(f) >= MIN_SECRET},
                            key=len, reverse=True)

    def __call__(self, text: str) -> str:
        for form in self.forms:
            head = form[:HEAD]
            if head in text:
                text = _mask(text, form, head)
        return mask_url_credentials(text)


def _mask(text: str, form: str, head: str) -> str:
    """`form`, and any beginning of it from `head` on (a quote cut short), masked."""
    out, last = [], 0
    while (i := text.find(head, last)) >= 0:
        j = i + len(head)
        while j < len(text) and j - i < len(form) and text[j] == form[j - i]:
            j += 1
        out += [text[last:i], MASK]
        last = j
    return "".join(out) + text[last:]


def for_variables(*maps: Mapping[str, str]) -> Redactor:
    return Redactor(s for m in maps for s in secret_values(m))


class _Book:
    """Every secret the planner has met during one command (`cli.main` opens and closes it): what the one error
    boundary masks in a message that reaches it, whatever raised it and from whatever thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values: set[str] = set()
        self._redactor: Redactor | None = Redactor()

    def remember(self, values: Iterable[str]) -> None:
        new = {v for v in values if len(v) >= MIN_SECRET}
        with self._lock:
            if not new <= self._values:
                self._values |= new
                self._redactor = None

    def forget(self) -> None:
        with self._lock:
            self._values, self._redactor = set(), Redactor()

    def redactor(self) -> Redactor:
        with self._lock:
            if self._redactor is None:
                self._redactor = Redactor(self._values)
            return self._redactor


KNOWN = _Book()


def remember(values: Iterable[str]) -> None:
    KNOWN.remember(values)


def redact_known(text: str) -> str:
    """`text` with every secret met so far in this command, and every URL's password, masked."""
    return KNOWN.redactor()(text)


# C0 controls but tab and newline, DEL, C1 controls: what would drive a terminal (colours, titles, clearing).
# And Unicode's invisible format characters (bidi overrides, zero-width ones), which reorder or hide text, and its
# line and paragraph separators (U+2028, U+2029: a line break to YAML and to some terminals).
_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u200b-\u200f\u2028-\u202e\u2060-\u2069\ufeff]")


def printable(text: str) -> str:
    """Text from a target, made safe to show: control characters as visible escapes (`\\x1b`), so output
    printed on a terminal, in a log read with `cat` or in a report can never drive the terminal."""
    def escape(m: re.Match[str]) -> str:
        c = m.group()
        return "\\r" if c == "\r" else f"\\x{ord(c):02x}" if ord(c) < 0x100 else f"\\u{ord(c):04x}"

    return _CONTROL.sub(escape, text)
