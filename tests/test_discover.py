"""`fleetcuda discover`: the pct parser (Proxmox's formats), the lab's pct stand-in (`list`, `config`), the probe
program run for real by a local shell, the CLI in-process over the fake connector (hostile names and values
included), and `--write`'s merge into an inventory's text."""

from __future__ import annotations

import io
import json
import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from fleetcuda.cli import Environment, main
from fleetcuda.connectors.fake import FakeTransport
from fleetcuda.plan import pve
from fleetcuda.plan.inventory import load_inventory
from fleetcuda.remote import framing, shell_text
from fleetcuda.run import discover
from tests.conftest import REPO
from tests.discover_support import (
    DEV_CONFIG,
    OLD_CONFIG,
    PLAIN_CONFIG,
    VENV_TORCH,
    envs_reply,
    host_reply,
    pct_list,
    script,
)

sys.path.insert(0, str(REPO / "tests" / "lab"))
import labctl  # noqa: E402
import pct_lxc  # noqa: E402

# -- the parser, against pct's own formats ----------------------------------------------------------------------

# As pct.pm prints them: printf "%-10s %-10s %-12s %-20s\n", sorted by vmid.
LISTING = ("VMID       Status     Lock         Name                \n"
           "100        running                 web                 \n"
           "200        stopped    backup       train-a0            \n"
           "1000       running                 a-name-longer-than-twenty-characters\n")


def test_pct_list_rows_with_and_without_a_lock() -> None:
    rows = pve.parse_list(LISTING)
    assert [(r.vmid, r.status, r.lock, r.name) for r in rows] == [
        (100, "running", "", "web"), (200, "stopped", "backup", "train-a0"),
        (1000, "running", "", "a-name-longer-than-twenty-characters")]
    assert pve.parse_list("") == []  # pct prints nothing at all without containers


@pytest.mark.parametrize("text, line", [
    ("usage: pct ...\n", 1),
    ("VMID       Status     Lock         Name\n100 running\n", 2),
    ("VMID       Status     Lock         Name\nabc running x y\n", 2),
    ("VMID       Status     Lock         Name\n100 running a b c\n", 2),
    ("VMID       Status     Lock         Name\n100 running a\n100 stopped b\n", 3),
])
def test_what_pct_list_never_prints_is_refused_with_its_line(text: str, line: int) -> None:
    with pytest.raises(pve.PveParseError) as err:
        pve.parse_list(text)
    assert err.value.line == line


def test_pct_config_dev_form() -> None:
    conf = pve.parse_config(200, "arch: amd64\ndev0: /dev/nvidia0,gid=44,mode=0666\ndev1: path=/dev/nvidiactl\n"
                                 "dev10: /dev/nvidia-uvm\ndev2: /dev/dri/card0\nhostname: train-a0\n")
    assert conf.hostname == "train-a0" and conf.forms == ("dev",)
    # In devN order (not the sorted keys' dev10 < dev2), and only NVIDIA's devices.
    assert [(p.key, p.device) for p in conf.passthrough] == [
        ("dev0", "/dev/nvidia0"), ("dev1", "/dev/nvidiactl"), ("dev10", "/dev/nvidia-uvm")]
    assert conf.passthrough[0].line == "dev0: /dev/nvidia0,gid=44,mode=0666"


def test_pct_config_older_forms_and_raw_keys_in_file_order() -> None:
    conf = pve.parse_config(300, "hostname: b0\nunprivileged: 1\n"
                                 "lxc.cgroup2.devices.allow: c 195:* rwm\n"
                                 "lxc.cgroup2.devices.allow: c 226:0 rwm\n"
                                 "lxc.cgroup.devices.allow: c 195:0 rw\n"
                                 "lxc.cgroup2.devices.allow: a\n"
                                 "lxc.mount.entry: /dev/nvidia0 dev/nvidia0 none bind,optional,create=file\n"
                                 "lxc.mount.entry: /dev/dri dev/dri none bind,optional,create=dir\n")
    assert conf.forms == ("cgroup", "mount")
    assert [(p.form, p.device) for p in conf.passthrough] == [
        ("cgroup", "c 195:*"), ("cgroup", "c 195:0"), ("mount", "/dev/nvidia0")]
    assert conf.raw[0] == ("lxc.cgroup2.devices.allow", "c 195:* rwm") and len(conf.raw) == 6


def test_pct_config_without_gpu_and_odd_lines() -> None:
    conf = pve.parse_config(301, "arch: amd64\ndescription: a%3A b%0A\nhostname: x\nnameserver:\n")
    assert not conf.has_gpu and conf.options["description"] == "a%3A b%0A" and conf.options["nameserver"] == ""
    with pytest.raises(pve.PveParseError, match=r"pct config 301, line 2: not a `key: value` line"):
        pve.parse_config(301, "arch: amd64\nnot a config line\n")
    with pytest.raises(pve.PveParseError, match="printed twice"):
        pve.parse_config(301, "arch: amd64\narch: arm64\n")


# -- the lab's pct stand-in -----------------------------------------------------------------------------------


def _node(tmp_path: Path, confs: dict[int, str]) -> pct_lxc.Node:
    node = pct_lxc.Node("a", lab=tmp_path)
    node.pvepath.mkdir(parents=True)
    for vmid, text in confs.items():
        (node.pvepath / f"{vmid}.conf").write_text(text)
    return node


def _pct(node: pct_lxc.Node, capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    try:
        pct_lxc.cmd_config(node, list(args))
        code = 0
    except SystemExit as exc:
        code = int(exc.code or 0)
    out = capsys.readouterr()
    return code, out.out, out.err


def test_the_stand_in_prints_config_as_pct_does(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    raw = ("#Training box%3A GPU 0\n#second line\nunprivileged: yes\nhostname: t0\ncores: 8\n"
           "dev1: /dev/nvidiactl\ndev0: /dev/nvidia0\n"
           "lxc.mount.entry = /dev/nvidia0 dev/nvidia0 none bind,optional,create=file\n"
           "lxc.cgroup2.devices.allow: c 195:* rwm\n"
           "\n[pve:pending]\nmemory: 4096\ndelete: cores\n"
           "\n[before-upgrade]\nhostname: old\n")
    node = _node(tmp_path, {200: raw})
    code, out, err = _pct(node, capsys, "200")
    assert (code, err) == (0, "")
    # Options sorted (pending taken in, deleted ones gone), description escaped onto one line, raw keys last in
    # the file's order, always as `key: value`; booleans as pve stores them.
    assert out == ("description: Training box%3A GPU 0%0Asecond line%0A\ndev0: /dev/nvidia0\n"
                   "dev1: /dev/nvidiactl\nhostname: t0\nmemory: 4096\nunprivileged: 1\n"
                   "lxc.mount.entry: /dev/nvidia0 dev/nvidia0 none bind,optional,create=file\n"
                   "lxc.cgroup2.devices.allow: c 195:* rwm\n")
    code, out, _ = _pct(node, capsys, "200", "--current", "1")
    assert code == 0 and "cores: 8\n" in out and "memory" not in out
    code, out, _ = _pct(node, capsys, "200", "--snapshot", "before-upgrade")
    assert (code, out) == (0, "hostname: old\n")
    # What the stand-in prints, fleetcuda's parser reads.
    parsed = pve.parse_config(200, _pct(node, capsys, "200")[1])
    assert parsed.forms == ("dev", "cgroup", "mount")


def test_the_stand_in_fails_as_pct_does(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    node = _node(tmp_path, {200: "hostname: t0\nbogus: 1\nlxc.nonsense: 2\n"})
    assert _pct(node, capsys, "999") == (255, "", "Configuration file 'nodes/a/lxc/999.conf' does not exist\n")
    code, out, err = _pct(node, capsys, "abc")
    assert (code, out) == (255, "") and err.startswith("400 Parameter verification failed.\nvmid: type check")
    assert _pct(node, capsys, "99")[0] == 255
    code, _, err = _pct(node, capsys, "200", "--snapshot", "nope")
    assert code == 255 and "snapshot 'nope' does not exist" in err
    # Lines it cannot parse are warnings on stderr (pct reads configs non-strictly); the value is still printed.
    code, out, err = _pct(node, capsys, "200")
    assert code == 0 and out == "bogus: 1\nhostname: t0\n"
    assert "vm 200 - unable to parse value of 'bogus' - unknown setting 'bogus'" in err
    assert "vm 200 - unable to parse config: lxc.nonsense: 2" in err


def test_the_stand_in_lists_names_as_pct_does() -> None:
    f = pct_lxc.parse_pve_conf(200, "hostname: train-a0\nlock: backup\n")
    assert pct_lxc.render_list([(200, "running", f.current), (101, "stopped", None)]) == (
        "VMID       Status     Lock         Name                \n"
        "101        stopped                 CT101               \n"
        "200        running    backup       train-a0            \n")
    assert pct_lxc.render_list([]) == ""


def test_the_lab_configs_have_the_three_forms() -> None:
    forms = {}
    for vmid in (200, 201, 202, 300, 301):
        text = labctl.pve_conf_text(vmid)
        parsed = pct_lxc.parse_pve_conf(vmid, text)
        assert parsed.warnings == [], vmid
        conf = pve.parse_config(vmid, pct_lxc.render_config(parsed))
        forms[vmid] = conf.forms
        assert conf.hostname == labctl.PVE_HOSTNAMES[vmid]
    assert forms == {200: ("dev",), 201: ("dev",), 202: ("dev",), 300: ("cgroup", "mount"), 301: ()}


def test_labctl_writes_a_config_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    host = labctl.LabHost("a", 1, [], running=[200])
    monkeypatch.setattr(labctl, "LAB", tmp_path)
    monkeypatch.setattr(labctl.LabHost, "dir", property(lambda self: tmp_path / "hosts" / self.name))
    labctl.ensure_pve_conf(host, 200)
    path = tmp_path / "hosts/a/pve/200.conf"
    assert stat.S_IMODE(path.stat().st_mode) == 0o640 and "dev0: /dev/nvidia0" in path.read_text()
    path.write_text("hostname: edited\n")
    labctl.ensure_pve_conf(host, 200)
    assert path.read_text() == "hostname: edited\n"


# -- the probe program, run by a real shell ------------------------------------------------------------------


def _sh(body: str, *, shell: str = "sh", nonce: str = "0123456789abcdef") -> str:
    text = shell_text("discover_probe") + body
    proc = subprocess.run([shell, "-c", text], capture_output=True, text=True, env={"PATH": os.environ["PATH"],
                                                                                     "fcn": nonce}, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_the_host_function_frames_pct_list_and_each_config(tmp_path: Path) -> None:
    fake_pct = tmp_path / "pct"
    fake_pct.write_text("#!/bin/sh\n"
                        'case "$1 $2" in\n'
                        f"  'list ') printf '%s' '{LISTING}' ;;\n"
                        "  'config 100') printf 'hostname: web\\ndev0: /dev/nvidia0\\n' ;;\n"
                        "  'config 200') echo \"Configuration file 'nodes/n/lxc/200.conf' does not exist\" >&2; "
                        "exit 255 ;;\n"
                        "  *) printf 'hostname: x\\n'; echo 'vm 1000 - a warning' >&2 ;;\n"
                        "esac\n")
    fake_pct.chmod(0o755)
    out = _sh(f"fleetcuda_discover_host {fake_pct} 0\n", shell="dash" if Path("/usr/bin/dash").exists() else "sh")
    listing, configs, done = discover.parse_host(out, "0123456789abcdef")
    assert done and listing is not None and listing.rc == 0 and listing.stdout == LISTING.rstrip("\n")
    assert configs[100].stdout == "hostname: web\ndev0: /dev/nvidia0" and configs[100].rc == 0
    assert configs[200].rc == 255 and "does not exist" in configs[200].stderr
    assert configs[1000].stdout == "hostname: x" and configs[1000].stderr == "vm 1000 - a warning"
    # Another run's nonce reads nothing.
    assert discover.parse_host(out, "fedcba9876543210") == (None, {}, False)


def _venv(root: Path, path: str, pyver: str = "3.11", version_py: str | None = None) -> None:
    d = root / path.lstrip("/")
    (d / "bin").mkdir(parents=True)
    (d / "bin/python").write_text("#!/bin/sh\n")
    (d / "bin/python").chmod(0o755)
    site = d / "lib" / f"python{pyver}" / "site-packages"
    site.mkdir(parents=True)
    if version_py is not None:
        (site / "torch").mkdir()
        (site / "torch/version.py").write_text(version_py)


TORCH_VERSION_PY = ("from typing import Optional\n\n__all__ = ['__version__', 'debug', 'cuda']\n"
                    "__version__ = '2.5.1+cu124'\ndebug = False\ncuda: Optional[str] = '12.4'\n")


def test_the_envs_function_finds_venvs_and_conda_without_importing_torch(tmp_path: Path) -> None:
    root = tmp_path / "ct"
    _venv(root, "/root/venv", version_py=TORCH_VERSION_PY)
    (root / "root/.venv").symlink_to("venv")  # the same environment twice: said once
    _venv(root, "/opt/conda", "3.12")
    (root / "opt/conda/conda-meta").mkdir()
    _venv(root, "/opt/conda/envs/train", "3.12", version_py="__version__ = \"2.6.0+cpu\"\ncuda = None\n")
    _venv(root, "/home/ann/.venv", "3.10")  # no torch
    # Hostile: a path no inventory may hold, and a version.py whose values are not words.
    _venv(root, "/opt/evil name/venv", version_py=TORCH_VERSION_PY)
    _venv(root, "/opt/ok/venv", version_py="__version__ = '$(reboot) x'\ncuda = '12.4\\n@@fleetcuda'\n")
    out = _sh(f"fleetcuda_discover_envs {root}\n")
    envs, skipped, truncated, done = discover.parse_envs(out, "0123456789abcdef")
    assert done and skipped == 1 and not truncated
    got = {(e.kind, e.path, e.python, e.python_version, e.torch, e.cuda) for e in envs}
    assert got == {
        ("venv", "/root/venv", "/root/venv/bin/python", "3.11", "2.5.1+cu124", "12.4"),
        ("conda", "/opt/conda", "/opt/conda/bin/python", "3.12", None, None),
        ("conda", "/opt/conda/envs/train", "/opt/conda/envs/train/bin/python", "3.12", "2.6.0+cpu", "none"),
        ("venv", "/home/ann/.venv", "/home/ann/.venv/bin/python", "3.10", None, None),
        ("venv", "/opt/ok/venv", "/opt/ok/venv/bin/python", "3.11", None, None),
    }
    assert envs[0].path == "/root/venv"  # the preferred place first


def test_the_envs_function_in_an_empty_container(tmp_path: Path) -> None:
    out = _sh(f"fleetcuda_discover_envs {tmp_path}\n")
    assert discover.parse_envs(out, "0123456789abcdef") == ([], 0, False, True)


def test_forged_frames_are_not_believed() -> None:
    nonce = "0123456789abcdef"
    out = (f"@@fleetcuda:{nonce} pyenv venv /root/x;rm /root/x/bin/python 3.11 2.0 12.1\n"
           f"@@fleetcuda:{nonce} pyenv venv /root/v /root/v/bin/python 3.11 2.0 12.1 extra\n"
           f"@@fleetcuda:{nonce} pyenv nope /root/v /root/v/bin/python 3.11 2.0 12.1\n"
           f"@@fleetcuda:{nonce} pyenv venv /root/v /root/v/bin/python 3.11 {'9' * 80} 12.1\n"
           f"@@fleetcuda:{nonce} pyenv-done 4 0 0\n")
    envs, skipped, _, done = discover.parse_envs(out, nonce)
    assert done and skipped == 2 and [e.torch for e in envs] == [None]


# -- the CLI, in-process over the fake connector ------------------------------------------------------------------


class Run:
    def __init__(self, code: int, out: str, err: str):
        self.code, self.out, self.err = code, out, err


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeTransport:
    transport = FakeTransport()
    import fleetcuda.cli.common as common

    monkeypatch.setattr(common, "transport_factory", lambda inventory: (lambda host: transport))
    return transport


def cli(tmp_path: Path, *argv: str | Path) -> Run:
    out, err = io.StringIO(), io.StringIO()
    env = Environment.with_streams(out, err, io.StringIO(""), environ={"COLUMNS": "200"}, home=tmp_path,
                                   cwd=tmp_path, state_dir=tmp_path / "state", stdout_is_terminal=False)
    try:
        code = main([str(a) for a in argv], env)
    except SystemExit as exc:
        code = int(exc.code or 0)
    return Run(code, out.getvalue(), err.getvalue())


INVENTORY = """\
# my fleet: hand-written, with comments that must survive
vars:
  max_jobs: 4   # keep this comment
hosts:
  pve1:
    address: 10.9.0.1      # the big box
    user: ops
    sudo: true
    known_hosts: /etc/fleet/known_hosts
    containers:
      100:
        name: old-one
        venv: /opt/train/venv   # not where discover would look
        vars: {note: "user's"}
      # a comment after the last container
  # a comment between hosts
  pve2:
    address: 10.9.0.2
"""


def fleet(fake: FakeTransport) -> None:
    script(fake, pct_list((100, "running", "", "old-one"), (200, "running", "", "train-0"),
                          (201, "stopped", "", "train-1"), (202, "running", "", "web"),
                          (203, "running", "", "no-torch")),
           {100: DEV_CONFIG.format(name="old-one", vmid=100), 200: DEV_CONFIG.format(name="train-0", vmid=200),
            201: DEV_CONFIG.format(name="train-1", vmid=201), 202: PLAIN_CONFIG.format(name="web"),
            203: OLD_CONFIG.format(name="no-torch")},
           {100: envs_reply(VENV_TORCH), 200: envs_reply(VENV_TORCH),
            203: envs_reply(("venv", "/root/venv", "/root/venv/bin/python", "3.11", "-", "-"))})


def test_discover_prints_every_container_and_what_it_would_add(tmp_path: Path, fake: FakeTransport) -> None:
    inv = tmp_path / "inv.yaml"
    inv.write_text(INVENTORY)
    fleet(fake)
    res = cli(tmp_path, "discover", "pve1", "-i", inv)
    assert res.code == 0, res.out + res.err
    assert "pve1 (10.9.0.1): 5 containers" in res.out
    assert "  200  train-0  running\n      GPU passthrough (devN entries):\n        dev0: /dev/nvidia0\n" in res.out
    assert "python: /root/venv (venv, Python 3.11): torch 2.11.0+cu128 (CUDA 12.8)" in res.out
    assert f"inventory: would add pve1/200 to {inv}: name: train-0, venv: /root/venv" in res.out
    assert f"inventory: already in {inv} as pve1/100" in res.out
    # Stopped and GPU-less containers are listed, not dropped; neither is looked into.
    assert "  201  train-1  stopped\n" in res.out and "python: not looked for (stopped)" in res.out
    assert "  202  web  running\n      GPU passthrough: none\n      python: not looked for (no GPU passthrough)" \
        in res.out
    assert "GPU passthrough (cgroup device rule, bind mounts):\n        lxc.cgroup2.devices.allow: c 195:* rwm" \
        in res.out
    assert "inventory: not a target (no Python environment with torch was found in it)" in res.out
    assert res.out.endswith(f"would add 1 container to {inv} (--write FILE adds them)\n")
    assert inv.read_text() == INVENTORY  # without --write nothing is written
    # One round trip for the host, one per running container with a GPU; over the host's one transport.
    calls = [c for c in fake.calls if c.kind == "run"]
    assert [c.label for c in calls] == ["fleetcuda-discover"] + ["fleetcuda-discover-probe"] * 3
    assert [c.place for c in calls] == [None, 100, 200, 203]
    host_call = calls[0]
    assert host_call.cmd is not None and host_call.cmd.remote is not None
    assert "fleetcuda_discover_host /usr/sbin/pct 1" in host_call.script  # sudo: true in the inventory
    assert calls[1].cmd is not None and calls[1].cmd.argv[:5] == ("sudo", "-n", "--", "/usr/sbin/pct", "exec")
    # The nonce travels on stdin, never on the command line.
    nonce = host_call.cmd.stdin.split("\0")[0]
    assert nonce and nonce not in host_call.cmd.remote


def test_json_output(tmp_path: Path, fake: FakeTransport) -> None:
    inv = tmp_path / "inv.yaml"
    inv.write_text(INVENTORY)
    fleet(fake)
    res = cli(tmp_path, "discover", "pve1", "-i", inv, "--format", "json")
    assert res.code == 0
    [host] = json.loads(res.out)["hosts"]
    by = {c["vmid"]: c for c in host["containers"]}
    assert by[200]["inventory"] == {"action": "add", "name": "train-0", "venv": "/root/venv", "python": None}
    assert by[201]["inventory"] == {"action": "note", "why": "it is stopped"} and by[201]["envs"] == []
    assert by[100]["inventory"] == {"action": "present"} and by[203]["gpu"]["forms"] == ["cgroup", "mount"]


def test_write_merges_keeping_every_comment_and_is_idempotent(tmp_path: Path, fake: FakeTransport) -> None:
    inv = tmp_path / "inv.yaml"
    inv.write_text(INVENTORY)
    inv.chmod(0o640)
    fleet(fake)
    res = cli(tmp_path, "discover", "pve1", "pve2", "-i", inv, "--write", inv)
    assert res.code == 0, res.out + res.err
    text = inv.read_text()
    # Every line the user wrote is still there, in order; the new ones are inserted, nothing else changed.
    new_lines = text.splitlines()
    it = iter(new_lines)
    assert all(line in it for line in INVENTORY.splitlines())
    assert ("      100:\n        name: old-one\n        venv: /opt/train/venv   # not where discover would look\n"
            "        vars: {note: \"user's\"}\n"
            "      200:\n        name: train-0\n        venv: /root/venv\n"
            "      # fleetcuda discover: pve1/201 (train-1) not added: it is stopped\n"
            "      # fleetcuda discover: pve1/202 (web) not added: it has no GPU passthrough\n"
            "      # fleetcuda discover: pve1/203 (no-torch) not added: no Python environment with torch was found "
            "in it\n"
            "      # a comment after the last container\n") in text
    # pve2 had no containers: a `containers:` key of its own (the fake answers the same fleet for it).
    assert "  pve2:\n    address: 10.9.0.2\n    containers:\n      100:\n        name: old-one\n" in text
    assert stat.S_IMODE(inv.stat().st_mode) == 0o640
    loaded = load_inventory(inv)
    assert {t.id for t in loaded.targets} == {"pve1/100", "pve1/200", "pve2/100", "pve2/200"}
    assert "wrote" in res.out and "added pve1/200 (train-0)" in res.out
    # A second run adds nothing and changes no byte.
    again = cli(tmp_path, "discover", "pve1", "pve2", "-i", inv, "--write", inv)
    assert again.code == 0 and inv.read_text() == text and f"{inv}: nothing to add" in again.out


def test_write_to_a_new_file_copies_how_to_reach_the_host(tmp_path: Path, fake: FakeTransport) -> None:
    inv = tmp_path / "inv.yaml"
    inv.write_text(INVENTORY)
    fleet(fake)
    out = tmp_path / "found.yaml"
    res = cli(tmp_path, "discover", "pve1", "-i", inv, "--write", out)
    assert res.code == 0, res.out + res.err
    assert stat.S_IMODE(out.stat().st_mode) == 0o600
    loaded = load_inventory(out)
    host = loaded.spec.hosts["pve1"]
    assert (host.address, host.user, host.sudo, host.known_hosts) == ("10.9.0.1", "ops", True, "/etc/fleet/known_hosts")
    assert {t.id for t in loaded.targets} == {"pve1/100", "pve1/200"}  # 100 is not in this file: added here
    assert "not added: it is stopped" in out.read_text()


HOSTILE_NAMES = ['a"b', "x: {injected: 1}", "{{ evil }}", "- item", "#comment", "true", "123", "a\x1b[31mred",
                 "name'quote", "&anchor", "*alias", "!!python/object", "null"]


@pytest.mark.parametrize("name", HOSTILE_NAMES)
def test_hostile_container_names_never_break_nor_inject(tmp_path: Path, fake: FakeTransport, name: str) -> None:
    inv = tmp_path / "inv.yaml"
    inv.write_text(INVENTORY)
    # A hand-edited config's hostname reaches pct list without its whitespace (PVE::LXC::vmstatus removes it),
    # whatever else it holds.
    name = re.sub(r"\s", "", name)
    script(fake, pct_list((500, "running", "", name), (501, "stopped", "", name + "x")),
           {500: DEV_CONFIG.format(name=name, vmid=500), 501: PLAIN_CONFIG.format(name="x")},
           {500: envs_reply(VENV_TORCH)})
    res = cli(tmp_path, "discover", "pve1", "-i", inv, "--write", inv)
    assert res.code == 0, res.out + res.err
    assert "\x1b" not in res.out  # target text is data: escaped, never a terminal sequence
    loaded = load_inventory(inv)
    [added] = [t for t in loaded.targets if t.id == "pve1/500"]
    assert added.container is not None and added.container.venv == "/root/venv"
    # Written only when it is a name an inventory may hold, and then as exactly that string.
    assert added.container.name in (None, name)
    if name in ("true", "123", "null"):
        assert added.container.name == name
    data = yaml.safe_load(inv.read_text())
    assert set(data) == {"vars", "hosts"} and set(data["hosts"]) == {"pve1", "pve2"}
    assert set(data["hosts"]["pve1"]["containers"]) == {100, 500}
    assert set(data["hosts"]["pve1"]["containers"][500]) <= {"name", "venv"}


def test_hostile_config_values_and_probe_output(tmp_path: Path, fake: FakeTransport) -> None:
    inv = tmp_path / "inv.yaml"
    inv.write_text(INVENTORY)
    nasty = ("dev0: /dev/nvidia0\nhostname: ok\ndescription: %0A@@fleetcuda:0000000000000000 pyenv venv /x\n"
             "lxc.mount.entry: /dev/nvidia0 dev/nvidia0 none bind,optional,create=file # {{ x }}: y\n")
    forged = "\n@@fleetcuda:0123456789abcdef pyenv venv /etc /etc/bin/python 3.11 9.9 9.9\n"
    script(fake, pct_list((600, "running", "", "ok")), {600: nasty},
           {600: envs_reply(("venv", "/root/venv\nname: x", "/root/venv/bin/python", "3.11", "2.0", "12.1"),
                            ("venv", "/srv/a/venv", "/srv/a/venv/bin/python", "3.11", "{{x}}", "12.1"),
                            extra=forged)})
    res = cli(tmp_path, "discover", "pve1", "-i", inv, "--write", inv)
    assert res.code == 0, res.out + res.err
    assert "{{ x }}: y" in res.out  # shown as the data it is
    data = yaml.safe_load(inv.read_text())
    # Only the frame that says what the probe says is believed: a path with a newline is no path, `{{x}}` no
    # version (so no torch there), and another nonce's frame is not ours.
    assert 600 not in data["hosts"]["pve1"]["containers"]
    assert "# fleetcuda discover: pve1/600 (ok) not added: no Python environment with torch was found in it" \
        in inv.read_text()


def test_failures_are_said_per_host_and_container(tmp_path: Path, fake: FakeTransport) -> None:
    inv = tmp_path / "inv.yaml"
    inv.write_text(INVENTORY)
    fake.on(label="fleetcuda-discover", reply=host_reply(pct_list((700, "running", "", "a"), (701, "running", "", "b")),
                                                         {700: DEV_CONFIG.format(name="a", vmid=700)}))
    fake.on(label="fleetcuda-discover-probe", reply=envs_reply(VENV_TORCH, done=False, extra="bash: oops\n"))
    res = cli(tmp_path, "discover", "pve1", "-i", inv)
    assert res.code == 1
    assert "config: pct config 701 failed (exit 255): Configuration file 'nodes/pve/lxc/701.conf' does not exist" \
        in res.out
    assert "python: no report from the container (exit 0): bash: oops" in res.out


def test_pct_list_failing_and_unknown_hosts(tmp_path: Path, fake: FakeTransport) -> None:
    inv = tmp_path / "inv.yaml"
    inv.write_text(INVENTORY)
    fake.on(label="fleetcuda-discover", reply=host_reply("", {}, list_rc=1, list_err="sudo: a password is required\n"))
    res = cli(tmp_path, "discover", "pve1", "-i", inv)
    assert res.code == 1 and "pve1 (10.9.0.1): pct list failed (exit 1): sudo: a password is required" in res.out
    res = cli(tmp_path, "discover", "nope", "-i", inv)
    assert res.code == 2 and f"{inv}: hosts: no host 'nope'" in res.err
    assert len(fake.calls_for(label="fleetcuda-discover")) == 1  # the unknown host was refused before connecting


def test_an_empty_host(tmp_path: Path, fake: FakeTransport) -> None:
    inv = tmp_path / "inv.yaml"
    inv.write_text(INVENTORY)
    fake.on(label="fleetcuda-discover", reply=host_reply("", {}))
    res = cli(tmp_path, "discover", "pve2", "-i", inv, "--write", inv)
    assert res.code == 0 and "pve2 (10.9.0.2): 0 containers" in res.out and inv.read_text() == INVENTORY


def test_unreachable_host_is_exit_3(tmp_path: Path, fake: FakeTransport) -> None:
    from fleetcuda.errors import UnreachableError

    inv = tmp_path / "inv.yaml"
    inv.write_text(INVENTORY)

    def refuse(call):  # type: ignore[no-untyped-def]
        raise UnreachableError("cannot connect to 10.9.0.1:22: connection refused")

    fake.on(label="fleetcuda-discover", reply=refuse)
    res = cli(tmp_path, "discover", "pve1", "-i", inv)
    assert res.code == 3 and "pve1 (10.9.0.1): cannot connect to 10.9.0.1:22: connection refused" in res.out


# -- the merge, on shapes of inventory a user may have written ---------------------------------------------------

from fleetcuda.plan.inventory_edit import HostEdit, NewContainer, Skipped, merge  # noqa: E402


def _add(host: str, *vmids: int) -> HostEdit:
    return HostEdit(host, add=[NewContainer(v, f"ct{v}", "/root/venv", None) for v in vmids])


def test_merge_into_a_list_of_containers() -> None:
    text = "hosts:\n  h:\n    address: 10.0.0.1\n    containers:\n    - vmid: 100\n      name: a\n# end\n"
    out, _ = merge(text, "f.yaml", [_add("h", 200)])
    assert out == ("hosts:\n  h:\n    address: 10.0.0.1\n    containers:\n    - vmid: 100\n      name: a\n"
                   "    - vmid: 200\n      name: ct200\n      venv: /root/venv\n# end\n")


def test_merge_follows_the_files_indentation_and_line_endings() -> None:
    text = ("hosts:\r\n    h:\r\n        address: x\r\n        containers:\r\n            100:\r\n"
            "                name: a\r\n")
    out, _ = merge(text, "f.yaml", [_add("h", 200)])
    assert out.endswith("            100:\r\n                name: a\r\n            200:\r\n"
                        "                name: ct200\r\n                venv: /root/venv\r\n")


def test_merge_after_a_block_scalar_and_without_a_final_newline() -> None:
    text = "hosts:\n  h:\n    address: x\n    containers:\n      100:\n        vars:\n          note: |\n" \
           "            two\n            lines\n  g:\n    address: y"
    out, _ = merge(text, "f.yaml", [_add("h", 200), _add("g", 300)])
    data = yaml.safe_load(out)
    assert data["hosts"]["h"]["containers"][100]["vars"]["note"] == "two\nlines\n"
    assert set(data["hosts"]["h"]["containers"]) == {100, 200} and set(data["hosts"]["g"]["containers"]) == {300}


@pytest.mark.parametrize("text, field", [
    ("hosts:\n  h: {address: x}\n", "hosts.h"),
    ("hosts:\n  h:\n    address: x\n    containers: {100: {name: a}}\n", "hosts.h.containers"),
    ("hosts:\n  h:\n    address: x\n    containers:\n", "hosts.h.containers"),
    ("shared: &c\n  100: {name: a}\nhosts:\n  h:\n    address: x\n    containers: *c\n", "hosts.h.containers"),
    ("hosts:\n  h:\n    address: x\n    containers: &c\n      100: {name: a}\n", "hosts.h.containers"),
    ("base: &b\n  address: x\n  containers:\n    100: {name: a}\nhosts:\n  h:\n    <<: *b\n    user: root\n",
     "hosts.h"),
])
def test_merge_refuses_shapes_it_cannot_add_to_without_rewriting_them(text: str, field: str) -> None:
    from fleetcuda.errors import InputError

    with pytest.raises(InputError) as err:
        merge(text, "f.yaml", [_add("h", 200)])
    assert err.value.field == field and err.value.file == "f.yaml" and err.value.line


def test_merge_notes_once_per_host_and_vmid() -> None:
    text = "hosts:\n  h:\n    address: x\n    containers:\n      100: {}\n"
    edit = HostEdit("h", skip=[Skipped(101, "web", "it is stopped")])
    once, done = merge(text, "f.yaml", [edit])
    assert once.endswith("      # fleetcuda discover: h/101 (web) not added: it is stopped\n") and done
    twice, done = merge(once, "f.yaml", [edit])
    assert twice == once and done == []
    other, _ = merge(once, "f.yaml", [HostEdit("g", skip=[Skipped(101, None, "it is stopped")])])
    assert other == once  # no block is made for a host only to hold notes


def test_flow_style_inventory_is_an_input_error_from_the_cli(tmp_path: Path, fake: FakeTransport) -> None:
    inv = tmp_path / "inv.yaml"
    inv.write_text("hosts:\n  pve1: {address: 10.9.0.1, containers: {100: {name: a}}}\n")
    fleet(fake)
    res = cli(tmp_path, "discover", "pve1", "-i", inv, "--write", inv)
    assert res.code == 2 and f"{inv}:2: hosts.pve1: is written in flow style" in res.err
    assert inv.read_text() == "hosts:\n  pve1: {address: 10.9.0.1, containers: {100: {name: a}}}\n"


def test_framing_of_the_probe_uses_the_run_nonce() -> None:
    from fleetcuda.plan.inventory import HostSpec

    spec = HostSpec(address="10.0.0.1", user="root")
    from fleetcuda.plan.command import HopChain, SshHop

    chain = HopChain(SshHop("10.0.0.1", "root"), None)
    cmd = discover.probe_command(spec, chain, 200, "0123456789abcdef")
    assert cmd.stdin == "0123456789abcdef\0" and "0123456789abcdef" not in (cmd.remote or "")
    assert cmd.argv[:3] == ("/usr/sbin/pct", "exec", "200") and framing.NONCE_REF in cmd.argv[-2]


def test_a_bad_write_file_is_refused_before_connecting(tmp_path: Path, fake: FakeTransport) -> None:
    inv = tmp_path / "inv.yaml"
    inv.write_text(INVENTORY)
    bad = tmp_path / "bad.yaml"
    bad.write_text("hosts:\n  pve1:\n    address: 10.9.0.1\n    colour: blue\n")
    res = cli(tmp_path, "discover", "pve1", "-i", inv, "--write", bad)
    assert res.code == 2 and f"{bad}:4: hosts.pve1.colour: unknown field" in res.err
    assert fake.calls == []


def test_a_host_behind_a_jump_host_is_not_copied_into_a_new_file(tmp_path: Path, fake: FakeTransport) -> None:
    inv = tmp_path / "inv.yaml"
    inv.write_text(INVENTORY.replace("    address: 10.9.0.2\n", "    address: 10.9.0.2\n    jump: pve1\n"))
    fleet(fake)
    out = tmp_path / "new.yaml"
    res = cli(tmp_path, "discover", "pve2", "-i", inv, "--write", out)
    assert res.code == 2 and "hosts.pve2: not in this file" in res.err and "jump host" in res.err
    assert not out.exists()


def test_merge_places_a_block_ending_in_an_alias_where_the_alias_is_written() -> None:
    # PyYAML gives an alias the anchored node's marks: the block must end at the alias, not at the anchor.
    text = ("hosts:\n  g:\n    address: y\n    containers:\n      100: &ct\n        venv: /v\n  h:\n    address: x\n"
            "    containers:\n      101: *ct\n")
    out, _ = merge(text, "f.yaml", [_add("h", 200)])
    assert out == text + "      200:\n        name: ct200\n        venv: /root/venv\n"
    text = "hosts:\n  g:\n    address: y\n    user: &u root\n  h:\n    address: x\n    user: *u\n  k:\n    address: z\n"
    out, _ = merge(text, "f.yaml", [_add("h", 200)])
    assert out == text.replace("user: *u\n", "user: *u\n    containers:\n      200:\n        name: ct200\n"
                                             "        venv: /root/venv\n")


def test_merge_counts_lines_as_yaml_does_with_mixed_line_breaks() -> None:
    # One CRLF line in an LF file, a NEL, a lone CR and U+2028/U+2029 inside quoted values: YAML counts each as a
    # line break, so the insertion place must too; the new lines end as the line before them.
    text = ("# wiki\r\nhosts:\n  h:\n    address: x\n    vars:\n      a: \"one\u2028two\"\n"
            "      b: \"three\u2029four\"\n      c: \"five\x85six\"\r    containers:\n      100:\n"
            "        venv: /opt/v\n  g:\n    address: y\n")
    out, _ = merge(text, "f.yaml", [_add("h", 200)])
    assert out == text.replace("venv: /opt/v\n", "venv: /opt/v\n      200:\n        name: ct200\n"
                                                 "        venv: /root/venv\n")
    data = yaml.safe_load(out)
    assert set(data["hosts"]["h"]["containers"]) == {100, 200} and "containers" not in data["hosts"]["g"]


def test_merge_keeps_a_missing_final_newline_when_it_inserts_before_it() -> None:
    text = "hosts:\n  h:\n    address: x\n    containers:\n      100: {}\n  g:\n    address: y"
    out, _ = merge(text, "f.yaml", [_add("h", 200)])
    assert out == text.replace("100: {}\n", "100: {}\n      200:\n        name: ct200\n        venv: /root/venv\n")


@pytest.mark.parametrize("text, field, line", [
    ("shared: &h\n  address: x\nhosts:\n  h: *h\n", "hosts.h", 4),
    ("shared: &hs\n  h:\n    address: x\nhosts: *hs\n", "hosts", 4),
])
def test_merge_refuses_to_add_through_an_alias(text: str, field: str, line: int) -> None:
    from fleetcuda.errors import InputError

    with pytest.raises(InputError) as err:
        merge(text, "f.yaml", [_add("h", 200)])
    assert err.value.field == field and "alias" in err.value.message
    assert err.value.line == line and err.value.file == "f.yaml"
