"""YAML loading that remembers where every value came from, so errors name file, line and field."""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pydantic
import yaml

from fleetcuda.errors import InputError

# Bounds keep a hostile or broken file from exhausting memory (alias bombs, giant documents).
MAX_FILE_BYTES = 4 * 1024 * 1024
MAX_NODES = 200_000
# No valid file nests this deep; the bound also keeps recursive aliases (`&a [*a]`) from recursing forever.
MAX_DEPTH = 64
# Longer integers cannot even be printed (Python's 4300-digit limit); no valid value is one.
MAX_INT_CHARS = 1000
INT_TAG = "tag:yaml.org,2002:int"
LINE_BREAK = re.compile("\r\n|[\r\n\x85\u2028\u2029]")  # what YAML counts as a new line
# A YAML escape can still produce these: NUL cannot reach a command, an environment or a path, and a lone
# surrogate cannot be encoded (logs, history, reports, the terminal). Refused wherever a string holds one.
_UNCARRIABLE = re.compile("[\x00\ud800-\udfff]")
_FILE_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
               (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))

Loc = tuple[str | int, ...]


class SourceDoc:
    """A parsed YAML document plus a map from each value's path to its 1-based line."""

    def __init__(self, path: str, data: Any, lines: dict[Loc, int], sequences: set[Loc] | None = None):
        self.path = path
        self.data = data
        self.lines = lines
        self.sequences = sequences or set()

    def line_of(self, loc: Iterable[str | int]) -> int | None:
        """Line of the deepest known prefix of loc (pydantic locs may run past what the YAML has)."""
        loc = tuple(loc)
        for end in range(len(loc), -1, -1):
            if loc[:end] in self.lines:
                return self.lines[loc[:end]]
        return None

    def error(self, loc: Iterable[str | int], message: str) -> InputError:
        loc = tuple(loc)
        return InputError(self.path, self.line_of(loc), self.format_loc(loc), message)

    def format_loc(self, loc: Iterable[str | int]) -> str:
        """`hosts.a.containers.200.name`, `steps[3].check`: [i] only for positions in YAML lists."""
        out, prefix = "", ()
        for part in loc:
            if isinstance(part, int) and (prefix in self.sequences or prefix not in self.lines):
                out += f"[{part}]"
            else:
                text = str(part)
                # Quoted when it would not read as one segment: empty, `.` or brackets inside (`'2.5'`, `'.nan'`),
                # or characters that would break the message's line.
                plain = text and text.isprintable() and not any(c in text for c in ".[]")
                shown = text if plain else repr(text)
                out += f".{shown}" if out else shown
            prefix = prefix + (part,)
        return out

    def validate(self, model: type[pydantic.BaseModel], data: Any = None, base: Loc = ()) -> Any:
        """Validate with pydantic; the first error becomes an InputError at its YAML line."""
        try:
            return model.model_validate(self.data if data is None else data)
        except pydantic.ValidationError as exc:
            err = exc.errors(include_url=False)[0]
            loc = base + _data_loc(self.data if data is None else data, err["loc"])
            raise self.error(loc, _message(err)) from None


def _data_loc(data: Any, loc: tuple[str | int, ...]) -> Loc:
    """pydantic's loc without the union members' names it inserts; a key the YAML really has is never dropped
    (a host `GPU1`, a variable `CUDA_HOME`, a variable named `str`)."""
    out: list[str | int] = []
    node = data
    for part in loc:
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node):
            node = node[part]
        elif _is_union_tag(part):
            continue
        else:
            node = None
        out.append(part)
    return tuple(out)


def _is_union_tag(part: str | int) -> bool:
    # pydantic inserts the union member's name ("function-after[...]", "ShellStep", "str") into locs.
    return isinstance(part, str) and ("[" in part or "-" in part or part[:1].isupper() or part in _TYPE_TAGS)


_TYPE_TAGS = {"str", "int", "float", "bool", "bytes", "none", "list", "dict"}


def _message(err: dict[str, Any]) -> str:
    msg = err["msg"]
    if err["type"] == "extra_forbidden":
        return "unknown field"
    if err["type"] == "missing":
        return "required field is missing"
    inp = err.get("input")
    if isinstance(inp, (str, int, float, bool)) and err["type"] not in ("value_error",):
        shown = repr(inp) if len(repr(inp)) <= 80 else repr(inp)[:77] + "..."
        return f"{msg} (got {shown})"
    return msg.removeprefix("Value error, ")


def read_bounded(path: str | Path, limit: int = MAX_FILE_BYTES) -> bytes:
    """A regular file's bytes, at most limit + 1 of them (so the caller can tell it is too large).

    A FIFO, device or socket is refused before any read: reading a FIFO waits for a writer forever, and
    /dev/zero never ends. O_NONBLOCK keeps the open itself from waiting on a FIFO.
    """
    shown = str(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | getattr(os, "O_NOCTTY", 0))
    except FileNotFoundError:
        raise InputError(shown, None, "", "file not found") from None
    except (OSError, ValueError) as exc:  # ValueError: a NUL in the path
        raise InputError(shown, None, "", f"cannot read: {getattr(exc, 'strerror', None) or exc}") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            what = next((name for test, name in _FILE_KINDS if test(mode)), "not a regular file")
            raise InputError(shown, None, "", f"cannot read: {what}, not a regular file")
        chunks: list[bytes] = []
        left = limit + 1
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)
    except OSError as exc:
        raise InputError(shown, None, "", f"cannot read: {exc.strerror or exc}") from None
    finally:
        os.close(fd)


def load_yaml(path: str | Path) -> SourceDoc:
    path = Path(path)
    shown = str(path)
    raw = read_bounded(path)
    if len(raw) > MAX_FILE_BYTES:
        raise InputError(shown, None, "", f"file is larger than {MAX_FILE_BYTES} bytes")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InputError(shown, None, "", f"not UTF-8 text (byte {exc.start})") from None
    return parse_yaml(text, shown)


class _Loader(yaml.SafeLoader):
    """SafeLoader whose composer stops at MAX_DEPTH levels of nesting: `[[[[...` ten thousand deep is refused
    after reading 64 levels of it, not after PyYAML's scanner has spent seconds on all of it (or recursed out)."""

    def __init__(self, stream: str):
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node | None:
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH + 1:
                raise yaml.MarkedYAMLError(problem=f"nested more than {MAX_DEPTH} levels deep",
                                           problem_mark=self.peek_event().start_mark)
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


def parse_yaml(text: str, shown: str) -> SourceDoc:
    try:
        loader = _Loader(text)  # refuses control characters at once
    except yaml.reader.ReaderError as exc:
        line = len(LINE_BREAK.findall(text, 0, exc.position)) + 1
        raise InputError(shown, line, "", f"invalid YAML: unacceptable character #x{exc.character:04x}") from None
    try:
        node = loader.get_single_node()
        lines: dict[Loc, int] = {}
        sequences: set[Loc] = set()
        data = _build(loader, node, (), lines, sequences, [0]) if node is not None else None
    except _Uncarriable as exc:
        doc = SourceDoc(shown, None, lines, sequences)
        # Inside a top-level list there is no field to name (neither file kind is a list): the line says where.
        field = doc.format_loc(exc.loc) if exc.loc and not isinstance(exc.loc[0], int) else ""
        raise InputError(shown, doc.line_of(exc.loc), field, exc.message) from None
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = mark.line + 1 if mark else None
        problem = exc.problem or exc.context or "invalid YAML"
        raise InputError(shown, line, "", f"invalid YAML: {problem}") from None
    except yaml.YAMLError as exc:
        raise InputError(shown, None, "", f"invalid YAML: {exc}") from None
    except RecursionError:  # PyYAML's composer recurses once per level of nesting
        raise InputError(shown, loader.get_mark().line + 1, "", "invalid YAML: nested too deeply") from None
    finally:
        loader.dispose()
    return SourceDoc(shown, data, lines, sequences)


class _Uncarriable(Exception):
    """A string a YAML escape made that no command, file or terminal can carry; at loc."""

    def __init__(self, loc: Loc, message: str):
        super().__init__(message)
        self.loc = loc
        self.message = message


def _check_text(value: Any, loc: Loc, what: str) -> None:
    if isinstance(value, str) and (bad := _UNCARRIABLE.search(value)):
        char = bad.group()
        problem = "a NUL character (\\0)" if char == "\x00" else f"a lone surrogate ({ascii(char)[1:-1]})"
        raise _Uncarriable(loc, f"{what} contains {problem}, which cannot be passed on; remove it")


def _build(loader: yaml.SafeLoader, node: yaml.Node, loc: Loc, lines: dict[Loc, int], sequences: set[Loc],
           count: list[int]) -> Any:
    count[0] += 1
    if count[0] > MAX_NODES:
        raise yaml.MarkedYAMLError(problem=f"more than {MAX_NODES} values", problem_mark=node.start_mark)
    if len(loc) > MAX_DEPTH:
        raise yaml.MarkedYAMLError(problem=f"nested more than {MAX_DEPTH} levels deep", problem_mark=node.start_mark)
    lines[loc] = node.start_mark.line + 1
    if isinstance(node, yaml.MappingNode):
        own = sum(1 for k, _ in node.value if k.tag != "tag:yaml.org,2002:merge")
        loader.flatten_mapping(node)  # resolves "<<" merge keys: merged pairs first, then the mapping's own
        merged = len(node.value) - own
        out: dict[Any, Any] = {}
        from_merge: set[Any] = set()
        for index, (key_node, value_node) in enumerate(node.value):
            # A non-scalar key is refused unbuilt: building it could fail on a bad scalar inside (`? [!!int x]`).
            key = _scalar(loader, key_node) if isinstance(key_node, yaml.ScalarNode) else None
            if isinstance(key, bool) and key_node.value.lower() not in ("true", "false"):
                key = key_node.value  # a key `on:` (a step's `on: host`) is a word, as in YAML 1.2, not YAML 1.1's true
            if not isinstance(key, (str, int, float, bool)):
                raise yaml.MarkedYAMLError(problem="mapping keys must be plain scalars",
                                           problem_mark=key_node.start_mark)
            lines[loc + (key,)] = key_node.start_mark.line + 1
            _check_text(key, loc + (key,), "the key")
            if key in out and key not in from_merge:
                raise yaml.MarkedYAMLError(problem=f"duplicate key {key!r}", problem_mark=key_node.start_mark)
            # A mapping's own key overrides one merged in with `<<`, as YAML specifies.
            if index < merged:
                from_merge.add(key)
            else:
                from_merge.discard(key)
            out[key] = _build(loader, value_node, loc + (key,), lines, sequences, count)
            # Point at the key's line: that is where a reader looks for `field:`.
            lines[loc + (key,)] = key_node.start_mark.line + 1
        return out
    if isinstance(node, yaml.SequenceNode):
        sequences.add(loc)
        return [_build(loader, item, loc + (i,), lines, sequences, count) for i, item in enumerate(node.value)]
    value = _scalar(loader, node)
    _check_text(value, loc, "the value")
    # A version such as `cuda_version: 12.10` must not become the float 12.1: keep the text.
    # So must a YAML 1.1 integer in another notation (`12:30` is 750 in base 60, `010` is 8, `0x1F` 31): a
    # variable keeps what was written; an integer field reads that text, or says it is not a number.
    if isinstance(value, int) and not isinstance(value, bool) and node.value.lstrip("+").replace("_", "") != str(value):
        return node.value
    return node.value if isinstance(value, float) else value


def _scalar(loader: yaml.SafeLoader, node: yaml.Node) -> Any:
    """A scalar's value; PyYAML's constructors raise plain exceptions for `!!int abc`, `!!bool maybe`, ..."""
    if node.tag == INT_TAG and len(node.value) > MAX_INT_CHARS:
        raise yaml.MarkedYAMLError(problem=f"integer longer than {MAX_INT_CHARS} characters",
                                   problem_mark=node.start_mark)
    try:
        return loader.construct_object(node, deep=True)
    except (ValueError, TypeError, KeyError, IndexError, AttributeError, OverflowError):
        tag = node.tag.rsplit(":", 1)[-1]
        raise yaml.MarkedYAMLError(problem=f"{node.value[:40]!r} is not a valid {tag}",
                                   problem_mark=node.start_mark) from None
