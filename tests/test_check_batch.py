"""The read-only checks of a target in one shell and, for their Python, one interpreter (issue 15): each check
still gets what it gets on its own (exit status, output, environment), and nothing of one check reaches another.

Run for real here: bash, the batch the planner builds, remote/pyserver.py and a venv with a module named torch that
counts its imports (a stand-in made by the test: what is measured is how often it is imported, not what it does).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from fleetcuda.plan.command import target_argv
from fleetcuda.plan.inventory import load_inventory
from fleetcuda.plan.planner import BatchResult, base_values, batch_command, make_plan, parse_batch
from fleetcuda.plan.recipe import load_recipe
from fleetcuda.remote import framing, pyserver

# The same Python question asked every way a recipe asks it.
CHECKS = """\
  - name: argv
    env: {FOO: "bar baz"}
    verify: "{{ python }} -c 'import sys, os; print(sys.argv, os.environ.get(\\"FOO\\"), sorted(os.environ))' a 'b c'"
  - name: heredoc
    verify: |
      {{ python }} - x <<'PY'
      import sys
      print("heredoc", sys.argv, __name__)
      PY
  - name: exit-status
    verify: "{{ python }} -c 'import sys; sys.exit(3)'; echo \\"status $?\\""
  - name: traceback
    verify: "{{ python }} -c 'import no_such_module_here'"
  - name: stdin
    verify: "echo hello | {{ python }} -c 'import sys; print(repr(sys.stdin.read()))'"
  - name: pipeline
    verify: "{{ python }} -c 'print(\\"x\\" * 300000)' | {{ python }} -c 'import sys; print(len(sys.stdin.read()))'"
  - name: system-exit-text
    verify: "{{ python }} -c 'raise SystemExit(\\"boom\\")'"
  - name: module
    verify: "{{ python }} -m json.tool <<< '{\\"a\\": 1}'"
  - name: script
    verify: "printf 'import sys\\\\nprint(sys.argv[1:], __file__)\\\\n' > SCRIPTPATH; {{ python }} SCRIPTPATH q"
  - name: option-isolated
    verify: "{{ python }} -I -c 'import sys; print(sys.flags.isolated)'"
  - name: cwd
    verify: "cd /tmp && {{ python }} -c 'import os; print(os.getcwd())'"
  - name: stderr-order
    verify: "{{ python }} -c 'import sys; print(\\"out\\"); print(\\"err\\", file=sys.stderr)'"
  - name: shell-only
    verify: "echo plain shell; test -d /"
"""


def _venv(tmp_path: Path) -> Path:
    """A venv whose `torch` counts its imports in $COUNT_FILE... no: in a file next to it (the server is started
    with the batch's environment, not a check's)."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = next(venv.glob("lib/python3*/site-packages"))
    torch = site / "torch"
    (torch / "cuda").mkdir(parents=True)
    (torch / "__init__.py").write_text(textwrap.dedent(f"""\
        # test stand-in, NOT torch: counts how many interpreters import it
        import os
        with open({str(tmp_path / 'imports')!r}, "a") as f:
            f.write(f"{{os.getpid()}}\\n")
        from torch import cuda
        """))
    (torch / "cuda" / "__init__.py").write_text("def is_initialized():\n    return False\n")
    return venv


def _plan(tmp_path: Path, steps: str, python: str):
    (tmp_path / "r.yaml").write_text("name: r\nsteps:\n" + steps)
    (tmp_path / "i.yaml").write_text(f"hosts:\n  h:\n    kind: local\n    venv: {Path(python).parent.parent}\n"
                                     f"    python: {python}\n")
    recipe, inventory = load_recipe(str(tmp_path / "r.yaml")), load_inventory(str(tmp_path / "i.yaml"))
    target = inventory.select(None)[0]
    return make_plan(recipe, target, base_values(recipe, target, {}), str(tmp_path))


def _run_batch(plan) -> tuple[dict[int, BatchResult], str]:
    probes = [(s.index, s.verify_probe) for s in plan.steps if s.verify_probe is not None]
    cmd = batch_command(plan, probes)
    proc = subprocess.run(list(cmd.argv), input=cmd.stdin, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return parse_batch(proc.stdout, plan.nonce), cmd.argv[-2]


def _run_alone(probe) -> tuple[int, str]:
    proc = subprocess.run(target_argv(probe), input=probe.stdin, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=120)
    return proc.returncode, proc.stdout.rstrip("\n")


def test_each_python_check_gets_in_the_batch_what_it_gets_on_its_own(tmp_path: Path) -> None:
    venv = _venv(tmp_path)
    plan = _plan(tmp_path, CHECKS.replace("SCRIPTPATH", str(tmp_path / "s.py")), str(venv / "bin" / "python"))
    batch, script = _run_batch(plan)
    assert "fc_py 0" in script  # the batch does send these calls to an interpreter server
    assert sorted(batch) == [s.index for s in plan.steps]
    for step in plan.steps:
        alone = _run_alone(step.verify_probe)
        got = (batch[step.index].rc, batch[step.index].output.rstrip("\n"))
        assert got == alone, step.name
    out = {s.name: batch[s.index].output for s in plan.steps}
    assert "bar baz" in out["argv"] and "'b c'" in out["argv"]
    assert "status 3" in out["exit-status"]
    assert "ModuleNotFoundError: No module named 'no_such_module_here'" in out["traceback"]
    assert "300001" in out["pipeline"] and "'hello\\n'" in out["stdin"]
    assert batch[plan.steps[6].index].rc == 1 and out["system-exit-text"].strip() == "boom"


def test_torch_is_imported_once_for_all_the_python_checks_of_a_batch(tmp_path: Path) -> None:
    venv = _venv(tmp_path)
    steps = "".join(f"  - name: t{i}\n    verify: \"{{{{ python }}}} -c 'import torch, os; print(os.getpid())'\"\n"
                    for i in range(4))
    plan = _plan(tmp_path, steps, str(venv / "bin" / "python"))
    batch, _ = _run_batch(plan)
    assert all(r.rc == 0 for r in batch.values())
    imports = (tmp_path / "imports").read_text().split()
    assert len(imports) == 1, imports  # one interpreter imported it; four checks used it
    pids = {r.output.strip() for r in batch.values()}
    assert len(pids) == 4 and imports[0] not in pids  # each check in a process of its own, none the server


def test_a_check_that_changes_python_state_does_not_change_the_next_one(tmp_path: Path) -> None:
    venv = _venv(tmp_path)
    steps = ("  - name: poison\n    verify: \"{{ python }} -c 'import torch, json; torch.poisoned = 1; "
             "json.dumps = None; import builtins; builtins.print = None'\"\n"
             "  - name: clean\n    verify: \"{{ python }} -c 'import torch, json; "
             "print(hasattr(torch, \\\"poisoned\\\"), json.dumps([1]))'\"\n")
    plan = _plan(tmp_path, steps, str(venv / "bin" / "python"))
    batch, _ = _run_batch(plan)
    assert batch[1].rc == 0 and batch[1].output.strip() == "False [1]"


def test_an_environment_python_reads_at_start_up_runs_the_real_interpreter(tmp_path: Path) -> None:
    venv = _venv(tmp_path)
    extra = tmp_path / "extra"
    extra.mkdir()
    (extra / "onlyhere.py").write_text("print('from PYTHONPATH')\n")
    steps = ("  - name: a\n    verify: \"{{ python }} -c 'import torch'\"\n"
             "  - name: pythonpath\n"
             f"    env: {{PYTHONPATH: {extra}}}\n"
             "    verify: \"{{ python }} -c 'import onlyhere'\"\n")
    plan = _plan(tmp_path, steps, str(venv / "bin" / "python"))
    batch, _ = _run_batch(plan)
    assert batch[1].rc == 0 and batch[1].output.strip() == "from PYTHONPATH"


def test_a_dead_server_means_the_real_interpreter_not_a_hang(tmp_path: Path) -> None:
    venv = _venv(tmp_path)
    steps = ("  - name: kill-server\n    verify: \"kill ${fc_pypid[0]}; sleep 0.2; true\"\n"
             "  - name: after\n    verify: \"{{ python }} -c 'print(42)'\"\n")
    plan = _plan(tmp_path, steps, str(venv / "bin" / "python"))
    batch, _ = _run_batch(plan)
    assert batch[1].rc == 0 and batch[1].output.strip() == "42"


def test_a_check_sees_neither_the_nonce_nor_another_checks_secret_nor_its_variables(tmp_path: Path) -> None:
    venv = _venv(tmp_path)
    (tmp_path / "r.yaml").write_text(textwrap.dedent("""\
        name: r
        vars:
          api_token: s3cr3t-value-123
        steps:
          - name: uses-secret
            env: {TOKEN: "{{ api_token }}"}
            verify: 'test "$TOKEN" = s3cr3t-value-123; leak=1; f() { :; }'
          - name: snoops
            verify: 'set > SETFILE; echo "nonce:${fcn:-unset}"'
        """).replace("SETFILE", str(tmp_path / "set.txt")))
    (tmp_path / "i.yaml").write_text(f"hosts:\n  h:\n    kind: local\n    python: {venv / 'bin' / 'python'}\n")
    recipe, inventory = load_recipe(str(tmp_path / "r.yaml")), load_inventory(str(tmp_path / "i.yaml"))
    target = inventory.select(None)[0]
    plan = make_plan(recipe, target, base_values(recipe, target, {}), str(tmp_path))
    batch, script = _run_batch(plan)
    assert "s3cr3t-value-123" not in script
    assert batch[0].rc == 0 and batch[1].output.strip() == "nonce:unset"
    seen = (tmp_path / "set.txt").read_text()
    assert "s3cr3t-value-123" not in seen and plan.nonce not in seen
    assert not re.search(r"^leak=|^f \(\)", seen, re.M)


def test_a_frame_a_check_writes_past_the_prefix_makes_the_batch_unbelieved() -> None:
    nonce = framing.new_nonce()
    mark = f"{framing.MARK}:{nonce}"
    good = f"\n{mark} begin 0\n| out\n\n{mark} end 0 1 5\n\n{mark} begin 1\n\n{mark} end 1 0 3\n\n{mark} done 2\n"
    assert {i: r.rc for i, r in parse_batch(good, nonce).items()} == {0: 1, 1: 0}
    # Check 1 wrote a passing `end` for check 0 (whose real one said 1) straight into the batch's stdout.
    forged = good.replace(f"{mark} begin 1\n", f"{mark} begin 1\n\n{mark} end 0 0 1\n")
    assert parse_batch(forged, nonce) == {}
    assert parse_batch(good.replace(f"\n{mark} done 2\n", f"\n{mark} done 3\n"), nonce) == {}
    assert parse_batch(good.replace(f"{mark} begin 0\n", f"{mark} begin 0\n\n{mark} begin 0\n"), nonce) == {}


@pytest.mark.parametrize(("argv", "how"), [
    (["-c", "print(1)", "a"], ("code", "print(1)", ["-c", "a"])),
    (["-", "x"], ("stdin", "", ["-", "x"])),
    (["-m", "json.tool", "f"], ("module", "json.tool", ["json.tool", "f"])),
    (["s.py", "1"], ("script", "s.py", ["s.py", "1"])),
    (["-I", "-c", "1"], None), (["-u", "s.py"], None), ([], None), (["-c"], None),
])
def test_the_server_runs_itself_only_what_it_reproduces(argv: list[str], how: tuple | None) -> None:
    assert pyserver.plan_run(argv) == how


def test_the_server_reads_requests_as_the_client_writes_them() -> None:
    data = b"t0k\x000022\x003\x00-c\x00print(1)\x00a b\x00A=1\x00B=x=y\x00EMPTY=\x00"
    assert pyserver.parse_request(data) == ("t0k", "0022", ["-c", "print(1)", "a b"],
                                            {"A": "1", "B": "x=y", "EMPTY": ""})
    assert pyserver.startup_view({"PYTHONPATH": "/x", "PATH": "/bin", "LC_ALL": "C", "HOME": "/root"}) == {
        "PYTHONPATH": "/x", "LC_ALL": "C", "HOME": "/root"}


def test_the_batch_shell_leaves_no_server_and_no_files_behind(tmp_path: Path) -> None:
    venv = _venv(tmp_path)
    plan = _plan(tmp_path, "  - name: a\n    verify: \"{{ python }} -c 1\"\n  - name: b\n    verify: 'true'\n",
                 str(venv / "bin" / "python"))
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    probes = [(s.index, s.verify_probe) for s in plan.steps]
    cmd = batch_command(plan, probes)
    env = {**os.environ, "TMPDIR": str(tmp)}
    argv = [a if not a.startswith("TMPDIR=") else a for a in cmd.argv]
    # TMPDIR reaches the batch only through its own environment: run its script with one.
    script = cmd.argv[-2]
    proc = subprocess.run(["/usr/bin/env", "-i", f"TMPDIR={tmp}", "PATH=/usr/bin:/bin", "LANG=C.UTF-8",
                           f"HOME={tmp_path}", "/bin/bash", "-c", script, "fleetcuda-batch"], input=cmd.stdin,
                          capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 0 and argv
    assert sorted(parse_batch(proc.stdout, plan.nonce)) == [0, 1]
    assert list(tmp.iterdir()) == []
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert not re.search(re.escape(str(venv)) + r".* - .*fleetcuda-py", ps)
