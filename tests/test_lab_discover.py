"""`fleetcuda discover` against the lab: real sshd (zsh login on lab-a, sudo -n on lab-b), the pct stand-in's
`list` and `config` over each container's LAB/hosts/<host>/pve/<vmid>.conf, and the probe inside real LXC
containers. Read-only on the lab; `--write` goes to a temporary copy of inventories/lab.yaml.

Needs the lab up with this branch's stand-in and configs (`sudo tests/lab/labctl.py up`).
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from fleetcuda.plan import pve
from fleetcuda.plan.inventory import load_inventory
from tests.conftest import REPO, run_fleetcuda
from tests.test_lab_e2e import INV, LAB, lab_is_up  # noqa: F401  (lab_is_up: autouse fixture)

pytestmark = pytest.mark.lab


@pytest.fixture(scope="module", autouse=True)
def lab_has_proxmox_configs(lab_is_up: None) -> None:  # noqa: F811  (after the lab is found up)
    if not (LAB / "hosts/a/pve/200.conf").exists():
        pytest.fail("the lab has no Proxmox configs (LAB/hosts/<host>/pve): `sudo tests/lab/labctl.py up` writes them")


def pct(host: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["nsenter", f"--net=/run/netns/fclab-{host}", "/usr/sbin/pct", *args],
                          capture_output=True, text=True, timeout=60)


def test_the_stand_in_prints_pct_list_and_config_as_proxmox(tmp_path: Path) -> None:
    listing = pct("a", "list")
    assert listing.returncode == 0, listing.stderr
    assert listing.stdout.splitlines()[0] == "VMID       Status     Lock         Name                "
    rows = {r.vmid: r for r in pve.parse_list(listing.stdout)}
    assert (rows[200].name, rows[200].status, rows[202].status) == ("train-a0", "running", "stopped")
    config = pct("a", "config", "200")
    assert config.returncode == 0, config.stderr
    keys = [line.split(":")[0] for line in config.stdout.splitlines()]
    assert keys == sorted(keys) and "dev0" in keys and "hostname" in keys
    missing = pct("a", "config", "999")
    assert (missing.returncode, missing.stderr) == (255, "Configuration file 'nodes/a/lxc/999.conf' does not exist\n")
    old = pve.parse_config(300, pct("b", "config", "300").stdout)
    assert old.forms == ("cgroup", "mount")


def test_discover_the_lab(tmp_path: Path) -> None:
    res = run_fleetcuda("discover", "lab-a", "lab-b", "-i", INV, state=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    out = res.stdout
    assert "lab-a (10.250.1.2): 3 containers" in out and "lab-b (10.250.2.2): 2 containers" in out
    assert "  200  train-a0  running\n      GPU passthrough (devN entries):\n        dev0: /dev/nvidia0\n" in out
    assert "  202  train-a2  stopped\n" in out and "python: not looked for (stopped)" in out
    assert "  300  train-b0  running\n      GPU passthrough (cgroup device rule, bind mounts):\n" \
           "        lxc.cgroup2.devices.allow: c 195:* rwm\n" in out
    assert "  301  train-b1  running\n      GPU passthrough: none\n" in out
    # The lab's base image: /root/venv with the torch stand-in, read from torch/version.py.
    assert len(re.findall(r"python: /root/venv \(venv, Python 3\.\d+\): torch 2\.11\.0\+cu\d+ \(CUDA [\d.]+\)", out)) \
        == 3, out
    assert out.endswith("would add 0 containers to inventories/lab.yaml\n")


def test_discover_writes_into_a_copy_of_the_lab_inventory(tmp_path: Path) -> None:
    text = (REPO / INV).read_text()
    cut = text.replace("      201:\n        name: train-a1\n        venv: /root/venv\n", "") \
              .replace("      300:\n        name: train-b0\n        venv: /root/venv\n", "      # my own note\n")
    assert cut != text
    copy = tmp_path / "lab.yaml"
    copy.write_text(cut)
    res = run_fleetcuda("discover", "lab-a", "lab-b", "-i", str(copy), "--write", str(copy), state=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    written = copy.read_text()
    assert "added lab-a/201 (train-a1)" in res.stdout and "added lab-b/300 (train-b0)" in res.stdout
    assert "# fleetcuda discover: lab-a/202 (train-a2) not added: it is stopped" in written
    assert "# fleetcuda discover: lab-b/301" not in written  # 301 is in the file already: nothing to say
    for line in cut.splitlines():  # every line of the user's, comments included
        assert line in written
    ids = {t.id for t in load_inventory(copy).targets}
    assert ids == {"lab-a/200", "lab-a/201", "lab-b/300", "lab-b/301"}
    again = run_fleetcuda("discover", "lab-a", "lab-b", "-i", str(copy), "--write", str(copy), state=tmp_path)
    assert again.returncode == 0 and copy.read_text() == written and "nothing to add" in again.stdout
