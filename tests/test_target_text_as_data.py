"""What came from a target is data at every edge, files included (issue 22, item 5): never rich markup, never a
control or bidi character printed raw or written into a file fleetcuda writes (an inventory's comment).

`cache list` with a fingerprint whose torch version a build target reported as `2.11.0[/]` or `[link=...]`, and
`discover --write` with a `pct list` status holding U+202E or ESC, through `cli.main(argv, env)` in this process.
"""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from fleetcuda.cli import Environment, main
from fleetcuda.connectors.fake import FakeTransport
from fleetcuda.run.wheelcache import WheelCache
from tests.discover_support import DEV_CONFIG, LIST_HEADER, ROW, VENV_TORCH, envs_reply, script

FP = {"package": "causal-conv1d", "version": "1.7.0", "python": "3.11", "abi": "cpython-311-x86_64-linux-gnu",
      "platform": "linux-x86_64", "glibc": "2.36", "torch": "2.11.0+cu128", "torch_cuda": "12.8", "cxx11_abi": "1",
      "nvcc": "12.8", "archs": "upstream"}
CONTROL = ("\x1b", "\u202e", "\x07", "\x9b")


def run(tmp_path: Path, *argv: str | Path, terminal: bool = False, columns: int = 200) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    env = Environment.with_streams(out, err, io.StringIO(""), environ={"COLUMNS": str(columns)}, home=tmp_path,
                                   cwd=tmp_path, state_dir=tmp_path / "state", stdout_is_terminal=terminal)
    try:
        code = main([str(a) for a in argv], env)
    except SystemExit as exc:
        code = int(exc.code or 0)
    return code, out.getvalue(), err.getvalue()


@pytest.mark.parametrize("torch", ["2.11.0[/]", "[link=https://evil.example]2.11.0[/link]", "[bold red]2.11[/]",
                                   "2.11.0\x1b]8;;https://evil.example\x07x", "2.11\u202e0.1"])
@pytest.mark.parametrize("terminal", [False, True])
def test_cache_list_prints_a_targets_version_as_it_is(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, torch: str,
                                                      terminal: bool) -> None:
    monkeypatch.setenv("FLEETCUDA_CACHE_DIR", str(tmp_path / "cache"))
    wheel = tmp_path / "causal_conv1d-1.7.0-cp311-cp311-linux_x86_64.whl"
    wheel.write_bytes(b"PK\x05\x06" + b"\0" * 18)
    WheelCache(tmp_path / "cache").store(wheel, {**FP, "torch": torch}, {"built_on": "h/2[/]00\x1b[2J"})
    code, out, err = run(tmp_path, "cache", "list", terminal=terminal, columns=400)
    assert code == 0, err
    assert "\x1b]8;" not in out  # no terminal hyperlink
    if not terminal:
        assert not any(c in out for c in CONTROL)
        shown = torch.replace("\x1b", "\\x1b").replace("\x07", "\\x07").replace("\u202e", "\\u202e")
        assert shown in out  # the brackets as they are: data, not markup
        assert "h/2[/]00\\x1b[2J" in out


LISTING = LIST_HEADER + ROW % (200, "running", "", "gpu-a") + ROW % (201, "weird", "", "gpu-b")


@pytest.mark.parametrize("status", ["stop\u202eped", "stop\x1b[2Jped", "st[/]op[link=x]"])
def test_discover_write_keeps_a_targets_status_as_data(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       status: str) -> None:
    fake = FakeTransport()
    import fleetcuda.cli.common as common

    monkeypatch.setattr(common, "transport_factory", lambda inventory: (lambda host: fake))
    listing = LIST_HEADER + ROW % (200, "running", "", "gpu-a") + ROW % (201, status, "", "gpu-b")
    script(fake, listing, {200: DEV_CONFIG.format(name="gpu-a", vmid=200), 201: DEV_CONFIG.format(name="gpu-b",
                                                                                                  vmid=201)},
           {200: envs_reply(VENV_TORCH)})
    inv = tmp_path / "inv.yaml"
    inv.write_text("hosts:\n  pve1:\n    address: 10.9.0.1\n    user: ops\n    sudo: true\n")
    code, out, err = run(tmp_path, "discover", "pve1", "-i", inv, "--write", inv)
    assert code == 0, out + err
    written = inv.read_text()
    for text in (out, err, written):
        assert not any(c in text for c in CONTROL), repr(text)
    assert "pve1/201" in out or "201" in out
    assert "201" in written and "gpu-a" in written  # the one it could add, added; the other noted
    from fleetcuda.plan.inventory import load_inventory

    assert [t.id for t in load_inventory(inv).targets] == ["pve1/200"]


def test_doctor_prints_what_a_target_reports_as_data(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from fleetcuda.connectors.base import RunResult
    from fleetcuda.connectors.fake import Call, ok
    from tests.test_cli_doctor_model import frame, probe

    fake = FakeTransport()

    def reply(call: Call) -> RunResult:
        doctor, gate = probe(set())
        doctor["torch"]["version"] = "2.11.0[/]\x1b[2J\u202e[link=https://evil.example]x[/link]"
        return ok(frame(call, "doctor", doctor) + frame(call, "gate", gate))

    fake.on(kind="run", reply=reply)
    import fleetcuda.cli.common as common

    monkeypatch.setattr(common, "transport_factory", lambda inventory: (lambda host: fake))
    inv = tmp_path / "inv.yaml"
    inv.write_text("vars:\n  check_gpu: false\nhosts:\n  h:\n    address: 10.0.0.1\n    containers:\n      201: {}\n")
    code, out, err = run(tmp_path, "doctor", "-i", inv, columns=400)
    assert code in (0, 1), err
    assert not any(c in out for c in CONTROL) and "2.11.0[/]\\x1b[2J\\u202e[link=https://evil.example]x[/link]" in out
