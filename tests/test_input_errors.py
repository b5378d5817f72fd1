"""Bad inventory and recipe files: a clear file:line: field: message, exit code 2, never a traceback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from fleetcuda.errors import InputError
from fleetcuda.plan.inventory import load_inventory
from fleetcuda.plan.recipe import load_recipe
from tests.conftest import REPO

GOOD_RECIPE = REPO / "recipes" / "gdn-fastpath.yaml"
GOOD_INVENTORY = REPO / "inventories" / "example.yaml"

INVENTORY_CASES = [
    # (yaml, line, field, message fragment)
    ("hosts:\n  a:\n    address: 10.0.0.1\n    containers:\n      abc: {}\n", 5, "hosts.a.containers.abc.vmid",
     "vmid must be an integer"),
    ("hosts:\n  a:\n    address: 10.0.0.1\n    containers:\n      42: {}\n", 5, "hosts.a.containers.42.vmid",
     "greater than or equal to 100"),
    ("hosts:\n  a:\n    address: 10.0.0.1\n    containers:\n      - vmid: 200\n      - vmid: 200\n", 6,
     "hosts.a.containers[1]", "duplicate vmid 200"),
    ("hosts:\n  a:\n    address: 10.0.0.1\n    containers:\n      200: {}\n      200: {}\n", 6, "",
     "duplicate key 200"),
    ("hosts:\n  a:\n    address: 10.0.0.1\n    prot: 22\n", 4, "hosts.a.prot", "unknown field"),
    ("hosts:\n  a:\n    address: 10.0.0.1\n    port: seventy\n", 4, "hosts.a.port", "valid integer"),
    ("hosts:\n  'a;rm -rf /':\n    address: 10.0.0.1\n", 2, "hosts.a;rm -rf /", "should match pattern"),
    ("hosts:\n  a:\n    address: 10.0.0.1\n    containers:\n      200:\n        name: 'x y'\n", 6,
     "hosts.a.containers.200.name", "should match pattern"),
    ("hosts:\n  a:\n    kind: ssh\n", 2, "hosts.a", "an ssh host needs an address"),
    ("hosts:\n  a:\n    address: 10.0.0.1\n    user: ops\n    containers:\n      200: {}\n", 2, "hosts.a",
     "set `sudo: true`"),
    ("hosts:\n  a:\n    address: 10.0.0.1\n    jump: b\n  b:\n    address: 10.0.0.2\n    jump: a\n", 7,
     "hosts.b.jump", "cycle"),
    ("groups:\n  g1:\n    children: [g2]\n  g2:\n    children: [g1]\nhosts:\n  a:\n    address: h\n", 5,
     "groups.g2.children[0]", "cycle"),
    ("groups:\n  g1:\n    members: [nope]\nhosts:\n  a:\n    address: h\n", 3, "groups.g1.members[0]",
     "is not a host"),
    ("hosts:\n  a:\n    address: h\n    vars:\n      bad-name: 1\n", 5, "hosts.a.vars.bad-name", "pattern"),
    ("hosts: [\n", 2, "", "invalid YAML"),
    ("- just\n- a list\n", 1, "", "an inventory is a mapping"),
    ("hosts:\n  a:\n    address: h\n    identity_file: \"~/.ssh/id\\nx\"\n", 4, "hosts.a.identity_file", "pattern"),
]


@pytest.mark.parametrize(("text", "line", "field", "fragment"), INVENTORY_CASES)
def test_bad_inventory_names_file_line_field(tmp_path: Path, text: str, line: int, field: str,
                                             fragment: str) -> None:
    path = tmp_path / "inv.yaml"
    path.write_text(text)
    with pytest.raises(InputError) as info:
        load_inventory(path)
    err = info.value
    assert (err.file, err.line, err.field) == (str(path), line, field)
    assert fragment in err.message
    assert str(err).startswith(f"{path}:{line}:")


RECIPE_HEAD = "name: r\nvars:\n  v: 1\nsteps:\n"
RECIPE_CASES = [
    (RECIPE_HEAD + "  - name: s\n    apply: touch x\n", 5, "steps[0]", "needs a `check`"),
    (RECIPE_HEAD + "  - name: s\n    check: 'true'\n    tiemout: 5\n", 7, "steps[0].tiemout", "unknown field"),
    (RECIPE_HEAD + "  - name: s\n    kind: apt_pkgs\n", 6, "steps[0].kind", "unknown kind 'apt_pkgs'"),
    (RECIPE_HEAD + "  - name: s\n    check: echo {{ nope }}\n", 6, "steps[0].check", "undefined variable 'nope'"),
    (RECIPE_HEAD + "  - name: s\n    check: 'true'\n  - name: s\n    check: 'true'\n", 7, "steps[1].name",
     "duplicate step name"),
    (RECIPE_HEAD + "  - name: s\n    check: 'true'\n    timeout: -1\n", 7, "steps[0].timeout", "greater than"),
    (RECIPE_HEAD + "  - name: s\n    kind: apt_packages\n    packages: []\n", 7, "steps[0].packages",
     "at least 1 item"),
    (RECIPE_HEAD + "  - name: s\n    check: 'true'\n    when: 'rm -rf /'\n", 7, "steps[0].when", "pattern"),
    ("name: r\nvars:\n  python: /x\nsteps:\n  - name: s\n    check: 'true'\n", 3, "vars.python",
     "set by fleetcuda"),
    ("name: r\nfacts:\n  cuda: nproc\nsteps:\n  - name: s\n    check: 'true'\n", 3, "facts.cuda",
     "declared under `vars`"),
    ("name: r\nsteps: []\n", 2, "steps", "at least 1 item"),
]


@pytest.mark.parametrize(("text", "line", "field", "fragment"), RECIPE_CASES)
def test_bad_recipe_names_file_line_field(tmp_path: Path, text: str, line: int, field: str, fragment: str) -> None:
    path = tmp_path / "recipe.yaml"
    path.write_text(text)
    with pytest.raises(InputError) as info:
        load_recipe(path)
    err = info.value
    assert (err.line, err.field) == (line, field), str(err)
    assert fragment in err.message


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "fleetcuda", *args], capture_output=True, text=True, cwd=REPO,
                          timeout=60)


def test_cli_exits_2_with_the_location_and_no_traceback(tmp_path: Path) -> None:
    bad = tmp_path / "inv.yaml"
    bad.write_text("hosts:\n  a:\n    address: 10.0.0.1\n    containers:\n      abc: {}\n")
    proc = run_cli("apply", str(GOOD_RECIPE), "-i", str(bad), "--dry-run")
    assert proc.returncode == 2
    assert f"{bad}:5: hosts.a.containers.abc.vmid:" in proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    assert proc.stdout == ""


@pytest.mark.parametrize("args", [
    ["apply", "recipes/missing.yaml", "--dry-run"],
    ["apply", str(GOOD_RECIPE), "--limit", "nosuchhost", "--dry-run"],
    ["apply", str(GOOD_RECIPE), "--var", "not a var", "--dry-run"],
    ["apply", str(GOOD_RECIPE), "--var", "venv=/tmp", "--dry-run"],
    ["apply", str(GOOD_RECIPE), "--dry-run", "--check"],
    ["apply", str(GOOD_RECIPE), "--forks", "0"],
    ["frobnicate"],
])
def test_bad_arguments_exit_2(args: list[str]) -> None:
    proc = run_cli(*args)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    assert "fleetcuda" in proc.stderr


def test_yaml_float_versions_keep_their_text(tmp_path: Path) -> None:
    path = tmp_path / "inv.yaml"
    path.write_text("vars:\n  cuda_version: 12.10\nhosts:\n  a:\n    address: h\n")
    assert load_inventory(path).targets[0].vars["cuda_version"] == "12.10"


def test_alias_bomb_is_refused(tmp_path: Path) -> None:
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]" for i in range(1, 7)]
    path = tmp_path / "bomb.yaml"
    path.write_text("\n".join(lines) + "\nhosts: {}\n")
    with pytest.raises(InputError) as info:
        load_inventory(path)
    assert "more than" in info.value.message


def test_merge_keys_may_be_overridden_but_plain_duplicates_may_not(tmp_path: Path) -> None:
    path = tmp_path / "inv.yaml"
    path.write_text("hosts:\n  a: &base\n    address: 10.0.0.1\n    port: 22\n  b:\n    <<: *base\n    port: 2222\n")
    inv = load_inventory(path)
    assert {t.host: t.chain.ssh.port for t in inv.targets} == {"a": 22, "b": 2222}
    path.write_text("hosts:\n  a:\n    address: 10.0.0.1\n    port: 22\n    port: 23\n")
    with pytest.raises(InputError) as info:
        load_inventory(path)
    assert info.value.line == 5 and "duplicate key 'port'" in info.value.message
