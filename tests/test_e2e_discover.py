"""`fleetcuda discover` through a real OpenSSH server on loopback (login shells bash, zsh and dash; sudo -n for the
non-root users) and the recording pct stand-in: the host's round trip, real quoting, real frames."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from fleetcuda.plan.inventory import load_inventory
from tests.lab.sshd import LoopbackSshd
from tests.test_e2e_ssh import fleetcuda, write_inventory


@pytest.fixture
def lab(sshd_lab: LoopbackSshd) -> LoopbackSshd:
    for vmid in (300, 301, 310, 320):
        sshd_lab.add_container(vmid, name=f"c{vmid}")
    sshd_lab.add_container(399, running=False, name="stopped")
    with open(sshd_lab.state_dir / "301.conf", "a") as conf:  # the older passthrough form
        conf.write("lxc.cgroup2.devices.allow: c 195:* rwm\n"
                   "lxc.mount.entry: /dev/nvidia0 dev/nvidia0 none bind,optional,create=file\n")
    with open(sshd_lab.state_dir / "399.conf", "a") as conf:
        conf.write("dev0: /dev/nvidia0\n")
    return sshd_lab


def test_discover_over_real_ssh_in_three_login_shells(lab: LoopbackSshd, tmp_path: Path) -> None:
    os.chmod(tmp_path, 0o755)
    inv = write_inventory(lab, tmp_path / "inv.yaml")
    res = fleetcuda("discover", "bashhost", "zshhost", "dashhost", "-i", str(inv), "--format", "json",
                    state=tmp_path / "fc")
    # The stand-in's containers are this machine: whatever environments it has, the probe must have reported.
    assert res.returncode in (0, 1), res.stdout + res.stderr
    hosts = {h["host"]: h for h in json.loads(res.stdout)["hosts"]}
    assert set(hosts) == {"bashhost", "zshhost", "dashhost"}
    for host in hosts.values():
        assert host["error"] is None, host
        by = {c["vmid"]: c for c in host["containers"]}
        # One stand-in state for all three hosts: each sees every container (this test's, and those other tests of
        # the session's loopback lab added before it).
        assert {300, 301, 310, 320, 399} <= set(by)
        assert by[301]["gpu"] == {"forms": ["cgroup", "mount"], "lines": [
            "lxc.cgroup2.devices.allow: c 195:* rwm",
            "lxc.mount.entry: /dev/nvidia0 dev/nvidia0 none bind,optional,create=file"]}
        assert by[301]["probe_error"] is None and by[301]["config_error"] is None
        assert by[399]["status"] == "stopped" and by[399]["gpu"]["forms"] == ["dev"]
        assert by[399]["inventory"] == {"action": "note", "why": "it is stopped"}
        assert by[300]["gpu"]["forms"] == []
        own = {"bashhost": 300, "zshhost": 310, "dashhost": 320}[host["host"]]
        assert by[own]["inventory"] == {"action": "present"}
        assert by[320 if own != 320 else 310]["inventory"] == {"action": "note", "why": "it has no GPU passthrough"}
    calls = [json.loads(line) for line in (lab.state_dir / "calls.jsonl").read_text().splitlines()]
    listed = [c for c in calls if c["argv"][:1] == ["list"]]
    assert len(listed) == 3 and all(c["uid"] == 0 for c in listed)  # sudo -n for zsh's and dash's users
    # The host's round trip names pct exactly as the inventory does; nothing of this machine's environment.
    assert all("FLEETCUDA_STATE_DIR" not in c["env"] for c in calls)


def test_discover_writes_over_real_ssh(lab: LoopbackSshd, tmp_path: Path) -> None:
    os.chmod(tmp_path, 0o755)
    inv = write_inventory(lab, tmp_path / "inv.yaml")
    before = inv.read_text()
    res = fleetcuda("discover", "bashhost", "-i", str(inv), "--write", str(inv), state=tmp_path / "fc")
    assert res.returncode in (0, 1), res.stdout + res.stderr
    assert f"wrote {inv}:" in res.stdout
    text = inv.read_text()
    assert text.startswith(before.split("  zshhost:")[0].rstrip("\n"))
    assert "      # fleetcuda discover: bashhost/399 (stopped) not added: it is stopped\n" in text
    assert "      # fleetcuda discover: bashhost/310 (c310) not added: it has no GPU passthrough\n" in text
    loaded = load_inventory(inv)
    assert {t.id for t in loaded.targets} >= {"bashhost/300", "bashhost/301", "zshhost/310", "dashhost/320"}
