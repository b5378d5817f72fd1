"""A recipe and its targets as a self-contained Ansible project (pure: no I/O but reading known_hosts).

Every command is the argv fleetcuda's planner builds for that target (`env -i ... timeout ... bash -c
SCRIPT LABEL`, the part that runs inside the container), carried as `!unsafe` YAML so that neither Jinja
nor a shell ever reads it, and run by `ansible.builtin.command` with `argv:` and
`expand_argument_vars: false`. The playbook only decides which of a step's commands run, as fleetcuda's
engine does: check; if it fails, apply; then verify, which must pass.

Secrets: the planner is given a placeholder for each secret variable, so that every place a secret
reaches (an environment variable, a `{{ }}` in a script, a token a step kind put in a URL) comes out on
the command's stdin, never in its argv; the export then writes that stdin as a Jinja expression naming
a prompted (or vaulted, or AWX-supplied) variable. No secret value is ever in the files.
"""

from __future__ import annotations

import json
import os
import re
import secrets as pyrandom
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from fleetcuda import __version__
from fleetcuda.errors import InputError
from fleetcuda.plan.command import BuiltCommand, HopChain, host_argv
from fleetcuda.plan.inventory import Inventory, Target
from fleetcuda.plan.planner import PlannedStep, Secrets, base_values, make_plan, pending_facts
from fleetcuda.plan.recipe import Recipe
from fleetcuda.plan.templating import FILTERS, SHELL_EXPANSION
from fleetcuda.redact import url_credentials

MARKER = ".fleetcuda-export"
# ansible 12.3.0 bundles ansible-core 2.19 and community.proxmox 1.4.0, the version this export was tested with.
COMMUNITY_PROXMOX = "1.4.0"
ANSIBLE_PACKAGE = "ansible==12.3.0"
SECRET_PREFIX = "fleetcuda_secret_"
# Labels carry a run id in fleetcuda (what Ctrl-C stops); an exported playbook is one "run" per export.
RUN_ID = "ansible"
EXPORT_NONCE = "0" * 16  # frames' nonce in the exported commands (fleetcuda's own runs make a new one each run)
# Where a shared build leaves its wheel, as the build says it in its `wheel` frame
# (`@@fleetcuda:<nonce> wheel /tmp/fleetcuda-wheel.X/f.whl <sha256>`, see fleetcuda.remote.framing).
KEPT_WHEEL_DIR = "'(?<= wheel )/tmp/fleetcuda-wheel[.][A-Za-z0-9]+(?=/)'"


class Unsafe(str):
    """A string Ansible must never template. Written double-quoted (every byte a script holds, newlines, quotes
    and control characters, escaped losslessly) inside a list or mapping tagged `!unsafe`: ansible-core resolves
    an `!unsafe` scalar as if it were plain (`!unsafe "1"` is an int, `!unsafe ""` None), a container not."""


class UnsafeList(list[Unsafe]):
    pass


class UnsafeMap(dict[str, Unsafe]):
    pass


class _Dumper(yaml.SafeDumper):
    pass


def _unsafe(dumper: yaml.SafeDumper, data: Unsafe) -> yaml.Node:
    return dumper.represent_scalar("tag:yaml.org,2002:str", str(data), style='"')


def _unsafe_list(dumper: yaml.SafeDumper, data: UnsafeList) -> yaml.Node:
    return dumper.represent_sequence("!unsafe", data)


def _unsafe_map(dumper: yaml.SafeDumper, data: UnsafeMap) -> yaml.Node:
    return dumper.represent_mapping("!unsafe", data)


def _text(dumper: yaml.SafeDumper, data: str) -> yaml.Node:
    style = '"' if any(c in data for c in "{}\n'\"#:") or not data.isprintable() else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", data, style=style)


_Dumper.add_representer(Unsafe, _unsafe)
_Dumper.add_representer(UnsafeList, _unsafe_list)
_Dumper.add_representer(UnsafeMap, _unsafe_map)
_Dumper.add_representer(str, _text)


def dump(data: Any, header: str = "") -> str:
    body = yaml.dump(data, Dumper=_Dumper, sort_keys=False, allow_unicode=False, width=2**31, default_flow_style=False)
    return header + body


@dataclass
class HostExport:
    name: str  # the Ansible inventory hostname
    target: Target
    connection: dict[str, Any]
    steps: dict[str, dict[str, Any]]  # step name -> its commands; absent when `when:` skips it on this target
    public_vars: dict[str, str]


@dataclass
class Export:
    recipe: Recipe
    hosts: list[HostExport]
    secret_names: list[str]  # fleetcuda variable names whose values are prompted
    step_names: list[str]
    secret_steps: set[str] = field(default_factory=set)  # steps with a command whose stdin carries secrets
    shared_steps: set[str] = field(default_factory=set)
    retries: dict[str, tuple[int, float]] = field(default_factory=dict)
    known_hosts: list[str] = field(default_factory=list)


def host_name(target: Target) -> str:
    return f"{target.host}-{target.container.vmid}" if target.container else target.host


def _inner_argv(target: Target, built: BuiltCommand) -> list[str]:
    """The argv inside the target: what the planner built, less the `[sudo -n --] pct exec VMID --` that
    proxmox_pct_remote itself puts in front (a local target keeps it: there Ansible runs it as is)."""
    if target.spec.kind == "local":
        return list(built.argv)
    prefix = host_argv(target.chain, [])
    argv = list(built.argv)
    assert argv[:len(prefix)] == prefix, (argv[:len(prefix)], prefix)
    return argv[len(prefix):]


def _jinja_literal(text: str) -> str:
    """A Jinja string literal of a step name. ansible-core 2.19 does not unescape
    Jinja string literals, so anything else is carried in an `!unsafe` variable instead."""
    if not re.fullmatch(r"[A-Za-z0-9._-]+", text):
        raise ValueError(f"not plain text for a Jinja literal: {text!r}")
    return "'" + text + "'"


class _Placeholders:
    """A random stand-in per secret variable: the planner routes it wherever the secret would go."""

    def __init__(self, names: list[str]):
        token, dotted = pyrandom.token_hex(8), pyrandom.token_hex(4)
        # With a `.` in it, so that `{{ secret | dashed }}` (nodot, major) is told apart from the secret: each
        # form the planner can make of a placeholder maps to the Jinja expression making it of the secret.
        self.planned = {f"fcsecret{i}x{token}.{dotted}": name for i, name in enumerate(names)}
        self.by_value: dict[str, str] = {}
        for placeholder, name in self.planned.items():
            var = SECRET_PREFIX + name
            forms = {placeholder: var, **{f(placeholder): expr.format(var) for f, expr in (
                (FILTERS["dashed"], "({} | replace('.', '-'))"), (FILTERS["nodot"], "({} | replace('.', ''))"),
                (FILTERS["major"], "({}.split('.') | first)"))}}
            assert set(FILTERS) == {"dashed", "nodot", "major"} and len(forms) == 4
            self.by_value.update(forms)

    def stdin_expression(self, stdin: str, where: str, ref: str) -> tuple[str, UnsafeList]:
        """`stdin` with each placeholder as its prompted variable, as one Jinja expression, and the literal
        text between them (NULs, the rest of a URL), which the expression names as `<ref>.stdin_text[i]`."""
        parts: list[str] = []
        literals = UnsafeList()

        def literal(text: str) -> None:
            parts.append(f"{ref}.stdin_text[{len(literals)}]")
            literals.append(Unsafe(text))

        rest = stdin
        while rest:
            hits = [(rest.find(p), p) for p in self.by_value if p in rest]
            if not hits:
                literal(rest)
                break
            at, placeholder = min(hits, key=lambda h: (h[0], -len(h[1])))  # the longest form where it starts
            if at:
                literal(rest[:at])
            parts.append(self.by_value[placeholder])
            rest = rest[at + len(placeholder):]
        for piece in stdin.split("\0")[:-1]:
            # The frame nonce goes first on the stdin of a script that prints frames: fixed and public here (the
            # playbook reads no frames but the wheel path's), not a secret.
            if piece != EXPORT_NONCE and not any(p in piece for p in self.by_value):
                raise InputError("export", None, where, "a secret written literally in the recipe (an `env:` value "
                                 "named like a token) would be in clear in the exported files: put it in a "
                                 "variable listed under the recipe's `secrets:`")
        return "{{ " + " ~ ".join(parts) + " }}", literals

    def check_absent(self, argv: list[str], where: str) -> None:
        for word in argv:
            if any(p in word for p in self.by_value):
                raise InputError("export", None, where, "a secret would be on the command line in the exported "
                                 "playbook; fleetcuda refuses to export it")


def _command(target: Target, built: BuiltCommand, placeholders: _Placeholders, where: str,
             ref: str) -> dict[str, Any]:
    argv = _inner_argv(target, built)
    placeholders.check_absent(argv, where)
    out: dict[str, Any] = {"argv": UnsafeList(Unsafe(a) for a in argv)}
    if built.stdin:
        out["stdin"], out["stdin_text"] = placeholders.stdin_expression(built.stdin, where, ref)
    return out


def _connection(target: Target) -> dict[str, Any]:
    spec = target.spec
    chain: HopChain = target.chain
    if spec.kind == "local":
        return {"ansible_connection": "local", "ansible_python_interpreter": "{{ ansible_playbook_python }}"}
    hop = chain.ssh
    assert hop is not None
    if hop.jump is not None:
        raise InputError("export", None, f"hosts.{target.host}.jump",
                         "jump hosts are not exported (proxmox_pct_remote has no jump setting): "
                         "set ansible_paramiko_proxy_command in the exported inventory by hand, or --limit them out")
    conn: dict[str, Any] = {"ansible_host": hop.address, "ansible_port": hop.port, "ansible_user": hop.user,
                            "ansible_ssh_timeout": hop.connect_timeout,
                            "ansible_host_key_checking": True,
                            "ansible_python_interpreter": "/usr/bin/python3"}
    if hop.identity_file:
        conn["ansible_private_key_file"] = _local_path(hop.identity_file)
    if target.container is not None:
        assert chain.pct is not None
        if chain.pct.pct != "/usr/sbin/pct":
            raise InputError("export", None, f"hosts.{target.host}.pct",
                             f"proxmox_pct_remote always runs /usr/sbin/pct, not {chain.pct.pct}")
        conn["ansible_connection"] = "community.proxmox.proxmox_pct_remote"
        conn["proxmox_vmid"] = target.container.vmid
        # The plugin puts its become method before pct for any user not named root; `-n`: never a password.
        # A user that is root under another name (`sudo: false`) runs pct as fleetcuda does: `env` changes nothing.
        if chain.pct.sudo:
            conn["proxmox_become_method"] = "sudo -n"
        elif hop.user != "root":
            conn["proxmox_become_method"] = "/usr/bin/env"
    else:
        conn["ansible_connection"] = "ssh"
        args = ["-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=yes", "-o", "UpdateHostKeys=no"]
        if hop.known_hosts:
            # Ansible splits these args like a shell line, then OpenSSH splits the value on spaces: quoted for
            # both, as fleetcuda's ssh_argv does (a path `kh -F evil.cfg` gave ssh a config file).
            kh = _local_path(hop.known_hosts).replace("\\", "\\\\").replace('"', '\\"').replace("%", "%%")
            args += ["-o", f'UserKnownHostsFile="{kh}"']
        conn["ansible_ssh_common_args"] = shlex.join(args)
    return conn


def _local_path(path: str) -> str:
    """A path on the control machine as the playbook, run in the export's directory, must name it: fleetcuda
    reads a relative one from where it runs (the export's working directory)."""
    return path if path.startswith("~") else os.path.abspath(path)


def build_export(recipe: Recipe, targets: list[Target], overrides: Mapping[str, str]) -> Export:
    if not targets:
        raise InputError("--limit", None, "", "selects no target: there is nothing to export")
    hosts: list[HostExport] = []
    secret_names: set[str] = set()
    exp = Export(recipe, hosts, [], [s.name for s in recipe.steps])
    seen: dict[str, str] = {}
    for target in targets:
        name = host_name(target)
        if name in seen:
            raise InputError("export", None, target.id, f"its Ansible host name {name} is also {seen[name]}'s")
        seen[name] = target.id
        values = base_values(recipe, target, dict(overrides))
        pending = pending_facts(recipe, values)
        if pending:
            # The planner resolves facts into the commands' text; the playbook carries literal commands.
            raise InputError("export", None, target.id,
                             f"{', '.join(pending)} {'is' if len(pending) == 1 else 'are'} `auto` (read from the "
                             f"target at run time): pass --var {pending[0]}=VALUE (fleetcuda apply --check shows "
                             f"what a target reads) or set it in the inventory")
        real = Secrets(recipe, values)  # what is secret with the real values (the plan below gets placeholders)
        names = sorted(n for n in real.names if n in values)
        secret_names.update(names)
        for n, spec in enumerate(recipe.steps):
            # `when:` is decided at export time; a secret's value is known only when the playbook runs.
            read = re.match(r"\s*!?\s*([A-Za-z_][A-Za-z0-9_]*)", spec.when or "")
            if read and read[1] in names:
                raise InputError("export", None, f"steps[{n}] ({spec.name}) when",
                                 f"reads the secret variable {read[1]}, which the playbook is given only when it "
                                 "runs: use a non-secret variable for `when:` (e.g. --var hf_login=1)")
        public = {k: v for k, v in values.items() if k not in names}
        # Before planning: the planner would route such a value to stdin as a secret of its own, which the
        # playbook could then only hold in clear; said here by the variable's name.
        _refuse_clear_secrets(target, real, public, {})
        placeholders = _Placeholders(names)
        planned_values = dict(values)
        for placeholder, var in placeholders.planned.items():
            planned_values[var] = placeholder
        plan = make_plan(recipe, target, planned_values, None, run_id=RUN_ID, nonce=EXPORT_NONCE)
        steps: dict[str, dict[str, Any]] = {}
        for step in plan.steps:
            # A step on the Proxmox host (`on: host`, e.g. the GPU passthrough check) is not exported: the
            # playbook's connection (proxmox_pct_remote) runs commands in the container; `fleetcuda verify` checks it.
            if step.skipped or step.on_host:
                continue
            steps[step.name] = _step_commands(exp, target, step, placeholders)
        _refuse_clear_secrets(target, real, public, steps)
        hosts.append(HostExport(name, target, _connection(target), steps, public))
    exp.secret_names = sorted(secret_names)
    return exp


def _url_credentials(text: str) -> bool:
    """A `scheme://user:password@` in clear; a password that is a shell variable (`${fc_token}`, read from
    stdin) is not one."""
    return any(not c.password.startswith("$") for c in url_credentials(text))


def _refuse_clear_secrets(target: Target, real: Secrets, public: Mapping[str, str],
                          steps: Mapping[str, Mapping[str, Any]]) -> None:
    """What fleetcuda treats as secret (a value holding a secret's value, credentials in a URL) would be in
    clear in the files: the planner was given placeholders, so it no longer sees such a value as secret."""
    pieces = real.pieces()
    fix = ("would be in clear in the exported files: put the secret in a variable listed under the recipe's "
           "`secrets:` and refer to it, rather than repeating its value or writing it in a URL")
    for k, v in public.items():
        if any(p in v for p in pieces) or _url_credentials(v):
            raise InputError("export", None, f"{target.id} variable {k}", fix)
    for step, commands in steps.items():
        for key, command in commands.items():
            words = [*command["argv"], *command.get("stdin_text", [])]
            if any(p in w for w in words for p in pieces) or any(_url_credentials(w) for w in words):
                raise InputError("export", None, f"{target.id} step {step} ({key})", fix)


def _step_commands(exp: Export, target: Target, step: PlannedStep, placeholders: _Placeholders) -> dict[str, Any]:
    where = f"{target.id} step {step.name}"
    out: dict[str, Any] = {}
    after = step.verify or step.check
    assert after is not None
    for key, built in (("check", step.check), ("apply", step.apply), ("after", after)):
        if built is not None:
            ref = f"fleetcuda_steps[{_jinja_literal(step.name)}].{key}"
            out[key] = _command(target, built, placeholders, f"{where} ({key})", ref)
            if "stdin" in out[key]:
                exp.secret_steps.add(step.name)
    if step.apply is not None and step.retries:
        exp.retries[step.name] = (step.retries, step.retry_delay)
    if step.shared is not None:
        exp.shared_steps.add(step.name)
    return out


# -- the files -------------------------------------------------------------------------------------


def _cmd_task(name: str, key: str, step: str, *, secret: bool) -> dict[str, Any]:
    ref = f"fleetcuda_steps[{_jinja_literal(step)}].{key}"
    task: dict[str, Any] = {
        "name": name,
        "ansible.builtin.command": {
            "argv": "{{ " + ref + ".argv }}",
            "expand_argument_vars": False,
            "stdin": "{{ " + ref + ".stdin | default(omit) }}",
            "stdin_add_newline": False,
        },
    }
    if secret:
        task["no_log"] = True
    return task


def _step_block(exp: Export, step: str, mode: str) -> dict[str, Any]:
    """One step's tasks. mode: `converge` (check -> apply -> verify; under --check, checks only) or `verify`."""
    s = f"fleetcuda_steps[{_jinja_literal(step)}]"
    secret = step in exp.secret_steps
    tasks: list[dict[str, Any]] = []
    if mode == "verify":
        # Every step is verified, as `fleetcuda verify` does; the drifted ones fail the host at the end.
        t = _cmd_task(f"{step}: verify", "after", step, secret=secret)
        t.update({"register": "fc_verify", "changed_when": False, "failed_when": False, "check_mode": False})
        tasks.append(t)
        tasks.append({"name": f"{step}: drift", "when": "fc_verify.rc != 0",
                      "ansible.builtin.set_fact": {"fc_drifted": f"{{{{ fc_drifted + [{_jinja_literal(step)}] }}}}"}})
    else:
        check = _cmd_task(f"{step}: check", "check", step, secret=secret)
        check.update({
            "when": f"{s}.check is defined",
            "register": "fc_check",
            "changed_when": False,
            # Not satisfied, and nothing to apply: the step fails here, as fleetcuda's does.
            "failed_when": f"fc_check.rc != 0 and {s}.apply is not defined",
            "check_mode": False,
        })
        assertion = _cmd_task(f"{step}: verify (assertion)", "after", step, secret=secret)
        assertion.update({"when": f"{s}.check is not defined and {s}.apply is not defined",
                          "changed_when": False, "check_mode": False})
        needs_apply = f"{s}.apply is defined and ({s}.check is not defined or fc_check.rc != 0)"
        would = {"name": f"{step}: would change (check mode)", "when": f"ansible_check_mode and {needs_apply}",
                 "ansible.builtin.debug": {"msg": "check not satisfied: apply would run"}, "changed_when": True}
        apply = _cmd_task(f"{step}: apply", "apply", step, secret=secret)
        apply.update({"when": f"not ansible_check_mode and {needs_apply}", "register": "fc_apply",
                      "changed_when": True, "check_mode": False})
        if step in exp.retries:
            count, delay = exp.retries[step]
            # fleetcuda backs off exponentially; Ansible waits the same delay each time.
            # An apply that ran out of time (timeout's 124, or 137 after its kill) is never sent again, as in
            # fleetcuda (it may be half done): `until` stops there, and the task fails on its exit status.
            apply.update({"retries": count, "delay": max(1, int(delay)),
                          "until": "fc_apply.rc == 0 or fc_apply.rc in [124, 137]"})
        after = _cmd_task(f"{step}: verify", "after", step, secret=secret)
        after.update({"when": "fc_apply is not skipped", "changed_when": False, "check_mode": False})
        tasks += [check, assertion, would, apply, after]
        if step in exp.shared_steps:
            # The build leaves its wheel for fleetcuda's cache (build-once); nothing fetches it here.
            tasks.append({
                "name": f"{step}: remove the wheel left for fleetcuda's build cache",
                "when": f"fc_apply is not skipped and fc_apply.stdout is search({KEPT_WHEEL_DIR})",
                "ansible.builtin.file": {
                    "path": f"{{{{ fc_apply.stdout | regex_search({KEPT_WHEEL_DIR}) }}}}",
                    "state": "absent"},
                "changed_when": False,
            })
    return {"name": f"step {exp.step_names.index(step) + 1}/{len(exp.step_names)} {step}",
            "when": f"{_jinja_literal(step)} in fleetcuda_steps", "block": tasks}


def _play(exp: Export, mode: str) -> list[dict[str, Any]]:
    play: dict[str, Any] = {
        "name": f"fleetcuda recipe {exp.recipe.name}: " + ("converge" if mode == "converge" else "verify (read-only)"),
        "hosts": "fleetcuda_targets",
        "gather_facts": False,
        "any_errors_fatal": False,
    }
    if exp.secret_names:
        # Skipped for a variable already given (-e @secrets.yml with vault, an AWX survey or credential).
        play["vars_prompt"] = [{"name": SECRET_PREFIX + n, "prompt": f"{n} (secret)", "private": True,
                                "unsafe": True} for n in exp.secret_names]
    play["tasks"] = [_step_block(exp, step, mode) for step in exp.step_names]
    if exp.secret_names:
        # fleetcuda refuses such a value wherever it would go (templating.check_value); a secret is known here
        # only at run time. The condition names the variables, never their values.
        # And a NUL, which fleetcuda refuses in any value: on stdin it would end the secret early (`read -d ''`)
        # and hand the rest to the next variable read there.
        play["vars"] = {"fleetcuda_refused_value": "(?s)" + SHELL_EXPANSION.pattern + r"|\x00"}
        play["tasks"].insert(0, {
            "name": "secrets: none that bash would run as a subscript",
            "ansible.builtin.assert": {
                "that": [f"{SECRET_PREFIX}{n} is not search(fleetcuda_refused_value)" for n in exp.secret_names],
                "fail_msg": "a secret holds a NUL, or a [ followed by $ or a backtick: refused, as fleetcuda "
                            "refuses it (bash expands it wherever it reads the value as a number or a variable's name)",
                "quiet": True},
        })
    if mode == "verify":
        play["tasks"].insert(0, {"name": "no drift seen yet", "ansible.builtin.set_fact": {"fc_drifted": []}})
        play["tasks"].append({"name": "drifted steps", "when": "fc_drifted | length > 0",
                              "ansible.builtin.fail": {"msg": "drift: {{ fc_drifted | join(', ') }}"}})
    return [play]


def _inventory(exp: Export) -> dict[str, Any]:
    hosts = {h.name: {**h.connection, "fleetcuda_target": h.target.id} for h in exp.hosts}
    return {"all": {"children": {"fleetcuda_targets": {"hosts": hosts}}}}


def _host_vars(h: HostExport) -> dict[str, Any]:
    return {
        # The variables as fleetcuda resolved them for this target (recipe < inventory < groups < host <
        # container < --var), secrets left out; the commands below already hold them.
        "fleetcuda_vars": UnsafeMap({k: Unsafe(v) for k, v in sorted(h.public_vars.items())}),
        "fleetcuda_steps": h.steps,
    }


ANSIBLE_CFG = """\
# Written by fleetcuda export ansible.
[defaults]
inventory = inventory.yml
gathering = explicit
host_key_checking = True
retry_files_enabled = False
interpreter_python = auto_silent
forks = 8

[paramiko_connection]
# No terminal: a step's `timeout` runs it in a process group of its own, which a terminal would stop
# (SIGTTOU) as soon as apt or dpkg touched it; fleetcuda gives steps none either.
pty = False
# Host keys are checked, never added: an unknown key fails the host (record it with fleetcuda trust).
record_host_keys = False
"""


def _readme(exp: Export, recipe_path: str, inventory_path: str) -> str:
    secrets = "\n".join(f"- `{SECRET_PREFIX}{n}` (fleetcuda variable `{n}`)" for n in exp.secret_names) or "none"
    return f"""# {exp.recipe.name}: exported from fleetcuda {__version__}

Written by `fleetcuda export ansible {recipe_path} -i {inventory_path}`. Every command in it is the exact
argv fleetcuda's planner builds for that target (the part that runs inside the container), carried as
`!unsafe` YAML and run with `ansible.builtin.command` (`argv:`, `expand_argument_vars: false`): no shell and
no Jinja reads it. Re-export after changing the recipe or inventory; do not edit `host_vars/` by hand.

## Needs

- `{ANSIBLE_PACKAGE}` (ansible-core 2.19) with the collection **community.proxmox {COMMUNITY_PROXMOX}** or
  later 1.x (its `proxmox_pct_remote` connection), and `paramiko` on the control machine:
  `python3 -m venv venv && venv/bin/pip install {ANSIBLE_PACKAGE} paramiko`
- `/usr/bin/python3` inside each container (Ansible's modules run there).
- The Proxmox hosts' keys in `~/.ssh/known_hosts` of the user running ansible-playbook:
  `proxmox_pct_remote` reads host keys only from there (and `/etc/ssh/ssh_known_hosts`), never from
  fleetcuda's known_hosts files. `known_hosts` in this directory is a copy of the inventory's, made at export
  time: append it (`cat known_hosts >> ~/.ssh/known_hosts`) or run with `HOME` set to a directory whose
  `.ssh/known_hosts` it is. Host key checking stays on and unknown keys are never added.

## Run

```sh
ansible-playbook -i inventory.yml site.yml            # converge: per step check -> apply -> verify
ansible-playbook -i inventory.yml site.yml --check    # only the read-only checks; `changed` = would change
ansible-playbook -i inventory.yml verify.yml          # read-only, for schedules: a drifted step fails its host
ansible-playbook -i inventory.yml site.yml --limit lab-a-200
```

As in fleetcuda: a step's check decides whether its apply runs, `changed` counts only applies that ran, the
verify after an apply must pass, and a failed step stops that host only (the others go on; the exit status
is then 2). A second run of a converged fleet reports `changed=0`. Each command starts bash with `env -i`
and the environment fleetcuda gives it; nothing of the host's or Ansible's environment reaches it.

## Secrets

Prompted (`vars_prompt`, private) unless already given, never written here, passed on the command's
stdin (never its argv), with `no_log` on every task that carries one:
{secrets}

Non-interactively (AWX: a survey or a credential's extra vars; or a vaulted file):
`ansible-vault create secrets.yml` then `ansible-playbook -i inventory.yml site.yml -e @secrets.yml --ask-vault-pass`.
Tag each value there `!unsafe` (`fleetcuda_secret_hf_token: !unsafe 'the value'`): Ansible templates a value
from a vars file, so a secret holding `{{{{` or `{{%` would otherwise be evaluated, not sent as it is.

## Not carried over

- **Build once, install everywhere**: each target builds its own wheels (fleetcuda builds once per ABI
  fingerprint and installs that wheel on the others); the build record is still written, so fleetcuda's
  stale-build check works on these targets.
- **fleetcuda's history, logs, reports and per-target apply lock**, the batching of checks into one round
  trip, exponential back-off of retries (a fixed delay here), and Ctrl-C's stop of remote steps.
- **`auto` facts**: the export refuses them; the values were given with `--var` or in the inventory
  (`host_vars/*.yml` `fleetcuda_vars` shows them as resolved).
- **Jump hosts** and a `pct` other than `/usr/sbin/pct`: refused at export.
- **A closed stdin**: fleetcuda closes a command's stdin; `proxmox_pct_remote` leaves it open and empty (no
  terminal: `pty = False` in ansible.cfg, since a terminal would stop apt and dpkg in `timeout`'s process group).
"""


def render_project(recipe: Recipe, inventory: Inventory, targets: list[Target], overrides: Mapping[str, str],
                   recipe_path: str, inventory_path: str) -> dict[str, str]:
    """{relative path: file text} of the exported project."""
    exp = build_export(recipe, targets, overrides)
    # Paths as JSON strings (ASCII, escaped): a newline in a file name must not end the comment and start YAML.
    recipe_path, inventory_path = json.dumps(str(recipe_path)), json.dumps(str(inventory_path))
    head = f"# Written by fleetcuda {__version__} export ansible from {recipe_path} and {inventory_path}.\n"
    files = {
        "ansible.cfg": ANSIBLE_CFG,
        "inventory.yml": dump(_inventory(exp), head),
        "site.yml": dump(_play(exp, "converge"), head + "# Converge: per step check -> apply -> verify.\n"),
        "verify.yml": dump(_play(exp, "verify"), head + "# Read-only: every step's verification (drift fails).\n"),
        "README.md": _readme(exp, recipe_path, inventory_path),
        MARKER: f"fleetcuda {__version__} export ansible {recipe.name}\n",
        "known_hosts": _known_hosts(exp),
    }
    for h in exp.hosts:
        files[f"host_vars/{h.name}.yml"] = dump(_host_vars(h), head + f"# {h.target.id}: do not edit, re-export.\n")
    return files


def _known_hosts(exp: Export) -> str:
    paths = sorted({h.target.spec.known_hosts for h in exp.hosts if h.target.spec.known_hosts})
    out = []
    for p in paths:
        try:
            out.append(Path(p).expanduser().read_text())
        except OSError:
            out.append(f"# {p} could not be read at export time\n")
    return "".join(out)
