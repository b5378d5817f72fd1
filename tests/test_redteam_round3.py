"""Red team round 3: each test reproduces a broken promise of the dry-run, the one plan, the CLI or framing
through the real CLI (local hosts, real bash)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.conftest import REPO, run_fleetcuda

LOCAL = "hosts:\n  h:\n    kind: local\n"


def _files(tmp_path: Path, recipe: str, inventory: str = LOCAL) -> tuple[Path, Path]:
    r = tmp_path / "r.yaml"
    r.write_text(textwrap.dedent(recipe))
    i = tmp_path / "i.yaml"
    i.write_text(inventory)
    return r, i


def _command_lines_with(text: str, proc: subprocess.Popen[str], seconds: float = 20) -> set[str]:
    seen: set[str] = set()
    deadline = time.monotonic() + seconds
    while proc.poll() is None and time.monotonic() < deadline:
        for d in Path("/proc").iterdir():
            if d.name.isdigit():
                try:
                    cmd = (d / "cmdline").read_bytes().decode("utf-8", "replace")
                except OSError:
                    continue
                if text in cmd and "fleetcuda" in cmd and "pytest" not in cmd:
                    seen.add(cmd.replace("\0", " ")[:300])
        time.sleep(0.05)
    proc.communicate(timeout=30)
    return seen


# Promise 1 (docs/dry-run.md): "every value fleetcuda treats as a secret (..., credentials in URLs) is shown as
# `***`, and never travels on a command line: the scripts read it from stdin". A mirror URL with a password in
# an ordinary variable is shown as *** by --dry-run, but apply puts the password on the command line of
# `env -i ... bash -c` (and in the step's environment), so --format shell is not what apply sends either.
@pytest.mark.xfail(strict=True, reason="red team 3: URL password on the command line")
def test_redteam3_url_password_in_plain_variable_is_on_a_command_line(tmp_path: Path) -> None:
    password = "hunter2pass-" + "z" * 8
    r, i = _files(tmp_path, """\
        name: r
        vars:
          mirror: unset
        env:
          MIRROR: "{{ mirror }}"
        steps:
          - name: s
            check: "false"
            apply: "echo {{ mirror }} >/dev/null; sleep 2"
        """, LOCAL + f"    vars:\n      mirror: https://bob:{password}@mirror.example.invalid/simple\n")
    env = {"PATH": "/usr/bin:/bin", "FLEETCUDA_STATE_DIR": str(tmp_path / "s"), "HOME": str(tmp_path),
           "FLEETCUDA_CACHE_DIR": str(tmp_path / "c")}
    dry = run_fleetcuda("apply", str(r), "-i", str(i), "--dry-run", state=tmp_path / "s")
    assert dry.returncode == 0 and password not in dry.stdout  # shown as ***: fleetcuda treats it as a secret
    proc = subprocess.Popen([sys.executable, "-m", "fleetcuda", "apply", str(r), "-i", str(i), "--plain"],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen = _command_lines_with(password, proc)
    assert not seen, f"the URL's password is on a command line while the step runs: {sorted(seen)[:2]}"


# Promise 4: "nothing a target prints can forge framing". The nonce is now read from stdin, but it is still in
# the batch shell's memory: a check running as the same user (root, as checks do) reads it from
# /proc/<batch>/mem, writes a passing `end` and the closing `done` frame into the batch's stdout
# (/proc/<batch>/fd/1), and kills the batch shell before the real frames follow. The batch's exit status (137)
# said it died, yet its frames were believed: a check that exits 1 was reported ok, exit 0.
FORGER = r'''
import os, re, signal, sys
pid, batch = os.getppid(), None
while pid > 1:
    if b"fleetcuda-batch" in open(f"/proc/{pid}/cmdline", "rb").read():
        batch = pid
        break
    pid = int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])
if batch is None:
    sys.exit(1)
found = set()
with open(f"/proc/{batch}/maps") as maps, open(f"/proc/{batch}/mem", "rb", 0) as mem:
    for line in maps:
        if "[heap]" in line or "[stack]" in line:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            mem.seek(lo)
            found.update(re.findall(rb"(?<![0-9a-f])[0-9a-f]{16}(?![0-9a-f])", mem.read(hi - lo)))
out = os.open(f"/proc/{batch}/fd/1", os.O_WRONLY)
for n in found:
    os.write(out, b"\n@@fleetcuda:" + n + b" end 1 0 5\n\n@@fleetcuda:" + n + b" done 2\n")
os.kill(batch, signal.SIGKILL)
sys.exit(1)
'''


def test_redteam3_check_reads_nonce_from_batch_memory_and_forges_its_pass(tmp_path: Path) -> None:
    forger = tmp_path / "forger.py"
    forger.write_text(FORGER)
    r, i = _files(tmp_path, f"""\
        name: r
        steps:
          - name: a
            verify: "true"
          - name: evil
            verify: "{sys.executable} {forger}"
        """)
    proc = run_fleetcuda("verify", str(r), "-i", str(i), "--plain", state=tmp_path / "s", timeout=60)
    assert "evil: ok" not in proc.stdout, "a check that exits 1 is reported ok: " + proc.stdout
    assert proc.returncode == 1, proc.stdout
