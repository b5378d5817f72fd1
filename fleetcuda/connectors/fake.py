"""A connector with scripted replies, for driving the engine in-process (as fabric.testing does for fabric):
no host, no SSH, no shell. Nothing in fleetcuda uses it outside tests.

    fake = FakeTransport()
    fake.on(step="cuda", phase="check", reply=exit_with(1))       # not satisfied yet
    fake.on(step="cuda", phase="verify", reply=ok("cuda 12.8"))
    gate = fake.block(step="build", phase="apply")                # waits until gate.release() or abort()
    pool = TransportPool(lambda host: fake)
    ...
    fake.calls_for(step="cuda", phase="apply")                    # what was sent, in order

A command is matched by its step and phase (what the engine says it sends it for, see base.Purpose), by its
label without the run id (`fleetcuda:<step>`, `fleetcuda-lock`), or by a predicate on the Call; the first rule
added that matches answers it. What no rule answers gets the default reply (exit 0, no output), except
fleetcuda's own protocol, which the fake speaks by itself:

- batched checks (`fleetcuda-batch`): each check in it is answered by the rules as a Call of its own step with
  the batch's phase (`batched=True`), and the answers framed as the target's bash would frame them;
- apply locks: acquire, release, refresh and take-over against an in-memory lock table (`locks`), where a test
  can put another run's lock (`locks.hold(name, owner)`); in a batch too;
- facts (`fleetcuda-facts`): answered from `facts`;
- files: `put`/`get`, and the `mktemp -d`, `rm -rf` and `pct push`/`pct pull` of connectors.transfer, on an
  in-memory file store (`files`), the host's files apart from each container's.
"""

from __future__ import annotations

import itertools
import json
import re
import shlex
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from fleetcuda.connectors.base import OnLine, RunResult, Transport, current_purpose
from fleetcuda.plan.command import BuiltCommand
from fleetcuda.remote import framing

Place = int | None  # a container's vmid, or None for the host itself


def framed(call: Call, kind: str, *fields: str) -> str:
    """A frame as fleetcuda's target-side programs print it (fleetcuda.remote.emit), with the nonce this call
    was sent on stdin; a dict field is written as emit_json writes it."""
    words = [json.dumps(f, sort_keys=True, separators=(",", ":")) if isinstance(f, dict) else f for f in fields]
    return f"\n{framing.MARK}:{_nonce_of(call)} {' '.join([kind, *words])}\n"


def _nonce_of(call: Call) -> str:
    assert call.cmd is not None, "only a command sent with its stdin carries a nonce"
    return call.cmd.stdin.split("\0")[0]  # the nonce travels first on stdin (framing.nonce_vars)


def ok(output: str = "") -> RunResult:
    return RunResult(0, output, 0.0)


def exit_with(rc: int, output: str = "") -> RunResult:
    return RunResult(rc, output, 0.0)


@dataclass
class Call:
    """One thing the fake was asked to do: a command (`run`), or a file copy (`put`, `get`)."""

    kind: str  # run | put | get
    step: str  # the engine's step name; for its own commands the label's name (lock, batch, stop, ...)
    phase: str  # check, apply, verify, install, fingerprint, transfer, put, get, ...; or as step, if unsaid
    label: str = ""  # the label without its run id: fleetcuda:<step> or fleetcuda-<what>
    target: str = ""  # the target id the engine sent it for ("" when it did not say)
    script: str = ""  # what bash runs in the target (a batched check: its line of the batch)
    place: Place = None  # where it runs: the container's vmid, or None for the host
    cmd: BuiltCommand | None = None
    timeout: float | None = None
    paths: tuple[str, str] = ("", "")  # put: (local, remote); get: (remote, local)
    batched: bool = False


Reply = RunResult | Callable[[Call], RunResult]
Match = Callable[[Call], bool]


class Gate:
    """A blocked call: `entered` is set when a matching call arrives; it waits until `release()`, or until the
    fake is aborted (then it returns exit 143, as a command whose channel was closed)."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self._released = threading.Event()
        self.aborted = False
        self.calls: list[Call] = []

    def release(self) -> None:
        self._released.set()

    def hold(self, call: Call) -> None:
        """What the blocked call does: say it arrived, then wait for release (or abort)."""
        self.calls.append(call)
        self.entered.set()
        self._released.wait()

    def wait_entered(self, timeout: float = 5.0) -> Call:
        if not self.entered.wait(timeout):
            raise TimeoutError("no call reached the gate")
        return self.calls[0]


@dataclass
class Rule:
    step: str | None = None
    phase: str | None = None
    label: str | None = None
    kind: str | None = None
    match: Match | None = None
    reply: Reply = field(default_factory=ok)
    times: int | None = None  # answers this many calls, then no more (None: every call)
    gate: Gate | None = None
    used: int = 0

    def matches(self, call: Call) -> bool:
        if self.times is not None and self.used >= self.times:
            return False
        return ((self.step is None or call.step == self.step) and (self.phase is None or call.phase == self.phase)
                and (self.label is None or call.label == self.label) and (self.kind is None or call.kind == self.kind)
                and (self.match is None or self.match(call)))


class FileStore:
    """Files by place (None: the host; a vmid: that container) and path."""

    def __init__(self) -> None:
        self._files: dict[tuple[Place, str], bytes] = {}
        self._lock = threading.Lock()

    def write(self, place: Place, path: str, data: bytes) -> None:
        with self._lock:
            self._files[(place, path)] = data

    def read(self, place: Place, path: str) -> bytes:
        with self._lock:
            if (place, path) not in self._files:
                raise FileNotFoundError(f"{_where(place)}: {path}")
            return self._files[(place, path)]

    def exists(self, place: Place, path: str) -> bool:
        with self._lock:
            return (place, path) in self._files

    def paths(self, place: Place) -> list[str]:
        with self._lock:
            return sorted(p for pl, p in self._files if pl == place)

    def remove_tree(self, place: Place, path: str) -> None:
        with self._lock:
            for key in [k for k in self._files if k[0] == place and (k[1] == path or k[1].startswith(path + "/"))]:
                del self._files[key]


class FakeLocks:
    """Apply locks by name (fleetcuda-apply-<vmid>), as the lock directories on targets would hold them."""

    def __init__(self) -> None:
        self.owners: dict[str, str] = {}
        self.events: list[tuple[str, str, str]] = []  # (word said, lock name, owner), in order
        self._lock = threading.Lock()

    def hold(self, name: str, owner: str) -> None:
        """Another run's lock: `owner` as run.locks.run_owner writes it."""
        with self._lock:
            self.owners[name] = owner

    def said(self, word: str) -> int:
        return sum(1 for w, _, _ in self.events if w == word)

    def act(self, action: str, name: str, owner: str) -> tuple[str, list[str]]:
        """(frame word, its fields) for one action of run.locks' scripts."""
        with self._lock:
            holder = self.owners.get(name)
            if action == "acquire":
                if holder is not None and holder != owner:
                    self.events.append(("busy", name, holder))
                    return "busy", [f"/run/lock/{name}", *holder.split(" ")]
                self.owners[name] = owner
                word = "held"
            elif holder != owner:
                return "", []  # not this owner's lock: the script says nothing
            elif action == "refresh":
                word = "refreshed"
            else:  # release, take-over
                del self.owners[name]
                word = "taken-over" if action == "take-over" else "released"
            self.events.append((word, name, owner))
            return word, []


# run.locks' scripts: remote/lock.sh's functions, then one call of them per action, `fleetcuda_lock_<action>
# NAME OWNER ...` on a line of its own (quoted as command.quote quotes).
_LOCK_CALL = re.compile(r"^fleetcuda_lock_(acquire|release|refresh|take_over) (.*)$", re.M)
_BATCH_PROBE = re.compile(r'begin (\d+)"; fc_ms; fc_t=\$fc_m\n(.*?)\n[^\n]* end \1 \$fc_rc ', re.S)
_PROBE_LABEL = re.compile(r"^: '?(fleetcuda:[^'\n]+)'?$", re.M)


def _where(place: Place) -> str:
    return "the host" if place is None else f"container {place}"


def _label_name(label: str) -> str:
    return label.rpartition("@")[0] if "@" in label else label


def _step_of(label: str) -> str:
    name = _label_name(label)
    return name.removeprefix("fleetcuda:").removeprefix("fleetcuda-")


class FakeTransport(Transport):
    def __init__(self, *, local: bool = False, default: Reply | None = None, facts: dict[str, str] | None = None):
        self.local = local
        self.default = default or ok()
        self.facts = dict(facts or {})
        self.rules: list[Rule] = []
        self.calls: list[Call] = []
        self.files = FileStore()
        self.locks = FakeLocks()
        self.aborted = 0  # how many times abort() was called
        self.closed = False
        self._gates: list[Gate] = []
        self._lock = threading.Lock()
        self._temp = itertools.count(1)

    # -- scripting --------------------------------------------------------------------------

    def on(self, *, step: str | None = None, phase: str | None = None, label: str | None = None,
           kind: str | None = None, match: Match | None = None, reply: Reply | None = None,
           times: int | None = None) -> Rule:
        """Answer matching calls with `reply` (a RunResult, or a function of the Call that returns one)."""
        rule = Rule(step, phase, label, kind, match, reply or ok(), times)
        self.rules.append(rule)
        return rule

    def block(self, *, step: str | None = None, phase: str | None = None, label: str | None = None,
              kind: str | None = None, match: Match | None = None, reply: Reply | None = None) -> Gate:
        """Matching calls wait at the returned gate until it is released (then `reply`) or the fake aborted."""
        gate = Gate()
        self.rules.append(Rule(step, phase, label, kind, match, reply or ok(), gate=gate))
        self._gates.append(gate)
        return gate

    def calls_for(self, *, step: str | None = None, phase: str | None = None, kind: str | None = None,
                  label: str | None = None) -> list[Call]:
        probe = Rule(step, phase, label, kind)
        with self._lock:
            return [c for c in self.calls if probe.matches(c)]

    # -- the Transport interface -------------------------------------------------------------

    def run(self, cmd: BuiltCommand, *, timeout: float | None, on_line: OnLine) -> RunResult:
        call = self._call("run", cmd.label, cmd=cmd, timeout=timeout, script=cmd.argv[-2] if len(cmd.argv) > 1 else "",
                          place=_place_of(cmd))
        res = self._answer(call)
        for line in res.output.splitlines():
            on_line(line)
        return res

    def put(self, local: Path, remote: str) -> None:
        call = self._call("put", "", paths=(str(local), remote))
        self._copy(call, lambda: self.files.write(None, remote, Path(local).read_bytes()))

    def get(self, remote: str, local: Path) -> None:
        call = self._call("get", "", paths=(remote, str(local)))
        self._copy(call, lambda: _write_private(local, self.files.read(None, remote)))

    def _copy(self, call: Call, copy: Callable[[], None]) -> None:
        """A rule may refuse a copy (exit != 0) or hold it at a gate; otherwise the file store does it."""
        rule = self._rule_for(call, protocol=False)
        res = self._reply(rule, call) if rule is not None else ok()
        if res.rc != 0:
            raise OSError(f"fake {call.kind} {call.paths[0]} -> {call.paths[1]} failed: {res.output or res.rc}")
        copy()

    def abort(self) -> None:
        self.aborted += 1
        for gate in list(self._gates):
            gate.aborted = True
            gate.release()

    def close(self) -> None:
        self.closed = True

    # -- answering --------------------------------------------------------------------------

    def _call(self, kind: str, label: str, **fields: object) -> Call:
        said = current_purpose()
        name = _label_name(label)
        step = said.step if said else (_step_of(label) if label else kind)
        phase = said.phase if said else (_step_of(label) if label else kind)
        call = Call(kind, step, phase, name, said.target if said else "", **fields)  # type: ignore[arg-type]
        self._record(call)
        return call

    def _record(self, call: Call) -> None:
        with self._lock:
            self.calls.append(call)

    def _rule_for(self, call: Call, protocol: bool) -> Rule | None:
        with self._lock:
            for rule in self.rules:
                # fleetcuda's own protocol is the fake's to answer, unless a rule names its label.
                if protocol and rule.label != call.label:
                    continue
                if rule.matches(call):
                    rule.used += 1
                    return rule
        return None

    def _answer(self, call: Call) -> RunResult:
        protocol = call.label in ("fleetcuda-batch", "fleetcuda-lock", "fleetcuda-facts")
        rule = self._rule_for(call, protocol)
        if rule is not None:
            return self._reply(rule, call)
        if call.label == "fleetcuda-batch":
            return self._batch(call)
        if call.label == "fleetcuda-lock":
            return self._lock_script(call)
        if call.label == "fleetcuda-facts":
            return self._facts(call)
        files = self._file_command(call)
        return files if files is not None else self._default(call)

    def _default(self, call: Call) -> RunResult:
        return self.default(call) if callable(self.default) else self.default

    def _reply(self, rule: Rule, call: Call) -> RunResult:
        start = time.monotonic()
        if rule.gate is not None:
            rule.gate.hold(call)
            if rule.gate.aborted:
                return RunResult(143, "Terminated", time.monotonic() - start)
        res = rule.reply(call) if callable(rule.reply) else rule.reply
        return RunResult(res.rc, res.output, res.duration or time.monotonic() - start, res.timed_out)

    # -- fleetcuda's protocol ------------------------------------------------------------------

    def _lock_frames(self, script: str, mark: str) -> tuple[str, bool]:
        """The lock frames a script of run.locks prints, and whether it ended there (busy: exit 75)."""
        out = ""
        for call in _LOCK_CALL.finditer(script):
            action = call[1].replace("_", "-")
            name, owner = shlex.split(call[2])[:2]
            said, fields = self.locks.act(action, name, owner)
            if said:
                out += f"\n{mark} lock {' '.join([said, *fields])}\n"
            if said == "busy":
                return out, True
        return out, False

    def _lock_script(self, call: Call) -> RunResult:
        out, busy = self._lock_frames(call.script, f"{framing.MARK}:{_nonce_of(call)}")
        return exit_with(75 if busy else 0, out)

    def _batch(self, call: Call) -> RunResult:
        mark = f"{framing.MARK}:{_nonce_of(call)}"
        script = call.script
        # planner.batch_command: [the lock's acquire], the checks, [if all passed: the lock's release], done.
        release_at = script.find('if [ "$all_ok" = 1 ]')
        first_check = script.find(" begin ")
        head = script[:first_check if first_check >= 0 else None]
        out, busy = self._lock_frames(head, mark)
        if busy:
            return exit_with(75, out)
        all_ok = True
        probes = _BATCH_PROBE.findall(script)
        for index, line in probes:
            label_m = _PROBE_LABEL.search(line)
            label = label_m[1] if label_m else ""
            probe = Call("run", _step_of(label), call.phase, _label_name(label), call.target, line, call.place,
                         None, call.timeout, batched=True)
            self._record(probe)
            rule = self._rule_for(probe, protocol=False)
            res = self._reply(rule, probe) if rule is not None else self._default(probe)
            body = "".join(f"| {ln}\n" for ln in res.output.splitlines())
            out += f"\n{mark} begin {index}\n{body}\n{mark} end {index} {res.rc} {int(res.duration * 1000)}\n"
            all_ok = all_ok and res.rc == 0
        if all_ok and release_at >= 0:  # nothing to apply: the lock is given back at once
            out += self._lock_frames(script[release_at:], mark)[0]
        return ok(out + f"\n{mark} done {len(probes)}\n")

    def _facts(self, call: Call) -> RunResult:
        mark = f"{framing.MARK}:{_nonce_of(call)}"
        out = ""
        for name in re.findall(r" fact (\w+)\"", call.script):
            if name in self.facts:
                out += f"\n{mark} fact {name}\n| {self.facts[name]}\n"
        return ok(out)

    def _file_command(self, call: Call) -> RunResult | None:
        """connectors.transfer's one-line commands, on the file store; None for anything else."""
        try:
            words = shlex.split(call.script)
        except ValueError:
            return None
        if words[:3] == ["sudo", "-n", "--"]:
            words = words[3:]
        if words[:2] == ["mktemp", "-d"] and len(words) == 3 and words[2].endswith("XXXXXX"):
            path = words[2].removesuffix("XXXXXX") + f"fake{next(self._temp):02d}"
            return ok(path + "\n")
        if words[:3] == ["rm", "-rf", "--"] and len(words) == 4:
            self.files.remove_tree(call.place, words[3])
            return ok()
        if len(words) >= 5 and words[0].endswith("pct") and words[1] in ("push", "pull"):
            vmid = int(words[2])
            source, dest = (None, vmid) if words[1] == "push" else (vmid, None)
            try:
                self.files.write(dest, words[4], self.files.read(source, words[3]))
            except FileNotFoundError as exc:
                return exit_with(2, f"pct {words[1]}: {exc}")
            return ok()
        return None


def _place_of(cmd: BuiltCommand) -> Place:
    argv = list(cmd.argv)
    for i, word in enumerate(argv[:-2]):
        if word.endswith("pct") and argv[i + 1] == "exec" and argv[i + 2].isdigit():
            return int(argv[i + 2])
    return None


def _write_private(path: Path, data: bytes) -> None:
    path.touch(mode=0o600)
    path.write_bytes(data)
