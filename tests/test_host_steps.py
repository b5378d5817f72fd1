"""Steps with `on: host`: planned with the host's chain (no `pct exec`, still `env -i`), shown in the dry-run
as running on the host, batched there apart from the container's checks, and the GPU passthrough step's
verify reported as drift with what to do."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
from pathlib import Path

import pytest

from fleetcuda.connectors.fake import exit_with, ok
from fleetcuda.plan import view
from fleetcuda.plan.command import ENV
from fleetcuda.plan.inventory import load_inventory
from fleetcuda.plan.planner import base_values, make_plan
from fleetcuda.plan.recipe import load_recipe
from fleetcuda.remote import catalog
from fleetcuda.results import StepStatus, TargetStatus
from tests.conftest import SHELLS, need
from tests.run_support import make_engine

SUDO_HOST = ("hosts:\n  pve:\n    address: 10.0.0.1\n    user: ops\n    sudo: true\n    containers:\n"
             "      200:\n        venv: /root/venv\n")
LOCAL = "hosts:\n  box:\n    kind: local\n    venv: /opt/venv\n"
STEPS = ("  - name: in-ct\n    check: test -e /etc/ct\n"
         "  - name: host-uname\n    on: host\n    verify: uname -r\n"
         "  - name: gpu\n    kind: gpu_passthrough\n    cuda_version: '13.0'\n")
DRIFT = ("FAIL host driver 580.159.04 but the container's libcuda.so is 575.57.08: the host driver was upgraded; "
         "reinstall the container's NVIDIA user-space libraries at exactly 580.159.04 (the same driver .run with "
         "--no-kernel-module, or the distro's packages of that version), then restart the container")


def plan_for(tmp_path: Path, inventory: str, steps: str = STEPS):
    (tmp_path / "r.yaml").write_text(f"name: r\nsteps:\n{steps}")
    (tmp_path / "i.yaml").write_text(inventory)
    recipe, inv = load_recipe(tmp_path / "r.yaml"), load_inventory(tmp_path / "i.yaml")
    (target,) = inv.targets
    return recipe, inv, make_plan(recipe, target, base_values(recipe, target, {}), run_id="feedf00d")


def test_a_host_step_runs_on_the_host_with_a_cleared_environment(tmp_path: Path) -> None:
    _, _, plan = plan_for(tmp_path, SUDO_HOST)
    ct, uname, gpu = plan.steps
    assert ct.check is not None and ct.check.argv[:5] == ("sudo", "-n", "--", "/usr/sbin/pct", "exec")
    assert not ct.on_host and uname.on_host and gpu.on_host
    assert uname.verify is not None
    argv = uname.verify.argv
    # No pct, no sudo (that is for pct only): the host's own bash, its environment cleared and named.
    assert argv[:5] == (ENV, "-i", "HOME=/home/ops", "LANG=C.UTF-8",
                        "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin")
    assert "pct" not in " ".join(argv[:-2]) and not any(a.startswith("VIRTUAL_ENV=") for a in argv)
    assert argv[-1] == "fleetcuda:host-uname@feedf00d" and argv[-2].endswith("uname -r")
    assert uname.verify.remote is not None and uname.verify.remote.startswith("/usr/bin/env -i HOME=/home/ops ")
    # The GPU check looks into the container through the same pct exec as any step, and reads its config.
    script = gpu.verify.argv[-2]  # type: ignore[union-attr]
    assert script.startswith("python3 - --container-probe ")
    words = shlex.split(script.split("\n", 1)[0])
    probe = json.loads(words[3])
    assert probe[:9] == ["sudo", "-n", "--", "/usr/sbin/pct", "exec", "200", "--", ENV, "-i"]
    assert probe[-2] == catalog()["gpu_container_probe"].text and probe[-1] == "fleetcuda:gpu@feedf00d"
    assert words[4] == "--pct-config" and json.loads(words[5]) == ["sudo", "-n", "--", "/usr/sbin/pct", "config", "200"]


def test_without_containers_the_host_is_the_target(tmp_path: Path) -> None:
    _, _, plan = plan_for(tmp_path, LOCAL)
    ct, uname, gpu = plan.steps
    assert not uname.on_host and not gpu.on_host  # one place: nothing to tell apart
    assert uname.verify is not None and uname.verify.argv[0] == ENV and uname.verify.remote is None
    script = gpu.verify.argv[-2]  # type: ignore[union-attr]
    words = shlex.split(script.split("\n", 1)[0])
    assert "--pct-config" not in words  # no container config to read
    probe = json.loads(words[3])
    assert probe[:2] == [ENV, "-i"]


@pytest.mark.parametrize("shell", list(SHELLS))
def test_a_host_steps_command_survives_each_login_shell(tmp_path: Path, shell: str) -> None:
    need(tuple(SHELLS.values()), "the quoting tests")
    _, _, plan = plan_for(tmp_path, SUDO_HOST)
    for step in plan.steps[1:]:
        cmd = step.verify
        assert cmd is not None and cmd.remote is not None
        # sshd runs `<login shell> -c <string>`: printf shows the words that shell makes of it.
        res = subprocess.run([SHELLS[shell], "-c", "printf '%s\\0' " + cmd.remote], capture_output=True,
                             env={"PATH": "/usr/bin:/bin"})
        assert res.returncode == 0, res.stderr
        assert res.stdout.decode().split("\0")[:-1] == list(cmd.argv)


def test_the_dry_run_shows_host_steps_on_the_host(tmp_path: Path) -> None:
    recipe, inv, _ = plan_for(tmp_path, SUDO_HOST)
    programs = {n: p.text for n, p in catalog().items()}
    data = json.loads(view.render("json", recipe, inv, inv.targets, {}, lambda t: None, programs, run_id="feedf00d"))
    (target,) = data["targets"]
    assert [s["runs_on"] for s in target["steps"]] == ["target", "host", "host"]
    assert target["steps"][2]["scripts"]["verify"]["runs_on"] == "host"
    assert set(target["steps"][2]["scripts"]["verify"]["programs"]) == {"gpu_passthrough", "gpu_container_probe"}
    # Two host checks: one round trip of their own on the host, without the container's lock.
    trips = [t["what"] for t in target["round_trips"]]
    assert trips[:2] == ["lock-acquire", "host-checks"]
    host_batch = target["round_trips"][1]["script"]
    assert host_batch["runs_on"] == "host" and "pct exec" not in target["round_trips"][1]["line"].split(" -c ")[0]
    human = view.render("human", recipe, inv, inv.targets, {}, lambda t: None, programs, run_id="feedf00d",
                        verbose=True)
    block = re.sub(r"\n +\+ \| ", "", human[human.index("step 3/3 gpu"):])  # lines unwrapped
    assert "runs on the host, through its login shell; label fleetcuda:gpu@feedf00d" in block
    assert "in the batch of host checks above" in block
    assert "<program gpu_container_probe sha256:" in block and "<program gpu_passthrough sha256:" in block


def test_a_driver_mismatch_is_drift_in_verify_with_what_to_do(tmp_path: Path) -> None:
    engine, fake = make_engine(tmp_path, STEPS, mode="verify", inventory=SUDO_HOST.replace("ops", "root")
                               .replace("    sudo: true\n", ""))
    fake.on(step="gpu", phase="verify", reply=exit_with(1, "ok   host driver 580.159.04 (from /proc)\n" + DRIFT))
    [result] = engine.run()
    assert result.status == TargetStatus.DRIFT
    gpu = result.steps[2]
    assert gpu.status == StepStatus.DRIFT and gpu.found == DRIFT[:300]
    assert gpu.expected.startswith("host driver = the container's libcuda/libnvidia-ml version")
    # The container's one check on its own in the container; the host's two in one batch on the host.
    assert {(c.step, c.place) for c in fake.calls if c.batched} == {("host-uname", None), ("gpu", None)}
    assert {(c.step, c.place) for c in fake.calls if not c.batched} == {("in-ct", 200), ("host-steps", None)}


def test_one_host_step_is_sent_on_its_own_on_the_host(tmp_path: Path) -> None:
    steps = STEPS.split("  - name: gpu")[0]
    engine, fake = make_engine(tmp_path, steps + "  - name: in-ct2\n    check: test -e /etc/ct2\n", mode="verify",
                               inventory=SUDO_HOST.replace("ops", "root").replace("    sudo: true\n", ""))
    fake.on(step="host-uname", phase="verify", reply=ok("6.8.12-4-pve"))
    [result] = engine.run()
    assert result.status == TargetStatus.OK
    [call] = fake.calls_for(step="host-uname")
    assert call.place is None and not call.batched
    assert result.steps[1].found == "6.8.12-4-pve"


def test_a_host_step_may_not_export_into_the_container(tmp_path: Path) -> None:
    from fleetcuda.errors import InputError
    with pytest.raises(InputError, match="a step on the host cannot"):
        plan_for(tmp_path, SUDO_HOST, "  - name: x\n    kind: env_file\n    on: host\n    path: /etc/x\n"
                 "    vars: {A: b}\n")


def test_the_planned_check_runs_here_against_this_machines_driver(tmp_path: Path) -> None:
    """The planned command for real, on a machine without containers: here (no NVIDIA driver) it fails and
    says so; on the H200 it passes against the real driver."""
    _, _, plan = plan_for(tmp_path, LOCAL, "  - name: gpu\n    kind: gpu_passthrough\n    cuda_version: '13.0'\n")
    cmd = plan.steps[0].verify
    assert cmd is not None
    res = subprocess.run(list(cmd.argv), input=cmd.stdin, capture_output=True, text=True, timeout=120)
    out = res.stdout.strip().splitlines()
    if Path("/proc/driver/nvidia/version").exists():
        assert out[0].startswith("ok   host driver "), res.stdout
    else:
        assert res.returncode == 1, res.stdout + res.stderr
        assert out[0].startswith("FAIL no NVIDIA driver on the host") or "nvidia-smi" in out[0]


def test_the_ansible_export_leaves_host_steps_out(tmp_path: Path) -> None:
    from fleetcuda.export.ansible import build_export

    recipe, inv, _ = plan_for(tmp_path, SUDO_HOST)
    exp = build_export(recipe, inv.targets, {})
    (host,) = exp.hosts
    assert list(host.steps) == ["in-ct"]  # its connection runs commands in the container only
