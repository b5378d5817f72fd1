#!/usr/bin/env python3
"""fleetcuda's speed, side by side with the OpenSSH floor and with Ansible, on the lab's benchmark fleets.

    sudo .venv/bin/python benchmarks/run.py --sizes 2x4,4x16 --repeats 3

Run it with the Python of fleetcuda's environment (it imports fleetcuda's planner and runs the
`fleetcuda` next to that interpreter), as root (it brings lab topologies up and down with
tests/lab/labctl.py). For each size (HOSTSxCONTAINERS; 2x4 and 4x16 are labctl's `bench-2x4` and
`bench-4x16`), it:

1. brings the topology up, writes a fleetcuda inventory with inventories/lab.yaml's vars, and
   converges every container with `fleetcuda apply` (not timed), then checks `verify` passes;
2. generates the contenders (under benchmarks/work/SIZE/, all readable and runnable by hand):
   - floor-least: the least work that answers verify's questions: bash + OpenSSH, one ssh process per
     host, one plain `bash -c` per container running the read-only checks' own scripts one after
     another (each in a subshell with its own variables), all containers at once; no wrapper per
     check, no framing, no lock, no report. The ratio that counts.
   - fleetcuda-verify: `fleetcuda verify RECIPE -i INV --plain`
   - fleetcuda-apply:  `fleetcuda apply RECIPE -i INV --plain` (the converged fleet: a no-op)
   - floor-mux (this and the two below measure the control side only): bash + OpenSSH, one
     ControlMaster connection per host, one session per container, each running the exact batched
     `pct exec` that fleetcuda sends (planner.batch_command), all
     containers at once; floor-mux-8: the same, at most 8 at once (fleetcuda's default --forks)
   - floor-1proc: bash + OpenSSH, one ssh process per host whose remote shell starts all of that
     host's batched `pct exec` commands at once
   - ansible: ansible-playbook, community.proxmox.proxmox_pct_remote connection, forks 8, one
     `ansible.builtin.command` task per check with the exact per-step argv fleetcuda runs inside
     the container (planner verify probes), host keys checked against the lab's known_hosts;
3. runs one warm-up round (not timed: it primes page caches and .pyc files and samples the process
   tree's memory; Ansible's covers the first 8 containers only), then REPEATS timed rounds,
   round-robin, with the order rotated every round. Each timed run is a fresh process under
   /usr/bin/time -v (wall time measured here; peak RSS from the kernel's rusage); the SSH logins it
   caused are counted in the sshds' logs. Before each run the harness waits (up to --quiet-wait s)
   until the machine is quiet, and records how busy it was. Everything it runs, locally and on the
   lab hosts, gets a higher CPU weight than other work on the machine (CpuPriority);
4. checks every run did the work (exit 0, every check of every container passed, nothing changed),
   brings the topology down (unless --keep-up), and writes benchmarks/results/DATE.json and a
   Markdown summary on stdout.

Only the lab's addresses (10.250.0.0/16, network namespaces on this machine) are contacted.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BENCH = REPO / "benchmarks"
WORK = BENCH / "work"
RESULTS = BENCH / "results"
LABCTL = REPO / "tests" / "lab" / "labctl.py"
ANSIBLE_VENV = BENCH / ".venv-ansible"
# ansible 12.3.0 bundles ansible-core 2.19.14 and community.proxmox 1.4.0 (proxmox_pct_remote); the
# plugin needs paramiko, which the ansible package does not pull in.
ANSIBLE_PINS = ["ansible==12.3.0", "paramiko==5.1.0"]
FLEETCUDA = Path(sys.executable).parent / "fleetcuda"
FLOORS = ["floor-least", "floor-mux", "floor-mux-8", "floor-1proc"]
TOOLS = ["fleetcuda-verify", "fleetcuda-apply", *FLOORS, "ansible"]
FORKS = 8  # fleetcuda's default --forks, and Ansible's forks here
ANSIBLE_WARMUP_LIMIT = 8

sys.path.insert(0, str(REPO / "tests" / "lab"))
import labctl  # noqa: E402  (the topologies: hosts, users, addresses, vmids)

from fleetcuda.plan.command import SshHop, join, ssh_argv, target_argv  # noqa: E402
from fleetcuda.plan.inventory import load_inventory  # noqa: E402
from fleetcuda.plan.planner import base_values, batch_command, make_plan, parse_batch, pending_facts  # noqa: E402
from fleetcuda.plan.recipe import load_recipe  # noqa: E402


def log(msg: str) -> None:
    print(f"bench: {msg}", file=sys.stderr, flush=True)


def sh(*argv: str | Path, check: bool = True, **kw) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([str(a) for a in argv], text=True, capture_output=True, **kw)
    if check and proc.returncode != 0:
        raise SystemExit(f"bench: {' '.join(map(str, argv))} failed ({proc.returncode}):\n{proc.stdout}{proc.stderr}")
    return proc


# -- the machine -----------------------------------------------------------------------------------


def machine() -> dict:
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), platform.processor())
    mem_kb = int(next(ln.split()[1] for ln in Path("/proc/meminfo").read_text().splitlines()
                      if ln.startswith("MemTotal:")))
    return {"nproc": os.cpu_count(), "ram_gib": round(mem_kb / 2**20, 1), "cpu": cpu,
            "kernel": platform.release(), "os": _os_release(), "python": platform.python_version(),
            "openssh": sh("ssh", "-V", check=False).stderr.strip()}


def _os_release() -> str:
    for ln in Path("/etc/os-release").read_text().splitlines():
        if ln.startswith("PRETTY_NAME="):
            return ln.split("=", 1)[1].strip('"')
    return "?"


def _cpu_times() -> tuple[int, int]:
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]
    return sum(fields) - idle, sum(fields)


def busy_fraction(seconds: float = 0.3) -> float:
    """How busy the whole machine is while this harness runs nothing: 0.0 idle, 1.0 every core busy."""
    b0, t0 = _cpu_times()
    time.sleep(seconds)
    b1, t1 = _cpu_times()
    return (b1 - b0) / max(1, t1 - t0)


def wait_quiet(limit: float, threshold: float) -> float:
    """Wait until other work (another engineer's test run, say) leaves the cores alone; return the last reading."""
    deadline = time.monotonic() + limit
    while True:
        busy = busy_fraction()
        if busy <= threshold or time.monotonic() >= deadline:
            return busy
        time.sleep(1.0)


# -- the fleet -------------------------------------------------------------------------------------


class Size:
    def __init__(self, spec: str):
        self.spec = spec
        self.topology = f"bench-{spec}"
        if self.topology not in labctl.TOPOLOGIES:
            raise SystemExit(f"bench: no lab topology {self.topology!r}; labctl has {', '.join(labctl.TOPOLOGIES)}")
        self.hosts = labctl.TOPOLOGIES[self.topology]
        self.known_hosts, _ = labctl.topology_files(self.topology)
        self.dir = WORK / spec
        self.inventory = self.dir / "inventory.yaml"
        self.containers = sum(len(h.running) for h in self.hosts)


def write_inventory(size: Size) -> None:
    """A fleetcuda inventory of the topology, with inventories/lab.yaml's vars (only vars differ from a real fleet)."""
    import yaml  # fleetcuda's dependency

    lab = yaml.safe_load((REPO / "inventories" / "lab.yaml").read_text())
    # Facts pinned (the lab image's Python is 3.11): the floors answer the same questions without reading them.
    # The bench topologies have no driver stand-ins (labctl puts them in the default lab only): no GPU check.
    inv: dict = {"vars": {**lab["vars"], "python_xy": "3.11", "check_gpu": False}, "groups": {
        "zsh-login": {"members": [h.name for h in size.hosts if h.users[0].uid0]},
        "sudo-hosts": {"members": [h.name for h in size.hosts if h.users[0].sudo]},
    }, "hosts": {}}
    for h in size.hosts:
        user = h.users[0]
        inv["hosts"][h.name] = {
            "address": h.address, "user": user.name, "sudo": bool(user.sudo),
            "identity_file": str(labctl.IDENTITY), "known_hosts": str(size.known_hosts),
            "containers": {vmid: {"name": f"ct{vmid}", "venv": "/root/venv"} for vmid in h.running},
        }
    size.dir.mkdir(parents=True, exist_ok=True)
    size.inventory.write_text(f"# generated by benchmarks/run.py for lab topology {size.topology}\n"
                              + yaml.safe_dump(inv, sort_keys=False))


class Plans:
    """What fleetcuda sends: per target, the batched verify command, and the per-step argv inside the target."""

    def __init__(self, size: Size, recipe_path: str):
        recipe = load_recipe(recipe_path)
        inventory = load_inventory(str(size.inventory))
        self.targets = inventory.select(None)
        self.batch: dict[str, str] = {}  # target id -> exact string for the SSH exec channel
        self.feed: dict[str, str] = {}  # target id -> shell words that write the batch's stdin (its nonce)
        self.nonce: dict[str, str] = {}
        self.least: dict[str, str] = {}  # target id -> the checks' own commands, one plain shell (floor-least)
        self.hop: dict[str, SshHop] = {}  # host -> its hop
        self.sudo: dict[str, bool] = {}  # host -> pct through sudo -n
        self.pct: dict[str, str] = {}  # host -> its pct
        self.vmid: dict[str, int] = {}
        self.steps: list[str] = []
        self.argv: dict[str, list[list[str]]] = {}  # target id -> per-step argv inside the container
        for t in self.targets:
            values = base_values(recipe, t, {})
            if pending_facts(recipe, values):
                raise SystemExit(f"bench: {t.id} has `auto` variables {pending_facts(recipe, values)}: "
                                 "the generated inventory must set them (as inventories/lab.yaml does)")
            plan = make_plan(recipe, t, values)
            verify = [(s.index, s.verify_probe) for s in plan.steps if not s.skipped and s.verify_probe]
            check = [(s.index, s.pre_probe) for s in plan.steps if not s.skipped and s.pre_probe]
            cmd = batch_command(plan, verify)
            if batch_command(plan, check).remote != cmd.remote:
                log(f"note: {t.id}: apply's batched checks differ from verify's; the floor uses verify's")
            assert cmd.remote is not None and t.chain.ssh is not None and t.container is not None
            self.batch[t.id] = cmd.remote
            # The batch reads its nonce (and any secret) from stdin, NUL-separated, as fleetcuda writes it.
            self.feed[t.id] = "printf '%s\\0' " + " ".join(shlex.quote(w) for w in cmd.stdin.split("\0")[:-1])
            self.nonce[t.id] = plan.nonce
            self.least[t.id] = least_work_script(verify)
            self.hop[t.host] = t.chain.ssh
            self.sudo[t.host] = bool(t.chain.pct and t.chain.pct.sudo)
            self.pct[t.host] = t.chain.pct.pct if t.chain.pct else "pct"
            self.vmid[t.id] = t.container.vmid
            self.steps = [s.name for s in plan.steps if not s.skipped and s.verify_probe]
            self.argv[t.id] = [target_argv(p) for _, p in verify]
        self.recipe_sha256 = hashlib.sha256(Path(recipe_path).read_bytes()).hexdigest()

    def by_host(self) -> dict[str, list[str]]:
        hosts: dict[str, list[str]] = {}
        for t in self.targets:
            hosts.setdefault(t.host, []).append(t.id)
        return hosts


# -- the contenders --------------------------------------------------------------------------------


def _ssh(hop: SshHop) -> list[str]:
    # The options fleetcuda's dry-run lines use (keys checked against the inventory's known_hosts,
    # BatchMode), no ~/.ssh/config, and the key exchange fleetcuda's paramiko negotiates with these
    # sshds: OpenSSH 9.2's default, sntrup761x25519, costs about 0.1 s more per connection here,
    # which would flatter fleetcuda.
    return ["ssh", "-F", "/dev/null", *ssh_argv(hop)[1:], "-o", "KexAlgorithms=curve25519-sha256"]


def least_work_script(probes: list) -> str:
    """The least work that answers verify's questions: each check's own script, with its own variables and
    environment, in a subshell of one plain bash per container; no per-check env/timeout/bash, no framing
    beyond one marker line per check (which a check could forge: a floor does not defend)."""
    lines = []
    for index, probe in probes:
        body = [f"export {k}={shlex.quote(v)}" for k, v in probe.env.items()]
        body += [f"{k}={shlex.quote(v)}" for k, v in probe.shell_vars.items()]
        lines.append("( " + "; ".join(body) + (";" if body else "") + "\n" + probe.script + "\n) </dev/null 2>&1")
        lines.append(f"echo \"@@least {index} $?\"")
    return "\n".join(lines)


def write_floor_least(size: Size, plans: Plans) -> Path:
    """bash + OpenSSH, the least work: one ssh process per host, whose remote shell starts, for all of the host's
    containers at once, one `[sudo -n] pct exec VMID -- bash -c CHECKS` running the checks' own scripts."""
    def command(host: str, tid: str) -> str:
        pct = ("sudo -n " if plans.sudo[host] else "") + f"{shlex.quote(plans.pct[host])} exec {plans.vmid[tid]} --"
        return f"{pct} /bin/bash -c {shlex.quote(plans.least[tid])}"

    return _write_per_host_floor(size, plans, "floor-least", [
        f"# The least-work floor for {size.topology}, generated by benchmarks/run.py: plain OpenSSH, one ssh",
        "# process per host; its remote /bin/sh reads floor-least.HOST.sh, which starts one plain bash per",
        "# container (all at once) running the read-only checks' own scripts one after another."], command)


def write_floor_mux(size: Size, plans: Plans, parallel: int = 0) -> Path:
    """bash + OpenSSH: one ControlMaster connection per host, one session per container; `parallel`
    sessions at once (0: every container at once)."""
    name = "floor-mux" + (f"-{parallel}" if parallel else "")
    lines = ["#!/bin/bash",
             f"# The floor for {size.topology}, generated by benchmarks/run.py: plain OpenSSH, one ControlMaster",
             "# connection per host, one session per container running the exact batched `pct exec` fleetcuda",
             "# sends (fleetcuda.plan.planner.batch_command), "
             + (f"at most {parallel} containers at once." if parallel else "every container at once."),
             f"# Usage: {name}.sh OUTDIR",
             "set -u", 'out=${1:?output directory}', 'mkdir -p "$out"', "n=0",
             'ctl=$(mktemp -d /tmp/fcbench-ctl.XXXXXX)', "# one connection per host, all hosts at once"]
    hosts = plans.by_host()
    for i, host in enumerate(hosts):
        hop = plans.hop[host]
        lines.append(join([*_ssh(hop), "-o", "ControlMaster=yes", "-o", "ControlPersist=120"]) +
                     f' -o ControlPath="$ctl/{i}" -fN -- ' + shlex.quote(f"{hop.user}@{hop.address}") + " &")
    lines += ["wait", "# one session per container on its host's connection"]
    for i, (host, tids) in enumerate(hosts.items()):
        hop = plans.hop[host]
        for tid in tids:
            out = tid.replace("/", "_")
            lines.append("{ " + join([*_ssh(hop), "-o", "ControlMaster=no"]) + f' -o ControlPath="$ctl/{i}" -- '
                         + shlex.quote(f"{hop.user}@{hop.address}") + " " + shlex.quote(plans.batch[tid])
                         + f' < <({plans.feed[tid]}) >"$out/{out}" 2>&1; echo $? >"$out/{out}.rc"; }} &')
            if parallel:
                lines.append(f"if (( ++n >= {parallel} )); then wait -n; (( n-- )); fi")
    lines += ["wait", "# close the connections"]
    for i, host in enumerate(hosts):
        hop = plans.hop[host]
        lines.append(join(_ssh(hop)) + f' -o ControlPath="$ctl/{i}" -O exit -- '
                     + shlex.quote(f"{hop.user}@{hop.address}") + " 2>/dev/null &")
    lines += ["wait", 'rm -rf "$ctl"', ""]
    path = size.dir / f"{name}.sh"
    path.write_text("\n".join(lines))
    path.chmod(0o755)
    return path


def write_floor_1proc(size: Size, plans: Plans) -> Path:
    """bash + OpenSSH: one ssh process per host, whose remote shell runs all of the host's containers at once."""
    return _write_per_host_floor(size, plans, "floor-1proc", [
        f"# The floor for {size.topology}, generated by benchmarks/run.py: plain OpenSSH, one ssh process (one",
        "# connection) per host; a remote /bin/sh reads floor-1proc.HOST.sh on its stdin, which starts the",
        "# exact batched `pct exec` of each of the host's containers at once, then prints each one's output",
        "# after a marker."], lambda host, tid: f"{plans.feed[tid]} | {plans.batch[tid]}")


def _write_per_host_floor(size: Size, plans: Plans, name: str, about: list[str],
                          command: Callable[[str, str], str]) -> Path:
    """NAME.sh: one ssh process per host, its remote /bin/sh reading NAME.HOST.sh, which runs `command(host,
    target)` for all of the host's containers at once, then prints each one's output after a marker line
    `@@bench-container VMID STATUS`. Usage: NAME.sh OUTDIR"""
    lines = ["#!/bin/bash", *about, f"# Usage: {name}.sh OUTDIR", "set -u", 'out=${1:?output directory}',
             'mkdir -p "$out"']
    for host, tids in plans.by_host().items():
        hop = plans.hop[host]
        # The script goes on stdin, not as the command: 16 batched commands are over Linux's 128 KiB
        # limit for one argument. The commands are quoted for any POSIX login shell, so /bin/sh reads
        # them as the login shell would.
        remote = ["d=$(mktemp -d)"]
        for tid in tids:
            v = plans.vmid[tid]
            # Through a pipe, not straight into a file: lxc-attach (the lab's pct) chowns a file on its
            # stdout to root, 0700, and the SSH user could no longer read it.
            remote.append(f"{{ {command(host, tid)}; echo $? >$d/{v}.rc; }} </dev/null 2>&1 | cat >$d/{v} &")
        remote.append("wait")
        remote.append(f"for v in {' '.join(str(plans.vmid[t]) for t in tids)}; do "
                      "echo \"@@bench-container $v $(cat $d/$v.rc)\"; cat $d/$v; done")
        remote.append("rm -rf $d")
        script = size.dir / f"{name}.{host}.sh"
        script.write_text("\n".join(remote) + "\n")
        lines.append(join(_ssh(hop)) + " -- " + shlex.quote(f"{hop.user}@{hop.address}") + " /bin/sh -s <"
                     + shlex.quote(str(script)) + f' >"$out/{host}" 2>&1 &')
    lines += ["wait", ""]
    path = size.dir / f"{name}.sh"
    path.write_text("\n".join(lines))
    path.chmod(0o755)
    return path


def write_ansible(size: Size, plans: Plans) -> Path:
    d = size.dir / "ansible"
    d.mkdir(parents=True, exist_ok=True)
    home = d / "home"
    (home / ".ssh").mkdir(parents=True, exist_ok=True)
    # proxmox_pct_remote reads host keys only from ~/.ssh/known_hosts (and /etc/ssh/ssh_known_hosts):
    # Ansible runs with HOME here, whose known_hosts is the lab's, and host key checking stays on.
    shutil.copyfile(size.known_hosts, home / ".ssh" / "known_hosts")
    (d / "ansible.cfg").write_text("\n".join([
        "# generated by benchmarks/run.py",
        "[defaults]",
        "inventory = hosts.yml",
        f"forks = {FORKS}",
        "gathering = explicit",
        "host_key_checking = True",
        "retry_files_enabled = False",
        "interpreter_python = /usr/bin/python3",
        "nocolor = True",
        "[paramiko_connection]",
        "record_host_keys = False",
        "",
    ]))
    hosts = []
    for t in plans.targets:
        hop = plans.hop[t.host]
        hosts += [f"    ct{plans.vmid[t.id]}:",
                  f"      ansible_host: {hop.address}",
                  f"      ansible_user: {hop.user}",
                  f"      proxmox_vmid: {plans.vmid[t.id]}"]
    (d / "hosts.yml").write_text("\n".join([
        "# generated by benchmarks/run.py: the lab topology's containers, reached through their host's sshd and pct",
        "all:",
        "  vars:",
        "    ansible_connection: community.proxmox.proxmox_pct_remote",
        f"    ansible_private_key_file: {labctl.IDENTITY}",
        "  hosts:",
        *hosts, ""]))
    # The per-step argv inside the container is the same for every target of these fleets; the
    # playbook carries it literally, marked !unsafe so that Jinja never reads the scripts.
    first = plans.argv[plans.targets[0].id]
    if any(plans.argv[t.id] != first for t in plans.targets):
        raise SystemExit("bench: the per-step commands differ between targets; the playbook cannot hold them literally")
    tasks = []
    for name, argv in zip(plans.steps, first, strict=True):
        # expand_argument_vars: false, or the module expands `$PATH` and such in the argv (its default).
        tasks += [f"    - name: {name}", "      ansible.builtin.command:", "        expand_argument_vars: false",
                  "        argv:"]
        tasks += [f"          - !unsafe {json.dumps(a)}" for a in argv]
        tasks += ["      changed_when: false"]
    (d / "checks.yml").write_text("\n".join([
        "# generated by benchmarks/run.py: fleetcuda's read-only checks (verify probes), one task each",
        "- name: fleetcuda checks",
        "  hosts: all",
        "  gather_facts: false",
        "  tasks:",
        *tasks, ""]))
    return d


def ensure_ansible() -> None:
    if (ANSIBLE_VENV / "bin" / "ansible-playbook").exists() and \
            sh(ANSIBLE_VENV / "bin" / "python", "-c", "import paramiko", check=False).returncode == 0:
        return
    log(f"installing {' '.join(ANSIBLE_PINS)} into {ANSIBLE_VENV} from PyPI (a few minutes)")
    sh("/usr/bin/python3", "-m", "venv", ANSIBLE_VENV)
    sh(ANSIBLE_VENV / "bin" / "pip", "install", "-q", *ANSIBLE_PINS)


def ansible_versions() -> dict:
    py = ANSIBLE_VENV / "bin" / "python"
    out = sh(py, "-c", "import ansible.release, paramiko, json, pathlib, ansible_collections.community.proxmox as c; "
             "m = json.loads((pathlib.Path(c.__path__[0]) / 'MANIFEST.json').read_text()); "
             "print(ansible.release.__version__, m['collection_info']['version'], paramiko.__version__)").stdout.split()
    return {"ansible_core": out[0], "community_proxmox": out[1], "paramiko": out[2]}


def contenders(size: Size, plans: Plans, recipe: str) -> dict[str, dict]:
    env = {"PATH": f"{FLEETCUDA.parent}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
           "HOME": os.environ.get("HOME", "/root"), "LANG": "C.UTF-8",
           "FLEETCUDA_STATE_DIR": str(size.dir / "state"),
           # A checkout other than the installed one (a worktree at a fixed commit) is measured as given.
           **({"PYTHONPATH": os.environ["PYTHONPATH"]} if os.environ.get("PYTHONPATH") else {})}
    adir = write_ansible(size, plans)
    aenv = {"PATH": f"{ANSIBLE_VENV / 'bin'}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "HOME": str(adir / "home"), "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8",
            "ANSIBLE_CONFIG": str(adir / "ansible.cfg")}
    return {
        "fleetcuda-verify": {"argv": [str(FLEETCUDA), "verify", recipe, "-i", str(size.inventory), "--plain"],
                             "env": env, "cwd": REPO},
        "fleetcuda-apply": {"argv": [str(FLEETCUDA), "apply", recipe, "-i", str(size.inventory), "--plain"],
                            "env": env, "cwd": REPO},
        "floor-mux": {"argv": ["/bin/bash", str(write_floor_mux(size, plans)), "OUT"], "env": env, "cwd": REPO},
        f"floor-mux-{FORKS}": {"argv": ["/bin/bash", str(write_floor_mux(size, plans, FORKS)), "OUT"], "env": env,
                               "cwd": REPO},
        "floor-1proc": {"argv": ["/bin/bash", str(write_floor_1proc(size, plans)), "OUT"], "env": env, "cwd": REPO},
        "floor-least": {"argv": ["/bin/bash", str(write_floor_least(size, plans)), "OUT"], "env": env, "cwd": REPO},
        "ansible": {"argv": [str(ANSIBLE_VENV / "bin" / "ansible-playbook"), "checks.yml"], "env": aenv,
                    "cwd": adir},
    }


# -- checking that a run did the work --------------------------------------------------------------

_DONE = re.compile(r"^\S+ (\S+) done: (\S+)$", re.M)
_RECAP = re.compile(r"^(\S+)\s+:\s+ok=(\d+)\s+changed=(\d+)\s+unreachable=(\d+)\s+failed=(\d+)", re.M)


def validate(tool: str, rc: int, output: str, outdir: Path, plans: Plans, limited: bool = False) -> str | None:
    """None when the run did all the work and every check passed; otherwise what went wrong."""
    n, steps = len(plans.targets), len(plans.steps)
    if limited:
        n = min(n, ANSIBLE_WARMUP_LIMIT)
    if rc != 0:
        return f"exit {rc}: {output.strip().splitlines()[-3:] if output.strip() else ''}"
    if tool.startswith("fleetcuda"):
        done = dict(_DONE.findall(output))
        bad = {t: s for t, s in done.items() if s != "ok"}
        if len(done) != n or bad:
            return f"{len(done)}/{n} targets done, not ok: {bad}"
        if tool == "fleetcuda-verify" and output.count(": ok (verified") != n * steps:
            return "not every step verified"
        if tool == "fleetcuda-apply" and output.count(": ok (") != n * steps:
            return "not every step ok (something changed or failed)"
        return None
    if tool.startswith("floor-mux"):
        for t in plans.targets:
            name = t.id.replace("/", "_")
            rcs = (outdir / f"{name}.rc").read_text().strip()
            res = parse_batch((outdir / name).read_text(), plans.nonce[t.id])
            if rcs != "0" or len(res) != steps or any(r.rc for r in res.values()):
                return f"{t.id}: ssh exit {rcs}, {len(res)} results, rcs {[r.rc for r in res.values()]}"
        return None
    if tool in ("floor-1proc", "floor-least"):
        for host, tids in plans.by_host().items():
            text = (outdir / host).read_text()
            chunks = re.split(r"^@@bench-container (\d+) (\d+)\n", text, flags=re.M)
            got = {int(chunks[i]): (chunks[i + 1], chunks[i + 2]) for i in range(1, len(chunks) - 2, 3)}
            for tid in tids:
                rcs, body = got.get(plans.vmid[tid], ("?", ""))
                if tool == "floor-least":
                    rcs_least = re.findall(r"^@@least \d+ (\d+)$", body, re.M)
                    if rcs != "0" or len(rcs_least) != steps or any(r != "0" for r in rcs_least):
                        return f"{tid}: pct exit {rcs}, check exits {rcs_least}"
                    continue
                res = parse_batch(body, plans.nonce[tid])
                if rcs != "0" or len(res) != steps or any(r.rc for r in res.values()):
                    return f"{tid}: pct exit {rcs}, {len(res)} results, rcs {[r.rc for r in res.values()]}"
        return None
    if tool == "ansible":
        recap = _RECAP.findall(output)
        good = [h for h, ok, _ch, un, fa in recap if int(ok) == steps and un == "0" and fa == "0"]
        return None if len(recap) == n and len(good) == n else f"recap: {recap}"
    raise AssertionError(tool)


# -- measuring -------------------------------------------------------------------------------------


def _tree(root: int) -> list[int]:
    pids, i = [root], 0
    while i < len(pids):
        p = pids[i]
        i += 1
        try:
            for tid in os.listdir(f"/proc/{p}/task"):
                pids += [int(x) for x in Path(f"/proc/{p}/task/{tid}/children").read_text().split()]
        except OSError:
            pass
    return pids


def _pss_rss_kb(pid: int) -> tuple[int, int]:
    try:
        text = Path(f"/proc/{pid}/smaps_rollup").read_text()
    except OSError:
        return 0, 0
    pss = re.search(r"^Pss:\s+(\d+)", text, re.M)
    rss = re.search(r"^Rss:\s+(\d+)", text, re.M)
    return (int(pss.group(1)) if pss else 0), (int(rss.group(1)) if rss else 0)


class TreeSampler(threading.Thread):
    """Peak of the summed PSS (and RSS) of a process tree, sampled every 50 ms (warm-up runs only)."""

    def __init__(self, root: int):
        super().__init__(daemon=True)
        self.root, self.stop = root, threading.Event()
        self.peak_pss = self.peak_rss = self.peak_procs = 0

    def run(self) -> None:
        while not self.stop.is_set():
            pids = _tree(self.root)[1:]  # not /usr/bin/time itself
            vals = [_pss_rss_kb(p) for p in pids]
            self.peak_pss = max(self.peak_pss, sum(v[0] for v in vals))
            self.peak_rss = max(self.peak_rss, sum(v[1] for v in vals))
            self.peak_procs = max(self.peak_procs, len(pids))
            self.stop.wait(0.05)


CPU_CGROUP = Path("/sys/fs/cgroup/cpu")  # cgroup v1's cpu controller, as on these machines


class CpuPriority:
    """Other engineers' test runs share this machine's 2 cores. Everything the benchmark runs (the
    contenders, each bench host's sshd and so every session, sudo and pct it starts, and each bench
    container's LXC cgroup, where lxc-attach puts the checks) gets the same, higher CPU weight:
    cgroup v1 cpu.shares (default 1024; autogroups of other sessions weigh 1024 each) and nice. The
    same for every contender, so comparisons stay fair; it only keeps unrelated work from stealing time."""

    def __init__(self, shares: int, nice: int):
        self.shares, self.nice = shares, nice
        self.group = CPU_CGROUP / "fcbench" if shares and (CPU_CGROUP / "cpu.shares").exists() else None
        if self.group:
            self.group.mkdir(exist_ok=True)
            (self.group / "cpu.shares").write_text(str(shares))
            (self.group / "cgroup.procs").write_text(str(os.getpid()))
        os.setpriority(os.PRIO_PROCESS, 0, nice)

    def describe(self) -> dict:
        return {"cgroup": str(self.group) if self.group else None, "cpu_shares": self.shares if self.group else None,
                "nice": self.nice}

    def topology(self, size: Size) -> None:
        for h in size.hosts:
            pid = labctl.sshd_pid(h)
            if pid:
                os.setpriority(os.PRIO_PROCESS, pid, self.nice)
                if self.group:
                    (self.group / "cgroup.procs").write_text(str(pid))
            for vmid in h.running:
                payload = CPU_CGROUP / f"lxc.payload.{vmid}" / "cpu.shares"
                if self.group and payload.exists():
                    payload.write_text(str(self.shares))

    def close(self) -> None:
        if self.group:
            (CPU_CGROUP / "cgroup.procs").write_text(str(os.getpid()))
            try:
                self.group.rmdir()
            except OSError as exc:  # something of ours still runs in it; harmless, reported
                log(f"note: could not remove {self.group}: {exc}")


def sshd_logins(size: Size) -> int:
    total = 0
    for h in size.hosts:
        try:
            total += (h.dir / "sshd.log").read_text(errors="replace").count("Accepted publickey")
        except FileNotFoundError:
            pass
    return total


def measure(size: Size, plans: Plans, tool: str, spec: dict, tag: str, *, warmup: bool,
            quiet_wait: float, quiet_threshold: float, extra: tuple[str, ...] = ()) -> dict:
    rundir = size.dir / "runs" / tag
    shutil.rmtree(rundir, ignore_errors=True)
    rundir.mkdir(parents=True)
    outdir = rundir / "out"
    argv = [str(outdir) if a == "OUT" else a for a in spec["argv"]] + list(extra)
    busy = wait_quiet(quiet_wait, quiet_threshold)
    logins = sshd_logins(size)
    timefile = rundir / "time.txt"
    busy0, _ = _cpu_times()
    t0 = time.monotonic()
    with open(rundir / "output.txt", "w") as fh:
        proc = subprocess.Popen(["/usr/bin/time", "-v", "-o", str(timefile), *argv], stdout=fh,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=spec["env"], cwd=spec["cwd"],
                                start_new_session=True)
        sampler = TreeSampler(proc.pid) if warmup else None
        if sampler:
            sampler.start()
        try:
            rc = proc.wait()
        except BaseException:  # interrupted: end the whole run we started, then let the topology come down
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait()
            raise
    wall = time.monotonic() - t0
    busy1, _ = _cpu_times()
    if sampler:
        sampler.stop.set()
        sampler.join()
    tv = timefile.read_text()

    def field(name: str) -> float:
        m = re.search(rf"^\s*{re.escape(name)}: (\S+)", tv, re.M)
        return float(m.group(1)) if m else float("nan")

    time.sleep(0.2)  # sshd writes its log line as the session ends
    res = {"tool": tool, "wall_s": round(wall, 4), "rc": rc, "busy_before": round(busy, 3),
           "max_rss_mb": round(field("Maximum resident set size (kbytes)") / 1024, 1),
           "cpu_user_s": field("User time (seconds)"), "cpu_sys_s": field("System time (seconds)"),
           # every core's busy time during the run: the control side plus sshd, pct, lxc-attach and the
           # checks themselves (all on this machine), plus whatever else ran meanwhile
           "machine_cpu_s": round((busy1 - busy0) / os.sysconf("SC_CLK_TCK"), 2),
           "ssh_logins": sshd_logins(size) - logins,
           "error": validate(tool, rc, (rundir / "output.txt").read_text(errors="replace"), outdir, plans,
                             limited=bool(extra))}
    if extra:
        res["argv_extra"] = list(extra)
    if warmup:
        res.update({"tree_peak_pss_mb": round(sampler.peak_pss / 1024, 1),
                    "tree_peak_rss_mb": round(sampler.peak_rss / 1024, 1), "tree_peak_procs": sampler.peak_procs})
    return res


# -- the run ---------------------------------------------------------------------------------------


def converge(size: Size, recipe: str, env: dict) -> dict:
    t0 = time.monotonic()
    log(f"{size.spec}: converging {size.containers} containers with fleetcuda apply (not timed)")
    apply = subprocess.run([str(FLEETCUDA), "apply", recipe, "-i", str(size.inventory), "--plain"], env=env,
                           cwd=REPO, capture_output=True, text=True)
    if apply.returncode != 0:
        raise SystemExit(f"bench: converging {size.spec} failed ({apply.returncode}):\n{apply.stdout[-4000:]}")
    verify = subprocess.run([str(FLEETCUDA), "verify", recipe, "-i", str(size.inventory), "--plain"], env=env,
                            cwd=REPO, capture_output=True, text=True)
    if verify.returncode != 0:
        raise SystemExit(f"bench: {size.spec} does not verify after apply:\n{verify.stdout[-4000:]}")
    changed = len(re.findall(r": changed \(", apply.stdout))
    return {"converge_s": round(time.monotonic() - t0, 1), "steps_changed_by_converge": changed}


def bench_size(size: Size, args: argparse.Namespace) -> dict:
    log(f"{size.spec}: bringing up lab topology {size.topology}")
    sh(sys.executable, LABCTL, "up", "--topology", size.topology)
    write_inventory(size)
    plans = Plans(size, args.recipe)
    specs = contenders(size, plans, args.recipe)
    info = {"size": size.spec, "hosts": len(size.hosts), "containers": size.containers,
            "checks_per_container": len(plans.steps), "steps": plans.steps,
            "inventory": str(size.inventory.relative_to(REPO)), "recipe_sha256": plans.recipe_sha256}
    info.update(converge(size, args.recipe, specs["fleetcuda-verify"]["env"]))
    tools = [t for t in TOOLS if t in args.tools]
    measurements, warm = [], {}
    q = {"quiet_wait": args.quiet_wait, "quiet_threshold": args.quiet_threshold}
    args.priority.topology(size)
    log(f"{size.spec}: warm-up round (memory sampling, connection counts)")
    for tool in tools:
        # Ansible's warm-up covers the first 8 containers only: a full run of it costs minutes at 4x16.
        extra = ("--limit", ",".join(f"ct{plans.vmid[t.id]}" for t in plans.targets[:ANSIBLE_WARMUP_LIMIT])) \
            if tool == "ansible" and len(plans.targets) > ANSIBLE_WARMUP_LIMIT else ()
        r = measure(size, plans, tool, specs[tool], f"warmup-{tool}", warmup=True, extra=extra, **q)
        warm[tool] = r
        log(f"  warm-up {tool:17s} {r['wall_s']:7.2f}s logins={r['ssh_logins']}"
            f"{'  ERROR ' + r['error'] if r['error'] else ''}")
        if r["error"]:
            raise SystemExit(f"bench: {tool} did not do the work on {size.spec}: {r['error']} "
                             f"(see {size.dir / 'runs' / f'warmup-{tool}'})")
    info["repeats"] = args.repeats_of[size.spec]
    for rnd in range(info["repeats"]):
        order = tools[rnd % len(tools):] + tools[:rnd % len(tools)]
        for tool in order:
            r = measure(size, plans, tool, specs[tool], f"r{rnd}-{tool}", warmup=False, **q)
            r["round"] = rnd
            measurements.append(r)
            log(f"  round {rnd} {tool:17s} {r['wall_s']:7.2f}s rss={r['max_rss_mb']}MB logins={r['ssh_logins']} "
                f"busy_before={r['busy_before']}"
                f"{'  ERROR ' + r['error'] if r['error'] else ''}")
    info["warmup"] = warm
    info["runs"] = measurements
    info["summary"] = summarize(tools, measurements)
    return info


def summarize(tools: list[str], runs: list[dict]) -> dict:
    out: dict = {}
    for tool in tools:
        good = [r for r in runs if r["tool"] == tool and not r["error"]]
        walls = [r["wall_s"] for r in good]
        out[tool] = {"n": len(walls), "failed_runs": sum(1 for r in runs if r["tool"] == tool and r["error"]),
                     "median_s": round(statistics.median(walls), 3) if walls else None,
                     "min_s": min(walls) if walls else None, "max_s": max(walls) if walls else None,
                     "max_rss_mb_median": statistics.median([r["max_rss_mb"] for r in good]) if good else None,
                     "cpu_s_median": round(statistics.median([r["cpu_user_s"] + r["cpu_sys_s"] for r in good]), 2)
                     if good else None,
                     "machine_cpu_s_median": round(statistics.median([r["machine_cpu_s"] for r in good]), 2)
                     if good else None,
                     "ssh_logins_median": statistics.median([r["ssh_logins"] for r in good]) if good else None}
    med = {t: out[t]["median_s"] for t in tools}
    floors = [t for t in FLOORS if med.get(t)]
    if floors:
        # The floor is the fastest plain-OpenSSH way measured, by median.
        out["floor_is"] = min(floors, key=lambda t: med[t])
        out["floor_s"] = med[out["floor_is"]]
        for t in ("fleetcuda-verify", "fleetcuda-apply"):
            if med.get(t):
                out[f"{t}/floor"] = round(med[t] / out["floor_s"], 2)
    if med.get("ansible") and med.get("fleetcuda-verify"):
        out["ansible/fleetcuda-verify"] = round(med["ansible"] / med["fleetcuda-verify"], 1)
    return out


def targets(sizes: dict[str, dict]) -> dict:
    """The issue's targets, judged on medians."""
    out = {}
    for spec, s in sizes.items():
        sm = s["summary"]
        if "fleetcuda-verify/floor" in sm:
            out[f"{spec}: verify within 1.5x of the floor"] = {"value": sm["fleetcuda-verify/floor"],
                                                              "met": sm["fleetcuda-verify/floor"] <= 1.5}
        if "fleetcuda-apply/floor" in sm:
            out[f"{spec}: no-op apply within 2x of the floor"] = {"value": sm["fleetcuda-apply/floor"],
                                                                "met": sm["fleetcuda-apply/floor"] <= 2.0}
    if "2x4" in sizes and "4x16" in sizes:
        for tool in TOOLS:
            a = sizes["2x4"]["summary"].get(tool, {}).get("median_s")
            b = sizes["4x16"]["summary"].get(tool, {}).get("median_s")
            if a and b:
                entry = {"value": round(b / a, 2)}
                if tool.startswith("fleetcuda"):
                    entry["met"] = b / a < 4.0
                out[f"{tool}: 64 containers / 8 containers time"] = entry
    return out


def markdown(result: dict) -> str:
    lines = []
    for spec, s in result["sizes"].items():
        sm = s["summary"]
        lines += [f"### {spec}: {s['hosts']} hosts x {s['containers'] // s['hosts']} containers "
                  f"({s['containers']} containers, {s['checks_per_container']} checks each)", "",
                  "| contender | median s | min-max s | runs | peak RSS MB (largest process) | tree peak PSS MB "
                  "(warm-up) | control CPU s | machine CPU s | SSH logins |",
                  "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for tool in result["tools"]:
            t = sm.get(tool)
            if not t or t["median_s"] is None:
                continue
            w = s["warmup"].get(tool, {})
            lines.append(f"| {tool} | {t['median_s']:.2f} | {t['min_s']:.2f}-{t['max_s']:.2f} | {t['n']} | "
                         f"{t['max_rss_mb_median']:.0f} | {w.get('tree_peak_pss_mb', 0):.0f} | "
                         f"{t['cpu_s_median']:.2f} | {t['machine_cpu_s_median']:.2f} | {t['ssh_logins_median']:.0f} |")
        lines.append("")
        ratios = {k: v for k, v in sm.items() if "/" in k or k.startswith("floor_")}
        lines.append("ratios: " + ", ".join(f"{k} = {v}" for k, v in ratios.items()))
        lines.append("")
    lines += ["### targets", ""]
    for name, t in result["targets"].items():
        met = "" if "met" not in t else (" **met**" if t["met"] else " **NOT met**")
        lines.append(f"- {name}: {t['value']}{met}")
    return "\n".join(lines) + "\n"


def fleetcuda_tree_sha256() -> str:
    h = hashlib.sha256()
    for p in sorted((REPO / "fleetcuda").rglob("*.py")):
        h.update(p.relative_to(REPO).as_posix().encode() + b"\0" + p.read_bytes())
    return h.hexdigest()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="2x4,4x16", help="comma-separated HOSTSxCONTAINERS (labctl bench-* topologies)")
    ap.add_argument("--repeats", default="3",
                    help="timed rounds: N for every size, or per size like 2x4=5,4x16=3 (default 3)")
    ap.add_argument("--tools", default=",".join(TOOLS), help=f"comma-separated subset of {','.join(TOOLS)}")
    ap.add_argument("--recipe", default="recipes/gdn-fastpath.yaml")
    ap.add_argument("--quiet-wait", type=float, default=10.0,
                    help="before each run, wait up to this long for the machine to be quiet (default 10 s)")
    ap.add_argument("--quiet-threshold", type=float, default=0.15,
                    help="'quiet': at most this fraction of all cores busy (default 0.15)")
    ap.add_argument("--nice", type=int, default=-10,
                    help="nice of the harness, every contender and the benchmark hosts' sshds (default -10)")
    ap.add_argument("--cpu-shares", type=int, default=10240,
                    help="cgroup v1 cpu.shares of all the benchmark's work, local and remote (default 10240, ten "
                         "times any other session's; 0 = no cgroup)")
    ap.add_argument("--keep-up", action="store_true", help="leave the benchmark topologies up")
    ap.add_argument("--output", help="JSON file (default benchmarks/results/DATE.json)")
    args = ap.parse_args()
    args.tools = [t for t in args.tools.split(",") if t]
    try:
        per_size = dict(item.split("=") for item in args.repeats.split(",")) if "=" in args.repeats else {}
        args.repeats_of = {s: int(per_size.get(s, 3 if per_size else args.repeats)) for s in args.sizes.split(",") if s}
    except ValueError:
        ap.error(f"--repeats: expected N or SIZE=N,...; got {args.repeats!r}")
    if unknown := set(args.tools) - set(TOOLS):
        ap.error(f"unknown tools {sorted(unknown)}")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so that `finally` brings topologies down
    if os.geteuid() != 0:
        raise SystemExit("bench: needs root (it brings lab topologies up and down with tests/lab/labctl.py)")
    if not Path("/usr/bin/time").exists():
        raise SystemExit("bench: needs GNU time at /usr/bin/time (apt-get install time)")
    if not (labctl.BASE / ".fleetcuda-complete").exists():
        raise SystemExit("bench: the lab has never been built; run tests/lab/labctl.py up first")
    if "ansible" in args.tools:
        ensure_ansible()
    args.priority = CpuPriority(args.cpu_shares, args.nice)  # the harness too: it times the runs
    started = datetime.now(UTC)
    fc_sha = fleetcuda_tree_sha256()
    result: dict = {
        "started": started.isoformat(timespec="seconds"), "command": " ".join(["benchmarks/run.py", *sys.argv[1:]]),
        "machine": machine(), "repeats": args.repeats_of, "tools": args.tools, "forks": FORKS, "recipe": args.recipe,
        "cpu_priority": args.priority.describe(), "quiet_wait_s": args.quiet_wait,
        "quiet_threshold": args.quiet_threshold,
        "git_head": sh("git", "-C", REPO, "rev-parse", "HEAD", check=False).stdout.strip(),
        "git_dirty_paths": sh("git", "-C", REPO, "status", "--porcelain", check=False).stdout.splitlines(),
        "fleetcuda_sources_sha256": fc_sha,
        "versions": {"fleetcuda": sh(FLEETCUDA, "--version").stdout.strip(),
                     **(ansible_versions() if "ansible" in args.tools else {})},
        "sizes": {},
    }
    t0 = time.monotonic()
    try:
        for spec in [s for s in args.sizes.split(",") if s]:
            size = Size(spec)
            try:
                result["sizes"][spec] = bench_size(size, args)
            finally:
                if not args.keep_up:
                    sh(sys.executable, LABCTL, "down", "--topology", size.topology, check=False)
    finally:
        args.priority.close()
    result["targets"] = targets(result["sizes"])
    result["total_s"] = round(time.monotonic() - t0, 1)
    if fleetcuda_tree_sha256() != fc_sha:
        result["warning"] = "fleetcuda's sources changed during the run (another engineer's edit): numbers mix versions"
        log(result["warning"])
    out = Path(args.output) if args.output else RESULTS / f"{started.strftime('%Y-%m-%d')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(markdown(result))
    log(f"results: {out} ({result['total_s']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
