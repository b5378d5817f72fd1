"""`fleetcuda export ansible` on local targets: the files (modes, marker, no secret in clear, the planner's exact
argv), and the hostile values of tests/test_template_contexts.py, tests/test_redteam_round2.py and
tests/test_quoting.py run through the exported playbook by a real ansible-playbook."""

from __future__ import annotations

import json
import stat
import subprocess
import textwrap
from pathlib import Path

import pytest
import yaml

from fleetcuda.plan.command import target_argv
from fleetcuda.plan.inventory import load_inventory
from fleetcuda.plan.planner import base_values, make_plan
from fleetcuda.plan.recipe import load_recipe
from fleetcuda.plan.templating import TemplateError, render_shell
from tests.ansible_export import ansible_playbook, export, playbook
from tests.test_redteam_round2 import INJECTION_CONTEXTS, LATER_EVALUATED
from tests.test_template_contexts import EXPANDING, HOSTILE

LOCAL = "hosts:\n  h:\n    kind: local\n"


class _UnsafeLoader(yaml.SafeLoader):
    pass


_UnsafeLoader.add_constructor("!unsafe", lambda loader, node: (
    loader.construct_sequence(node) if isinstance(node, yaml.SequenceNode) else loader.construct_mapping(node)))


def _files(tmp_path: Path, recipe: str, inventory: str = LOCAL) -> tuple[Path, Path]:
    r = tmp_path / "r.yaml"
    r.write_text(textwrap.dedent(recipe))
    i = tmp_path / "i.yaml"
    i.write_text(inventory)
    return r, i


@pytest.fixture(scope="module")
def ansible() -> Path:
    return ansible_playbook()


def test_files_are_private_hold_the_planners_argv_and_a_rerun_replaces_them(tmp_path: Path) -> None:
    r, i = _files(tmp_path, """\
        name: r
        vars: {x: "a b"}
        steps:
          - name: s
            check: test -f /nonexistent
            apply: printf %s {{ x }}
        """)
    out = tmp_path / "out"
    done = export(str(r), "-i", str(i), "-o", str(out))
    assert done.returncode == 0, done.stderr
    assert stat.S_IMODE(out.stat().st_mode) == 0o700
    for path in out.rglob("*"):
        assert stat.S_IMODE(path.stat().st_mode) == (0o700 if path.is_dir() else 0o600), path
    assert {"inventory.yml", "site.yml", "verify.yml", "README.md", "ansible.cfg"} <= {p.name for p in out.iterdir()}
    host_vars = yaml.load((out / "host_vars" / "h.yml").read_text(), Loader=_UnsafeLoader)
    recipe, inv = load_recipe(r), load_inventory(i)
    target = inv.targets[0]
    plan = make_plan(recipe, target, base_values(recipe, target, {}), run_id="ansible")
    assert host_vars["fleetcuda_steps"]["s"]["apply"]["argv"] == list(plan.steps[0].apply.argv)
    assert host_vars["fleetcuda_steps"]["s"]["apply"]["argv"][:2] == ["/usr/bin/env", "-i"]
    assert host_vars["fleetcuda_steps"]["s"]["check"]["argv"] == target_argv(plan.steps[0].pre_probe)
    # A second export replaces the first; a directory that is no export is refused.
    assert export(str(r), "-i", str(i), "-o", str(out)).returncode == 0
    other = tmp_path / "other"
    other.mkdir()
    (other / "mine.txt").write_text("keep")
    refused = export(str(r), "-i", str(i), "-o", str(other))
    assert refused.returncode == 2 and "not empty" in refused.stderr
    assert (other / "mine.txt").read_text() == "keep"


def test_auto_fact_is_refused_with_what_to_pass(tmp_path: Path) -> None:
    r, i = _files(tmp_path, """\
        name: r
        vars: {v: auto}
        facts: {v: "echo 1.2"}
        steps:
          - name: s
            verify: test {{ v }} = 1.2
        """)
    refused = export(str(r), "-i", str(i), "-o", str(tmp_path / "out"))
    assert refused.returncode == 2
    assert "v is `auto`" in refused.stderr and "--var v=VALUE" in refused.stderr
    assert export(str(r), "-i", str(i), "--var", "v=1.2", "-o", str(tmp_path / "out")).returncode == 0


def _expanding_script(value_var: str, value: str, outdir: Path) -> str:
    """Every quoting context of test_template_contexts that accepts `value`, each writing what bash saw."""
    parts = []
    for n, (template, _) in enumerate(EXPANDING.values()):
        template = template.replace("{{ x }}", "{{ " + value_var + " }}")
        try:
            render_shell(template, {value_var: value})
        except TemplateError:
            continue  # refused at load in fleetcuda too (a subscript, `[` inside [[ ]])
        parts.append(f"{{\n{template}\n}} > {outdir}/{value_var}-{n}")
    return "\n".join(parts) + "\n"


def test_hostile_values_through_the_exported_playbook_run_nothing_and_arrive_exact(tmp_path: Path,
                                                                                   ansible: Path) -> None:
    outdir = tmp_path / "seen"
    outdir.mkdir()
    pwned = tmp_path / "pwned"
    values = {f"x{i}": h.format(p=str(pwned)) for i, h in enumerate(HOSTILE)}
    steps = [{"name": f"hostile-{k}", "verify": _expanding_script(k, v, outdir)} for k, v in values.items()]
    # test_redteam_round2: values bash would evaluate as code in arithmetic, names or later-evaluated strings.
    # (`a[$(...)]` itself is refused at load, by fleetcuda and by the export: see the next test.)
    for n, (name, script) in enumerate({**INJECTION_CONTEXTS, **LATER_EVALUATED}.items()):
        if name == "compound_array_assignment":
            # `arr=(["${fc_n}"]=1)` runs a `$(...)` value under fleetcuda itself too (bash evaluates the subscript
            # again): a finding of the export's tests for templating, not something the export can change.
            continue
        try:
            render_shell(script, {"n": f"$(touch {pwned})"})
        except TemplateError:
            continue
        # A value bash refuses as a number ends the script: its own subshell, so the step still passes.
        body = script.replace("{{ n }}", "{{ n1 }}")
        steps.append({"name": f"redteam-{n}", "verify": f"(\n{body}\n) >/dev/null 2>&1\ntrue\n"})
    recipe = {"name": "hostile", "vars": {**{k: "1" for k in values}, "n1": "1"},
              "steps": steps}
    r, i = _files(tmp_path, json.dumps(recipe))
    overrides = [f"{k}={v}" for k, v in values.items()] + [
        f"n1=$(touch {pwned})"]
    project = tmp_path / "project"
    args = [str(r), "-i", str(i), "-o", str(project)]
    for o in overrides:
        args += ["--var", o]
    done = export(*args)
    assert done.returncode == 0, done.stderr
    run = playbook(ansible, project, "site.yml")
    assert run.rc == 0, run.output[-3000:]
    assert run.recap["h"]["failed"] == 0
    assert not pwned.exists(), "a hostile value ran a command through the exported playbook"
    checked = 0
    for k, value in values.items():
        for n, (name, (_, expected)) in enumerate(EXPANDING.items()):
            path = outdir / f"{k}-{n}"
            if path.exists():
                assert path.read_bytes() == expected(value).encode(), (name, value)
                checked += 1
    assert checked > len(values) * len(EXPANDING) // 2


@pytest.mark.parametrize("context", list(INJECTION_CONTEXTS))
def test_a_value_bash_would_evaluate_as_a_subscript_is_refused_as_fleetcuda_refuses_it(context: str,
                                                                                      tmp_path: Path) -> None:
    pwned = tmp_path / "pwned"
    r, i = _files(tmp_path, json.dumps({"name": "r", "vars": {"n": "1"},
                                        "steps": [{"name": "s", "verify": INJECTION_CONTEXTS[context]}]}))
    done = export(str(r), "-i", str(i), "--var", f"n=a[$(touch {pwned})]", "-o", str(tmp_path / "out"))
    assert done.returncode == 2 and "refused" in done.stderr, done.stderr
    assert not (tmp_path / "out").exists() and not pwned.exists()


NASTY_SCRIPTS = ["printf %s '$HOME `id` $(id) \\ \" !! ~ * # = ; & | < > ( ) { } [ ]'",
                 "printf %s $'tab\\there\\nnewline é ☃ 😀 \\x01'", "printf '%s' -n", "printf %s ''"]


def test_scripts_reach_bash_byte_for_byte_and_secrets_only_on_stdin(tmp_path: Path, ansible: Path) -> None:
    """tests/test_quoting.py's kinds of scripts, and a secret with quotes, `$` and `;` in it: the step sees it
    exactly, it is in no exported file, and it came from a variable given at run time."""
    outdir = tmp_path / "seen"
    outdir.mkdir()
    pwned = tmp_path / "pwned"
    secret = f"s3'cr\"et $ (touch {pwned}); $ \\ end"  # no `$(`, refused at load (tests/test_arith_values.py)
    steps = [{"name": f"nasty-{n}", "verify": f"{{\n{script}\n}} > {outdir}/nasty-{n}"}
             for n, script in enumerate(NASTY_SCRIPTS)]
    steps.append({"name": "with-secret", "env": {"API_TOKEN": "{{ api_token }}"},
                  "check": f"test -f {outdir}/secret",
                  "apply": f'printf %s "$API_TOKEN" > {outdir}/secret\n'
                           f'printf %s {{{{ api_token }}}} > {outdir}/secret2'})
    r, i = _files(tmp_path, json.dumps({"name": "q", "vars": {"api_token": "placeholder"}, "secrets": ["api_token"],
                                        "steps": steps}, ensure_ascii=False))
    project = tmp_path / "project"
    done = export(str(r), "-i", str(i), "--var", f"api_token={secret}", "-o", str(project))
    assert done.returncode == 0, done.stderr
    for path in project.rglob("*"):
        if path.is_file():
            assert "s3'cr" not in path.read_text() and "placeholder" not in path.read_text(), path
    secret_var = json.dumps({"fleetcuda_secret_api_token": secret})
    run = playbook(ansible, project, "site.yml", "-e", secret_var)
    assert run.rc == 0, run.output[-3000:]
    assert secret not in run.output  # no_log
    assert (outdir / "secret").read_text() == secret and (outdir / "secret2").read_text() == secret
    assert not pwned.exists()
    for n, script in enumerate(NASTY_SCRIPTS):
        expected = subprocess.run(["/bin/bash", "--noprofile", "--norc", "-c", script], capture_output=True).stdout
        assert (outdir / f"nasty-{n}").read_bytes() == expected, script
    again = playbook(ansible, project, "site.yml", "-e", secret_var)
    assert again.rc == 0 and again.recap["h"]["changed"] == 0, again.output[-2000:]
    assert playbook(ansible, project, "verify.yml", "-e", secret_var).rc == 0
    (outdir / "secret").unlink()  # drift: every step is still verified, the drifted one fails the host
    drift = playbook(ansible, project, "verify.yml", "-e", secret_var)
    assert drift.rc != 0 and drift.recap["h"]["failed"] == 1 and "drift: with-secret" in drift.output
    assert drift.output.count(": verify] ") == len(steps)
