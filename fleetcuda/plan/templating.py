"""`{{ name }}` and `{{ name | filter }}` substitution.

In module fields (a URL, a package spec) the raw value is inserted and the module quotes it.

In shell text a value never becomes shell syntax, whatever quotes it stands in: each `{{ x }}` is
replaced by a reference to a shell variable (`"${fc_x}"` where words are split, `${fc_x}` inside
double quotes and unquoted heredocs), and the variable is set before the script runs (plain values by
an assignment fleetcuda writes, quoted once; secrets read from stdin). Where the shell expands nothing
(single quotes, `$'...'`, a quoted heredoc, `${...}`), `{{ }}` is refused: the value would have to be
spliced into text another program parses. In arithmetic only an integer is accepted, and inside `[[ ]]`
no `[` (bash evaluates `a[$(cmd)]` there). A `{{ }}` in a comment is left as it is.

What still runs a value is a script that hands it to another interpreter as code (`eval "$v"`,
`bash -c "...{{ x }}..."`, `python -c "...{{ x }}..."`): pass values to programs through `env:` instead.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

_REF = re.compile(r"\{\{\s*([A-Za-z_][A-Za-z0-9_]*)\s*(?:\|\s*([a-z_]+)\s*)?\}\}")

FILTERS: dict[str, Callable[[str], str]] = {
    "dashed": lambda v: v.replace(".", "-"),  # 12.8 -> 12-8, as in cuda-nvcc-12-8
    "nodot": lambda v: v.replace(".", ""),
    "major": lambda v: v.split(".")[0],
}
_INTEGER = re.compile(r"-?[0-9]+\Z")
# bash evaluates a variable's text as arithmetic wherever a script uses it as a number or a variable's name
# (`[[ -ge ]]`, `(( ))`, `$(( ))`, `let`, `declare -i`, `read` into an integer, `printf -v`, `${!v}`,
# `declare -n`, `${s:off}`, any subscript ...), and expands a `name[subscript]` there as in double quotes. No
# scanner can find every such place: a script may copy a value anywhere, write the `[` itself
# (`ref="table[{{ x }}]"; [[ -n ${!ref} ]]`) or join two values. What a subscript can expand at all is a `$` that
# starts an expansion (followed by a name, a digit, a special parameter or one of `( { [ ' "`) and a backtick
# (`${v@P}` turns `\044` into `$` only through such a `$`), so a value holding one, or ending in `$` (which the
# next value or the script's text could complete), is refused wherever it would go: complete by construction,
# whatever the spelling or the script (tests/test_arith_values.py fuzzes it against every such context).
SHELL_EXPANSION = re.compile(r"`|\$(?:[A-Za-z0-9_({\['\"$!?#@*-]|\Z)")


class TemplateError(ValueError):
    pass


class Unread(str):
    """A value known only from the target at run time (an `auto` fact not read yet), as the dry-run shows it:
    `<name>`, and `<name|filter>` through a filter (cuda-nvcc-<cuda_version|dashed>), never `auto`."""

    def __new__(cls, name: str) -> Unread:
        made = super().__new__(cls, f"<{name}>")
        made.name = name
        return made

    name: str


def references(text: str) -> set[str]:
    return {m.group(1) for m in _REF.finditer(text)}


def _value(m: re.Match[str], values: Mapping[str, str]) -> str:
    name, filt = m.group(1), m.group(2)
    if name not in values:
        raise TemplateError(f"undefined variable {name!r}")
    value = values[name]
    if filt:
        if filt not in FILTERS:
            raise TemplateError(f"unknown filter {filt!r} (known: {', '.join(sorted(FILTERS))})")
        value = f"<{value.name}|{filt}>" if isinstance(value, Unread) else FILTERS[filt](value)
    return value


def render(text: str, values: Mapping[str, str]) -> str:
    """Raw substitution, for module fields (never shell text: see render_shell)."""
    return _REF.sub(lambda m: _value(m, values), text)


def shell_var(m: re.Match[str]) -> str:
    """The shell variable that holds `{{ name | filter }}`: fc_NAME, or fcf_FILTER_NAME (never the same)."""
    name, filt = m.group(1), m.group(2)
    return f"fcf_{filt}_{name}" if filt else f"fc_{name}"


@dataclass
class RenderedShell:
    text: str  # the script with every {{ }} replaced by a variable reference
    vars: dict[str, str] = field(default_factory=dict)  # shell variable -> value it must hold
    names: dict[str, str] = field(default_factory=dict)  # shell variable -> recipe variable it comes from



def check_value(what: str, value: str) -> None:
    """A value that reaches a target's shell or environment: never one bash could expand as a subscript."""
    if SHELL_EXPANSION.search(value):
        raise TemplateError(f"{what} holds a '$' expansion or a backtick: refused, since bash expands it, and can run "
                            "a command, wherever a script reads the value as a number or a variable's name (write a "
                            "'$' in a URL as %24; read text that must hold one from a file on the target)")


def render_shell(text: str, values: Mapping[str, str]) -> RenderedShell:
    out: list[str] = []
    pos = 0
    result = RenderedShell("")
    for m, ctx in scan(text):
        value = _value(m, values)
        ref = m.group(0)
        out.append(text[pos:m.start()])
        pos = m.end()
        if ctx == "comment":
            out.append(ref)
            continue
        if ctx == "codeline":
            raise TemplateError(f"{ref} is in a string bash runs as code later (eval, trap, alias, a shell's -c, a "
                                "prompt): pass it in the step's env: and refer to the variable there")
        if ctx in _REFUSED:
            raise TemplateError(f"{ref} {_REFUSED[ctx]}")
        check_value(ref, value)
        if ctx in _ARITH_CONTEXTS:
            if not _INTEGER.match(value):
                raise TemplateError(f"{ref} is in arithmetic, where only an integer is safe (it is {value[:40]!r})")
            out.append(value)
            continue
        if ctx == "dbracket" and "[" in value:
            raise TemplateError(f"{ref} is inside [[ ]], where bash would evaluate {value[:40]!r} as code "
                                "(a value with '['); use [ ] or a variable set outside [[ ]]")
        var = shell_var(m)
        result.vars[var] = value
        result.names[var] = m.group(1)
        out.append(f"${{{var}}}" if ctx in ("dq", "heredoc") else f'"${{{var}}}"')
    out.append(text[pos:])
    result.text = "".join(out)
    return result


_REFUSED = {
    "sq": "is inside single quotes, where the shell expands nothing: put it outside them "
          "(e.g. 'text'{{ x }}'text') or in double quotes; to hand it to a program, use the step's env:",
    "ansic": "is inside $'...', where the shell expands nothing: use double quotes",
    "heredoc_q": "is inside a quoted heredoc (<<'EOF'), where the shell expands nothing: pass it in the "
                 "step's env: and read it from the environment",
    "param": "is inside ${...}: set a variable from it first (v={{ x }}) and use that",
}

_WORD_BREAK = set(" \t\n;&|()<>")
# Commands whose arguments bash evaluates as arithmetic (to the end of the command), and `name[` at the start
# of a word (an array subscript, arithmetic too): there a value is an integer or refused.
_ARITH_COMMAND = re.compile(r"(let|(declare|typeset|local|readonly|export)\s+(-[A-Za-z]*\s+)*-[A-Za-z]*i[A-Za-z]*)\s")
_SUBSCRIPT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\[")
# Commands and variables whose string bash runs as code later (eval, trap, alias, mapfile's callback, a
# shell's -c, the prompts): a value inside them, quoted or not, would be code.
_CODE_COMMAND = re.compile(
    r"((?:(?:sudo|env|nohup|exec|command|nice|setsid|timeout\s+\S+)\s+(?:-\S+\s+)*)*"
    r"(?:eval|trap|alias|(?:mapfile|readarray)\s[^\n;|&]*-C|(?:\S*/)?(?:bash|sh|dash|zsh|ksh|mksh)\s+(?:-[A-Za-z]+\s+)*"
    r"-[A-Za-z]*c|(?:PS[0-4]|PROMPT_COMMAND|BASH_ENV|ENV)\+?=))")
_ARITH_CONTEXTS = ("arith", "arithline", "subscript")


_PLACEHOLDER = re.compile("\x00([0-9]+)\x00")


def scrub(script: str, secrets: list[str]) -> tuple[str, dict[str, str]]:
    """`script` with every verbatim occurrence of a secret value replaced by a reference to a variable that
    holds it (`fcx_N`, which the caller sets from stdin), so the script can go on a command line. Expanding
    the reference gives back the very same text, so the script means what it meant; a value inside a
    single-quoted word (as the step kinds quote their fields) is spliced in by leaving and re-entering the
    quotes. Where the shell expands nothing that way (a quoted heredoc, $'...'), the text stays."""
    found: dict[str, str] = {}
    marked = script
    for value in sorted(set(secrets), key=len, reverse=True):
        if value and value in marked and "\x00" not in value:
            index = len(found)
            found[f"fcx_{index}"] = value
            marked = marked.replace(value, f"\x00{index}\x00")
    if not found:
        return script, {}
    out, pos, used = [], 0, {}
    for m, ctx in scan(marked, _PLACEHOLDER):
        var = f"fcx_{m.group(1)}"
        out.append(marked[pos:m.start()])
        pos = m.end()
        if ctx in ("top", "cmdsub", "bq", "dbracket"):
            out.append(f'"${{{var}}}"')
        elif ctx in ("dq", "heredoc", "comment"):
            out.append(f"${{{var}}}")
        elif ctx == "sq":
            out.append(f"'\"${{{var}}}\"'")
        else:
            out.append(found[var])
            continue
        used[var] = found[var]
    out.append(marked[pos:])
    return "".join(out), used


def scan(text: str, ref: re.Pattern[str] = _REF) -> list[tuple[re.Match[str], str]]:
    """Each `{{ }}` of a bash script with the quoting context it stands in: top (unquoted), dq, sq,
    ansic, bq (backticks), cmdsub, arith, param, dbracket, comment, heredoc, heredoc_q."""
    found: list[tuple[re.Match[str], str]] = []
    stack: list[list] = [["top", 0]]
    heredocs: list[tuple[str, bool, bool]] = []  # delimiter, strip tabs, quoted
    i, n = 0, len(text)

    def at_word_start(j: int) -> bool:
        return j == 0 or text[j - 1] in _WORD_BREAK

    while i < n:
        ctx = stack[-1][0]
        m = ref.match(text, i)
        if m:
            found.append((m, _effective(stack)))
            i = m.end()
            continue
        c = text[i]
        two = text[i:i + 2]
        if ctx == "sq":
            if c == "'":
                stack.pop()
            i += 1
        elif ctx == "ansic":
            if c == "\\":
                i += 2
                continue
            if c == "'":
                stack.pop()
            i += 1
        elif ctx == "comment":
            if c == "\n":
                stack.pop()  # the newline is the parent's (it may start heredoc bodies)
            else:
                i += 1
        elif ctx == "dq":
            if c == "\\":
                i += 2
            elif c == '"':
                stack.pop()
                i += 1
            else:
                i = _open_expansion(text, i, stack)
        elif ctx == "param":
            if c == "\\":
                i += 2
            elif c == "}":
                if stack[-1][1] == 0:
                    stack.pop()
                else:
                    stack[-1][1] -= 1
                i += 1
            elif two == "${":
                stack[-1][1] += 1
                i += 2
            elif c == '"':
                stack.append(["dq", 0])
                i += 1
            elif c == "'":
                stack.append(["sq", 0])
                i += 1
            else:
                i = _open_expansion(text, i, stack)
        elif ctx in ("arithline", "codeline"):
            if c in "\n;&|":
                stack.pop()
            elif c == "'":
                stack.append(["sq", 0])
                i += 1
            elif c == '"':
                stack.append(["dq", 0])
                i += 1
            elif c == "\\":
                i += 2
            else:
                i = _open_expansion(text, i, stack)
        elif ctx == "subscript":
            if c == "]":
                stack.pop()
                i += 1
            else:
                i = _open_expansion(text, i, stack)
        elif ctx == "arith":
            if c == "(":
                stack[-1][1] += 1
                i += 1
            elif c == ")":
                if stack[-1][1] == 0 and text[i + 1:i + 2] == ")":
                    stack.pop()
                    i += 2
                else:
                    stack[-1][1] = max(0, stack[-1][1] - 1)
                    i += 1
            else:
                i = _open_expansion(text, i, stack)
        else:  # top, cmdsub, bq, dbracket: shell code
            if c == "\\":
                i += 2
            elif c == "'":
                stack.append(["sq", 0])
                i += 1
            elif two == "$'":
                stack.append(["ansic", 0])
                i += 2
            elif c == '"':
                stack.append(["dq", 0])
                i += 1
            elif c == "`" and ctx == "bq":
                stack.pop()
                i += 1
            elif c == "#" and at_word_start(i):
                stack.append(["comment", 0])
                i += 1
            elif at_word_start(i) and (m := _CODE_COMMAND.match(text, i)):
                stack.append(["codeline", 0])
                i = m.start() + len(m.group(1))
            elif at_word_start(i) and (m := _ARITH_COMMAND.match(text, i)):
                stack.append(["arithline", 0])
                i = m.end()
            elif at_word_start(i) and (m := _SUBSCRIPT.match(text, i)):
                stack.append(["subscript", 0])
                i = m.end()
            elif two == "((" and at_word_start(i):
                stack.append(["arith", 0])
                i += 2
            elif two == "[[" and at_word_start(i) and text[i + 2:i + 3] in (" ", "\t", "\n"):
                stack.append(["dbracket", 0])
                i += 2
            elif c == "[" and at_word_start(i) and text[i + 1:i + 2] not in ("", " ", "\t", "\n", "["):
                # `([key]=value)` in a compound array assignment: bash evaluates the key as arithmetic too
                # (a glob `[...]` at a word's start gets the same care).
                stack.append(["subscript", 0])
                i += 1
            elif two == "]]" and ctx == "dbracket":
                stack.pop()
                i += 2
            elif ctx == "cmdsub" and c == "(":
                stack[-1][1] += 1
                i += 1
            elif ctx == "cmdsub" and c == ")":
                if stack[-1][1] == 0:
                    stack.pop()
                else:
                    stack[-1][1] -= 1
                i += 1
            elif text.startswith("<<<", i):
                i += 3  # a here-string: its word is ordinary shell text
            elif two == "<<":
                i = _heredoc_operator(text, i + 2, heredocs)
            elif c == "\n" and heredocs:
                i = _heredoc_bodies(text, i + 1, heredocs, found, ref)
            else:
                i = _open_expansion(text, i, stack)
    return found


def _effective(stack: list[list]) -> str:
    """The context a {{ }} is in: the innermost, unless it lies anywhere within code bash runs later or
    within arithmetic (quotes inside those change nothing)."""
    names = [frame[0] for frame in stack]
    if "codeline" in names:
        return "codeline"
    inner = names[-1]
    if inner in ("comment", "heredoc_q", "sq", "ansic", "param"):
        return inner
    for name in reversed(names):
        if name in _ARITH_CONTEXTS:
            return name
        if name in ("cmdsub", "bq"):  # a command substitution starts plain shell again
            break
    return inner


def _open_expansion(text: str, i: int, stack: list[list]) -> int:
    """`$((`, `$(`, `${` or a backtick at i opens a context; otherwise one character is consumed."""
    if text.startswith("$((", i):
        stack.append(["arith", 0])
        return i + 3
    if text.startswith("$[", i):
        stack.append(["arith", 0])  # bash's old $[ ] arithmetic; closed by `]`, close enough to be safe
        return i + 2
    if text.startswith("$(", i):
        stack.append(["cmdsub", 0])
        return i + 2
    if text.startswith("${", i):
        stack.append(["param", 0])
        return i + 2
    if text[i] == "`":
        stack.append(["bq", 0])
        return i + 1
    return i + 1


_DELIM = re.compile(r"[^\s;&|<>()]+")


def _heredoc_operator(text: str, i: int, heredocs: list[tuple[str, bool, bool]]) -> int:
    strip = text[i:i + 1] == "-"
    if strip:
        i += 1
    while i < len(text) and text[i] in " \t":
        i += 1
    m = _DELIM.match(text, i)
    if not m:
        return i
    word = m.group(0)
    quoted = any(q in word for q in "'\"\\")
    heredocs.append((re.sub(r"['\"\\]", "", word), strip, quoted))
    return m.end()


def _heredoc_bodies(text: str, i: int, heredocs: list[tuple[str, bool, bool]],
                    found: list[tuple[re.Match[str], str]], ref: re.Pattern[str] = _REF) -> int:
    """Read the bodies of the heredocs opened on the line that just ended; return where code resumes."""
    for delim, strip, quoted in heredocs:
        while i < len(text):
            end = text.find("\n", i)
            end = len(text) if end < 0 else end
            line = text[i:end]
            if (line.lstrip("\t") if strip else line) == delim:
                i = end + 1
                break
            for m in ref.finditer(text, i, end):
                found.append((m, "heredoc_q" if quoted else "heredoc"))
            i = end + 1
    heredocs.clear()
    return i
