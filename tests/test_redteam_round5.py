"""Red team round 5: each test reproduces a broken promise of `discover --write`, the `gpu_passthrough` step kind,
`apply --canary/--serial` or `doctor --model`, in this process (the fake connector) or with a real local shell.
They are meant to fail until the product is fixed."""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fleetcuda.connectors.fake import FakeTransport
from fleetcuda.errors import InputError
from fleetcuda.plan.inventory import load_inventory
from fleetcuda.plan.model import read_model
from tests.conftest import REPO
from tests.discover_support import DEV_CONFIG, VENV_TORCH, envs_reply, pct_list, script
from tests.test_discover import cli

# -- A. discover --write ------------------------------------------------------------------------------------------


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeTransport:
    """One fake connector answers every host (as tests/test_discover.py's fixture)."""
    import fleetcuda.cli.common as common

    transport = FakeTransport()
    monkeypatch.setattr(common, "transport_factory", lambda inventory: (lambda host: transport))
    return transport


def one_new_container(fake: FakeTransport) -> None:
    """Every host answers: 200 running, GPU passthrough, a venv with torch (a target to add)."""
    script(fake, pct_list((200, "running", "", "train-0")), {200: DEV_CONFIG.format(name="train-0", vmid=200)},
           {200: envs_reply(VENV_TORCH)})


def assert_added_or_refused(tmp_path: Path, inv: Path, before: str, code: int, err: str) -> None:
    """What the promise allows: pve1/200 added where it belongs (and nothing else), or an input error naming the
    file, line and field; never discover's own "this is a bug"."""
    assert "a bug of discover" not in err, err
    if code == 2:
        assert f"{inv}:" in err and "hosts.pve1" in err, err
        assert inv.read_text() == before
        return
    assert code == 0, err
    ids = {t.id for t in load_inventory(inv).targets}
    assert "pve1/200" in ids and "pve0/200" not in ids, inv.read_text()


# An anchor on one host's scalar, its alias as the last value of the host discover adds to: yaml.compose gives the
# alias the anchored node itself, whose marks are pve0's, so the `containers:` block is inserted into pve0.
ALIAS_LAST_SCALAR = """\
hosts:
  pve0:
    address: 10.9.0.9
    user: &u root
  pve1:
    address: 10.9.0.1
    user: *u
"""

# The same with a container's own block: the alias of another host's container as the last container.
ALIAS_LAST_CONTAINER = """\
hosts:
  pve0:
    address: 10.9.0.9
    containers:
      100: &ct
        venv: /root/venv
  pve1:
    address: 10.9.0.1
    containers:
      101: *ct
"""

# A top-level variable's anchor, its alias in the last container's vars: the block lands inside `vars:`.
ALIAS_IN_VARS = """\
vars:
  who: &who ops
hosts:
  pve1:
    address: 10.9.0.1
    containers:
      101:
        venv: /root/venv
        vars:
          owner: *who
"""


@pytest.mark.parametrize("text", [ALIAS_LAST_SCALAR, ALIAS_LAST_CONTAINER, ALIAS_IN_VARS],
                         ids=["alias-scalar", "alias-container", "alias-in-vars"])
def test_discover_write_with_an_alias_last_in_the_block(tmp_path: Path, fake: FakeTransport,
                                                        text: str) -> None:
    # repro: `fleetcuda discover pve1 -i inv.yaml --write inv.yaml` where pve1's last value is `*alias`
    inv = tmp_path / "inv.yaml"
    inv.write_text(text)
    assert load_inventory(inv).targets is not None  # a valid inventory
    one_new_container(fake)
    res = cli(tmp_path, "discover", "pve1", "-i", inv, "--write", inv)
    assert_added_or_refused(tmp_path, inv, text, res.code, res.err)


def test_discover_write_into_a_file_with_one_crlf_line(tmp_path: Path, fake: FakeTransport) -> None:
    # repro: an LF inventory whose first comment line ends in CRLF (pasted from Windows); merge splits the text on
    # "\r\n" only, YAML counts every line break, so the insertion index is off by the LF lines.
    text = ("# fleet (from the wiki)\r\nhosts:\n  pve1:\n    address: 10.9.0.1\n    containers:\n      100:\n"
            "        venv: /opt/v\n  pve2:\n    address: 10.9.0.2\n")
    inv = tmp_path / "inv.yaml"
    inv.write_bytes(text.encode())
    one_new_container(fake)
    res = cli(tmp_path, "discover", "pve1", "-i", inv, "--write", inv)
    assert_added_or_refused(tmp_path, inv, text, res.code, res.err)
    assert inv.read_bytes().startswith(b"# fleet (from the wiki)\r\nhosts:\n")  # the user's bytes kept


def test_discover_write_after_a_value_holding_a_unicode_line_separator(tmp_path: Path,
                                                                       fake: FakeTransport) -> None:
    # repro: a host var `motd: "cafe\u2028two"` (U+2028 is a YAML line break, not a "\n"): every YAML line after it
    # is one off from text.split("\n"), and the container lands inside the next host.
    text = ("hosts:\n  pve1:\n    address: 10.9.0.1\n    vars:\n      motd: \"caf\u00e9\u2028two\"\n    containers:\n"
            "      100:\n        venv: /opt/v\n  pve2:\n    address: 10.9.0.2\n")
    inv = tmp_path / "inv.yaml"
    inv.write_text(text, encoding="utf-8")
    assert {t.id for t in load_inventory(inv).targets} == {"pve1/100", "pve2"}
    one_new_container(fake)
    res = cli(tmp_path, "discover", "pve1", "-i", inv, "--write", inv)
    assert_added_or_refused(tmp_path, inv, text, res.code, res.err)


# -- B. gpu_passthrough ------------------------------------------------------------------------------------------

sys.path.insert(0, str(REPO / "fleetcuda" / "remote"))
import gpu_passthrough  # noqa: E402

PROC_580 = ("NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.65.06  Release Build  "
            "(dvs-builder@U16-I3-B03-4-3)  Sun Jul 27 06:54:38 UTC 2025\n")


def _gpu(tmp_path: Path, ldconfig_lines: list[str], proc: str = PROC_580, cuda: str = "13.0") -> tuple[int, str]:
    """gpu_passthrough.main on this machine (no containers), the probe run for real by bash, with an `ldconfig`
    that prints `ldconfig_lines` (as `ldconfig -p` does) ahead of PATH."""
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    ldc = bindir / "ldconfig"
    ldc.write_text("#!/bin/sh\ncat <<'EOF'\n" + "".join(f"\t{line}\n" for line in ldconfig_lines) + "EOF\n")
    ldc.chmod(0o755)
    (tmp_path / "version").write_text(proc)
    probe = str(REPO / "fleetcuda" / "remote" / "gpu_container_probe.sh")
    argv = ["--container-probe", json.dumps(["env", f"PATH={bindir}:/usr/bin:/bin", "bash", probe]),
            "--proc-version", str(tmp_path / "version"), "--require-devices", "false", "--cuda-version", cuda]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = gpu_passthrough.main(argv)
    return rc, out.getvalue()


def test_gpu_dangling_libcuda_link_is_not_a_library(tmp_path: Path) -> None:
    # repro: in the container libcuda.so.1 -> libcuda.so.580.65.06, but that file is gone (a half-removed driver,
    # a stale ldconfig cache); `readlink -f` still names it, so the check says "libcuda.so is 580.65.06" and passes.
    lib = tmp_path / "lib"
    lib.mkdir()
    for name in ("libcuda.so", "libnvidia-ml.so"):
        (lib / f"{name}.1").symlink_to(f"{name}.580.65.06")  # dangling
    rc, out = _gpu(tmp_path, [f"libcuda.so.1 (libc6,x86-64) => {lib}/libcuda.so.1",
                              f"libnvidia-ml.so.1 (libc6,x86-64) => {lib}/libnvidia-ml.so.1"])
    assert rc != 0, out
    assert "FAIL" in out and "libcuda.so" in out


def test_gpu_cuda_version_without_a_minor_is_still_checked(tmp_path: Path) -> None:
    # repro: `cuda_version: "13"` with a 570 driver: the step says "whether the driver supports it is not checked"
    # (info) and passes, though CUDA 13 needs a 580 driver. A value it cannot check should fail or be refused.
    lib = tmp_path / "lib"
    lib.mkdir()
    for name in ("libcuda.so", "libnvidia-ml.so"):
        (lib / f"{name}.570.172.08").write_text("")
        (lib / f"{name}.1").symlink_to(f"{name}.570.172.08")
    proc = PROC_580.replace("580.65.06", "570.172.08")
    rc, out = _gpu(tmp_path, [f"libcuda.so.1 (libc6,x86-64) => {lib}/libcuda.so.1",
                              f"libnvidia-ml.so.1 (libc6,x86-64) => {lib}/libnvidia-ml.so.1"], proc=proc, cuda="13")
    assert rc != 0, out


# -- D. doctor --model -----------------------------------------------------------------------------------------


def _config(tmp_path: Path, text: str) -> str:
    path = tmp_path / "config.json"
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize("text, field", [
    # repro: layer_types holding an object or a list: `t not in PATHS` raises TypeError (unhashable)
    ('{"model_type": "qwen3_next", "layer_types": [{}]}', "layer_types[0]"),
    ('{"model_type": "qwen3_next", "layer_types": [["linear_attention"]]}', "layer_types[0]"),
    ('{"model_type": "qwen3_5", "text_config": {"layer_types": ["full_attention", {"a": 1}]}}',
     "text_config.layer_types[1]"),
], ids=["object", "list", "nested-object"])
def test_model_unhashable_layer_type_is_an_input_error(tmp_path: Path, text: str, field: str) -> None:
    with pytest.raises(InputError) as err:
        read_model(_config(tmp_path, text))
    assert err.value.field == field


def test_model_deeply_nested_json_is_an_input_error(tmp_path: Path) -> None:
    # repro: config.json {"model_type": ..., "x": [[[[...]]]]} 100000 deep: json raises RecursionError, a traceback
    text = '{"model_type": "qwen3_next", "num_hidden_layers": 4, "x": ' + "[" * 100000 + "]" * 100000 + "}"
    with pytest.raises(InputError):
        read_model(_config(tmp_path, text))


def test_model_a_5000_digit_number_is_an_input_error(tmp_path: Path) -> None:
    # repro: "num_hidden_layers": 1000...0 (5000 digits): json raises ValueError (int max str digits), not caught
    text = '{"model_type": "qwen3_next", "num_hidden_layers": 1' + "0" * 5000 + "}"
    with pytest.raises(InputError) as err:
        read_model(_config(tmp_path, text))
    assert err.value.line == 1


def test_model_huge_layer_count_is_refused_not_built(tmp_path: Path) -> None:
    # repro: "num_hidden_layers": 1000000000000 without layer_types: read_model builds a tuple of 10**12 layer
    # types (hangs, then runs out of memory) instead of saying the count is not a model's.
    path = _config(tmp_path, '{"model_type": "qwen3_next", "num_hidden_layers": 1000000000000}')
    code = ("import resource, sys\n"
            "resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))\n"
            "from fleetcuda.errors import InputError\n"
            "from fleetcuda.plan.model import read_model\n"
            "try:\n    m = read_model(sys.argv[1])\nexcept InputError as e:\n    print('INPUT', e)\n"
            "else:\n    print('LAYERS', m.layers)\n")
    try:
        res = subprocess.run([sys.executable, "-c", code, path], capture_output=True, text=True, timeout=6,
                             env={**os.environ, "PYTHONPATH": str(REPO)})
    except subprocess.TimeoutExpired:
        pytest.fail("read_model did not return within 6 s for num_hidden_layers 10**12")
    assert res.stdout.startswith("INPUT") and "num_hidden_layers" in res.stdout, res.stdout + res.stderr[-500:]


def test_model_duplicate_keys_are_an_input_error(tmp_path: Path) -> None:
    # repro: {"model_type": "llama", "model_type": "qwen3_next", ...}: json keeps the last, so a config that says two
    # model types (or two layer counts) is read as one of them, silently; the promise lists duplicate keys.
    text = '{"model_type": "llama",\n "model_type": "qwen3_next", "num_hidden_layers": 48,\n "num_hidden_layers": 40}'
    with pytest.raises(InputError) as err:
        read_model(_config(tmp_path, text))
    assert err.value.line is not None


def test_doctor_model_bad_config_is_exit_2_not_an_internal_error(tmp_path: Path) -> None:
    # repro: `fleetcuda doctor --model config.json -i inv.yaml` with "layer_types": [{}]: exit 70 (internal error)
    from tests.test_cli_inprocess import Cli

    (tmp_path / "home").mkdir()
    run = Cli(tmp_path, tmp_path / "state", {"PATH": "/usr/bin:/bin", "COLUMNS": "200"})
    inv = tmp_path / "inv.yaml"
    inv.write_text("hosts:\n  h:\n    kind: local\n")
    cfg = _config(tmp_path, '{"model_type": "qwen3_next",\n "layer_types": [{}]}')
    res = run("doctor", "--model", cfg, "-i", inv)
    assert res.code == 2, res.out + res.err
    assert f"{cfg}:2: layer_types[0]" in res.err



def test_gpu_the_library_the_loader_uses_is_the_one_judged(tmp_path: Path) -> None:
    # repro: `ldconfig -p` lists libcuda.so.1 twice, the loader's (first: 575.57.08) and a stale copy in a later
    # directory (580.65.06); the probe sorts the paths and lib_version keeps the last ldconfig entry, so the check
    # says "libcuda.so is 580.65.06" and passes while every CUDA program loads the 575 library.
    lines = []
    for where, version in (("a", "575.57.08"), ("z", "580.65.06")):
        lib = tmp_path / where
        lib.mkdir()
        for name in ("libcuda.so", "libnvidia-ml.so"):
            (lib / f"{name}.{version}").write_text("")
            (lib / f"{name}.1").symlink_to(f"{name}.{version}")
    for name in ("libcuda.so", "libnvidia-ml.so"):
        lines += [f"{name}.1 (libc6,x86-64) => {tmp_path}/{where}/{name}.1" for where in ("a", "z")]
    rc, out = _gpu(tmp_path, lines)
    assert rc != 0 and "575.57.08" in out, out


def test_gpu_dev_entries_with_path_key_are_passthrough(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # repro: `dev0: path=/dev/nvidia0` (the devN property string with its key written, which discover's pve.py
    # reads as passthrough) makes gpu_passthrough say "container 200 has no GPU passthrough in its config".
    from tests.test_gpu_passthrough import PVE_DEV, Host

    host = Host(tmp_path)
    host.conf.write_text(PVE_DEV.replace("dev0: /dev/nvidia0", "dev0: path=/dev/nvidia0")
                         .replace("dev1: /dev/nvidiactl", "dev1: path=/dev/nvidiactl")
                         .replace("dev2: /dev/nvidia-uvm", "dev2: path=/dev/nvidia-uvm"))
    rc, lines = host.run(capsys)
    assert not any("no GPU passthrough" in line for line in lines), lines
    assert rc == 0, lines


def test_model_error_names_the_line_of_the_field_it_is_about(tmp_path: Path) -> None:
    # repro: a qwen3_next config with a nested object holding the same key first ({"mtp": {"num_hidden_layers": 1}})
    # and a bad top-level "num_hidden_layers": -3 on line 4: the error says line 3 (the nested key's line).
    text = '{\n "model_type": "qwen3_next",\n "mtp": {"num_hidden_layers": 1},\n "num_hidden_layers": -3\n}\n'
    with pytest.raises(InputError) as err:
        read_model(_config(tmp_path, text))
    assert (err.value.line, err.value.field) == (4, "num_hidden_layers")
