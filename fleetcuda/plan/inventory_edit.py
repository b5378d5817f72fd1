"""Adding discovered containers to an inventory file without touching what the user wrote.

A YAML library would drop the file's comments and redo its formatting, so this works on the text: the
positions of the user's own nodes (PyYAML's composer, the same parser plan.yamlsrc loads with) say where a
host's `containers:` block ends, and the new lines are inserted there, indented as the block is. Nothing
already in the file is changed, moved or removed. Places are character offsets found from YAML's own line
breaks (CR LF, CR, LF, NEL, U+2028, U+2029: a file may mix them), and an alias (`*x`) is placed where it is
written, not where its anchor is (PyYAML's composer hands back the anchored node, with the anchor's marks).
Pure: text in, text out; the caller re-loads the result with the inventory loader before writing it
(plan.inventory.load_inventory), so a bad edit is never written.

Values written are only names and paths that the inventory's own patterns accept (plan.inventory), each
written plain when YAML reads it back as the same string, else double-quoted; what cannot be written (a name
no inventory may hold) is left out and said. Containers that are not added get a comment saying why, once.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

import yaml

from fleetcuda.errors import InputError
from fleetcuda.plan.inventory import SAFE_NAME_RE
from fleetcuda.redact import printable

MARK = "# fleetcuda discover:"

# What PyYAML's reader counts as the end of a line (yaml.reader.Reader.forward); "\r\n" is one break.
_BREAK = re.compile("\r\n|[\r\n\x85\u2028\u2029]")


@dataclass(frozen=True)
class NewContainer:
    vmid: int
    name: str | None
    venv: str | None
    python: str | None


@dataclass(frozen=True)
class Skipped:
    vmid: int
    name: str | None
    why: str


@dataclass(frozen=True)
class HostSettings:
    """What a host needs in a file that does not list it yet (copied from the -i inventory)."""

    address: str
    user: str
    port: int = 22
    identity_file: str | None = None
    known_hosts: str | None = None
    sudo: bool | None = None
    pct: str | None = None  # only when not the default


@dataclass
class HostEdit:
    host: str
    add: list[NewContainer] = field(default_factory=list)
    skip: list[Skipped] = field(default_factory=list)
    settings: HostSettings | None = None  # used when the file has no such host


def scalar(value: str | int | bool) -> str:
    """A YAML scalar that reads back as exactly `value`: plain when that holds, else JSON's double quotes
    (valid YAML for the characters our patterns allow)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    try:
        plain_ok = yaml.safe_load(value) == value and "\n" not in value and value.strip() == value
    except yaml.YAMLError:
        plain_ok = False
    if plain_ok and not any(c in value for c in "#:'\"{}[],&*!|>%@`"):
        return value
    return json.dumps(value, ensure_ascii=True)


def shown_name(name: str | None) -> str:
    return f" ({name})" if name and SAFE_NAME_RE.fullmatch(name) else ""


def merge(text: str, path: str, edits: list[HostEdit]) -> tuple[str, list[str]]:
    """`text` with the edits inserted, and what was done (one line each). Raises InputError (file, line, field)
    where the file's shape leaves no place to insert without changing what the user wrote."""
    starts = _line_starts(text)
    done: list[str] = []
    # Insertions as (line index, lines); turned into character offsets at the end.
    inserts: list[tuple[int, list[str]]] = []
    root = _compose(text, path)
    hosts_node = _child(root, "hosts") if root is not None else None
    existing = _existing_comments(text)
    for edit in edits:
        noted = [s for s in edit.skip if f"{MARK} {edit.host}/{s.vmid} " not in existing]
        # A comment is one line of data: what the host said (a status, a name) can neither end it nor drive a
        # terminal that shows the file (control, bidi and line-breaking characters escaped).
        skip_lines = [comment_text(f"{MARK} {edit.host}/{s.vmid}{shown_name(s.name)} not added: {s.why}")
                      for s in noted]
        if not edit.add and not skip_lines:
            continue
        if isinstance(hosts_node, _Alias):
            raise InputError(path, _line(hosts_node), "hosts", "is an alias (*name) of another node: adding to it "
                                                               "would add there too; write the hosts here")
        host_pair = _pair(hosts_node, edit.host) if hosts_node is not None else None
        if host_pair is None:
            if not edit.add:
                continue  # nothing but comments: no host block is made for those
            if edit.settings is None:
                raise InputError(path, None, f"hosts.{edit.host}", "not in this file, and discover copies a host's "
                                 "settings only for an ssh host without a jump host: add the host to this file first")
            at, block = _new_host(len(starts), hosts_node, root, path, edit, skip_lines)
            inserts.append((at, block))
        else:
            key_node, host_node = host_pair
            at, block = _into_host(text, path, edit, key_node, host_node, skip_lines)
            inserts.append((at, block))
        done += [f"added {edit.host}/{c.vmid}{shown_name(c.name)}" for c in edit.add]
        done += [printable(f"noted {edit.host}/{s.vmid} in a comment: {s.why}") for s in noted]
    return _insert(text, starts, inserts), done


def comment_text(text: str) -> str:
    """`text` as one line of a YAML comment: printable, with no line break of any kind."""
    return printable(text).replace("\n", "\\n").replace("\t", " ")


def _line_starts(text: str) -> list[int]:
    """The offset of each line's first character, lines counted as YAML counts them (a mark's `line` indexes
    this); a text ending in a line break has an empty last line starting at len(text)."""
    return [0, *(m.end() for m in _BREAK.finditer(text))]


def _insert(text: str, starts: list[int], inserts: list[tuple[int, list[str]]]) -> str:
    """`text` with each block of lines put at the start of its line index (past the end: at the end). Each new
    line ends as the line before it does (a file may mix CR LF and LF), else as most of the file's lines do."""
    crlf = text.count("\r\n")
    default = "\r\n" if crlf > text.count("\n") - crlf else "\n"
    out = ""
    pos = 0
    for index, block in sorted(inserts, key=lambda item: item[0]):  # stable: one place keeps the edits' order
        at = starts[index] if index < len(starts) else len(text)
        out += text[pos:at]
        pos = at
        if out.endswith("\r\n"):
            newline = "\r\n"
        elif out.endswith(("\n", "\r")):
            newline = out[-1]
        else:
            newline = default
            if out and not _BREAK.match(out[-1]):
                out += newline  # the last line had no line break: give it one before the new lines
        out += "".join(line + newline for line in block)
    return out + text[pos:]


def _existing_comments(text: str) -> str:
    lines = _BREAK.split(text)
    return "\n".join(line.strip() + " " for line in lines if line.strip().startswith(MARK))


class _Alias(yaml.Node):
    """An alias (`*name`) with the marks of where it is written; `target` is the anchored node."""

    id = "alias"

    def __init__(self, target: yaml.Node, start_mark: yaml.Mark, end_mark: yaml.Mark) -> None:
        super().__init__(target.tag, target.value, start_mark, end_mark)
        self.target = target


class _PlacingLoader(yaml.SafeLoader):
    """SafeLoader's composer, but an alias becomes an _Alias: the anchored node itself carries the anchor's
    marks, so a block whose last value is an alias would seem to end where the anchor is."""

    def compose_node(self, parent: yaml.Node | None, index: object) -> yaml.Node | None:
        if self.check_event(yaml.AliasEvent):
            event = self.get_event()
            if event.anchor not in self.anchors:
                raise yaml.composer.ComposerError(None, None, f"found undefined alias {event.anchor!r}",
                                                  event.start_mark)
            return _Alias(self.anchors[event.anchor], event.start_mark, event.end_mark)
        return super().compose_node(parent, index)  # type: ignore[no-any-return]


def _compose(text: str, path: str) -> yaml.Node | None:
    loader = _PlacingLoader(text)
    try:
        return loader.get_single_node()  # type: ignore[no-any-return]
    except yaml.YAMLError as exc:  # the loader has read it already: not expected
        raise InputError(path, None, "", f"invalid YAML: {exc}") from None
    finally:
        loader.dispose()


def _pair(node: yaml.Node | None, key: str) -> tuple[yaml.Node, yaml.Node] | None:
    """The mapping's own (key node, value node) for `key` (merged `<<` keys are not its own)."""
    if not isinstance(node, yaml.MappingNode):
        return None
    for k, v in node.value:
        named = k.target if isinstance(k, _Alias) else k  # `*name: ...` is a key too
        if isinstance(named, yaml.ScalarNode) and named.value == key and named.tag != "tag:yaml.org,2002:merge":
            return k, v
    return None


def _child(node: yaml.Node | None, key: str) -> yaml.Node | None:
    pair = _pair(node, key)
    return pair[1] if pair else None


def _line(node_or_mark: yaml.Node | yaml.Mark) -> int:
    mark = node_or_mark.start_mark if isinstance(node_or_mark, yaml.Node) else node_or_mark
    return mark.line + 1


def _content_end(node: yaml.Node) -> int:
    """The index of the line after `node`'s last character (its last line + 1, 0-based)."""
    if isinstance(node, yaml.MappingNode) and not node.flow_style and node.value:
        return _content_end(node.value[-1][1])
    if isinstance(node, yaml.SequenceNode) and not node.flow_style and node.value:
        return _content_end(node.value[-1])
    end = node.end_mark
    # A block scalar (| or >) ends at the start of the line after it.
    return end.line if end.column == 0 and end.line > node.start_mark.line else end.line + 1


def _refuse_shared(text: str, path: str, field_name: str, key: yaml.Node, value: yaml.Node) -> None:
    """An alias (`*x`) or an anchored node (`&x`) is shared with other places: adding to it would add there too."""
    if isinstance(value, _Alias):
        raise InputError(path, _line(key), field_name, "is an alias (*name) of another node: adding to it would "
                                                       "add there too; write this host's own block")
    between = text[key.end_mark.index:value.start_mark.index + 1]
    first = value.value[0][0] if isinstance(value, yaml.MappingNode) and value.value else None
    if first is not None:
        between = text[key.end_mark.index:first.start_mark.index]
    if "&" in between.split("#")[0] or "*" in between.split("#")[0]:
        raise InputError(path, _line(key), field_name, "is anchored (&name) and may be shared: adding to it "
                                                       "would add there too; write this host's own block")


def _container_lines(c: NewContainer, indent: str, step: str, as_list: bool) -> list[str]:
    fields = [("name", c.name), ("venv", c.venv), ("python", c.python)]
    body = [f"{k}: {scalar(v)}" for k, v in fields if v]
    if as_list:
        head = f"{indent}- vmid: {c.vmid}"
        return [head, *(f"{indent}  {b}" for b in body)]
    if not body:
        return [f"{indent}{c.vmid}: {{}}"]
    return [f"{indent}{c.vmid}:", *(f"{indent}{step}{b}" for b in body)]


def _into_host(text: str, path: str, edit: HostEdit, key_node: yaml.Node, host_node: yaml.Node,
               skip_lines: list[str]) -> tuple[int, list[str]]:
    field_host = f"hosts.{edit.host}"
    _refuse_shared(text, path, field_host, key_node, host_node)
    if not isinstance(host_node, yaml.MappingNode) or host_node.flow_style:
        raise InputError(path, _line(key_node), field_host, "is written in flow style ({...}): write it as a block "
                                                           "mapping for discover to add to it")
    pair = _pair(host_node, "containers")
    if pair is None and any(k.tag == "tag:yaml.org,2002:merge" for k, _ in host_node.value):
        raise InputError(path, _line(key_node), field_host, "takes keys from a `<<` merge: a `containers:` key "
                                                           "written here would replace merged ones; write this "
                                                           "host's `containers:` block in it")
    if pair is None:
        # No containers yet: a `containers:` key at the host's own indentation, after its last line.
        indent = " " * host_node.value[0][0].start_mark.column
        step = "  "
        block = [f"{indent}containers:"]
        for c in edit.add:
            block += _container_lines(c, indent + step, step, as_list=False)
        block += [f"{indent}{step}{line}" for line in skip_lines]
        if not edit.add:
            block = [f"{indent}{line}" for line in skip_lines]
        return _content_end(host_node), block
    ckey, cnode = pair
    field_ct = f"{field_host}.containers"
    _refuse_shared(text, path, field_ct, ckey, cnode)
    if not isinstance(cnode, yaml.MappingNode | yaml.SequenceNode) or cnode.flow_style:
        if isinstance(cnode, yaml.ScalarNode) and cnode.value == "" and cnode.tag == "tag:yaml.org,2002:null":
            raise InputError(path, _line(ckey), field_ct, "is empty (null): write `containers: {}` as a block, or "
                                                         "remove the key, for discover to add to it")
        raise InputError(path, _line(ckey), field_ct, "is written in flow style ({...} or [...]): write it as a "
                                                     "block for discover to add to it")
    as_list = isinstance(cnode, yaml.SequenceNode)
    if as_list:
        # `- vmid: N` items at the column of the first dash.
        indent = " " * cnode.start_mark.column
        step = "  "
    else:
        first_key, first_value = cnode.value[0]
        indent = " " * first_key.start_mark.column
        step = "  "
        if isinstance(first_value, yaml.MappingNode) and not first_value.flow_style and first_value.value:
            step = " " * max(1, first_value.value[0][0].start_mark.column - first_key.start_mark.column)
    block: list[str] = []
    for c in edit.add:
        block += _container_lines(c, indent, step, as_list)
    block += [f"{indent}{line}" for line in skip_lines]
    return _content_end(cnode), block


def _new_host(line_count: int, hosts_node: yaml.Node | None, root: yaml.Node | None, path: str, edit: HostEdit,
              skip_lines: list[str]) -> tuple[int, list[str]]:
    s = edit.settings
    assert s is not None
    if hosts_node is None:
        if root is not None and not (isinstance(root, yaml.MappingNode) and not root.flow_style):
            raise InputError(path, 1, "", "not a block mapping: discover cannot add a `hosts:` key to it")
        at = _content_end(root) if root is not None else line_count
        head, indent = ["hosts:"], "  "
    else:
        if not isinstance(hosts_node, yaml.MappingNode) or hosts_node.flow_style or not hosts_node.value:
            raise InputError(path, _line(hosts_node), "hosts", "is not a block mapping: write it as one for discover "
                                                               "to add a host to it")
        at = _content_end(hosts_node)
        head, indent = [], " " * hosts_node.value[0][0].start_mark.column
    step = "  "
    body = [f"address: {scalar(s.address)}", f"user: {scalar(s.user)}"]
    if s.port != 22:
        body.append(f"port: {s.port}")
    for key, value in (("identity_file", s.identity_file), ("known_hosts", s.known_hosts), ("pct", s.pct)):
        if value:
            body.append(f"{key}: {scalar(value)}")
    if s.sudo is not None:
        body.append(f"sudo: {scalar(s.sudo)}")
    block = [*head, f"{indent}{scalar(edit.host)}:", *(f"{indent}{step}{b}" for b in body),
             f"{indent}{step}containers:"]
    for c in edit.add:
        block += _container_lines(c, indent + step * 2, step, as_list=False)
    block += [f"{indent}{step * 2}{line}" for line in skip_lines]
    return at, block
