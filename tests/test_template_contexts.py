"""A `{{ }}` value never becomes shell syntax, in whatever quoting context it stands (red team item 1).

Each case renders a script as the planner does, runs it with the real bash (the shell fleetcuda starts in
targets) and checks what a user would: no command hidden in the value ran, and where the shell expands the
value, the script saw exactly the value's bytes.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fleetcuda.plan.command import Invocation, target_argv
from fleetcuda.plan.templating import SHELL_EXPANSION, TemplateError, render_shell

HOSTILE = [
    "$(touch {p})", "`touch {p}`", "'; touch {p}; '", '"; touch {p}; "', "a\ntouch {p}\n", "${{x:-$(touch {p})}}",
    "a[$(touch {p})]", "x'\"'\"'$(touch {p})", "\\$(touch {p})", "$((1))$(touch {p})", "EOF\ntouch {p}\nEOF",
    "!!", "-n", "*", "~root", "=x", "a b\tc", "", "\\", "'", '"', "#", "}}", "{{ x }}", "é$(touch {p})",
]

# Contexts where bash expands the value: (template, what `printf %s` prints given the value).
EXPANDING = {
    "unquoted": ("printf %s {{ x }}", lambda v: v),
    "unquoted in a word": ("printf %s pre{{ x }}post", lambda v: f"pre{v}post"),
    "double quotes": ('printf %s "release {{ x }},"', lambda v: f"release {v},"),
    "command substitution": ('printf %s "$(printf %s {{ x }})"', lambda v: v.rstrip("\n")),
    "command substitution in quotes": ('printf %s "$(printf %s "{{ x }}")"', lambda v: v.rstrip("\n")),
    "backticks": ("printf %s \"`printf %s {{ x }}`\"", lambda v: v.rstrip("\n")),
    "heredoc": ("cat <<EOF\n{{ x }}\nEOF", lambda v: v + "\n"),
    "heredoc with tabs": ("cat <<-EOF\n\t{{ x }}\n\tEOF", lambda v: v + "\n"),
    "case word": ("case {{ x }} in *) printf %s {{ x }};; esac", lambda v: v),
    "test": ('[ -n {{ x }} ] || [ -z {{ x }} ]; printf %s {{ x }}', lambda v: v),
    "assignment": ("v={{ x }}; printf %s \"$v\"", lambda v: v),
    "after a comment": ("# {{ x }}\nprintf %s {{ x }}", lambda v: v),
    "inside [[ ]]": ("[[ {{ x }} == {{ x }} ]] && printf %s {{ x }}", lambda v: v),
}
REFUSED = {
    "single quotes": "printf %s 'release {{ x }}'",
    "ansi-c quotes": "printf %s $'{{ x }}'",
    "quoted heredoc": "cat <<'EOF'\n{{ x }}\nEOF",
    "double-quoted heredoc delimiter": 'cat <<"EOF"\n{{ x }}\nEOF',
    "parameter expansion": 'printf %s "${HOME:-{{ x }}}"',
    "single quotes inside command substitution": "echo \"$(echo '{{ x }}')\"",
}


def run_bash(script: str, shell_vars: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[bytes]:
    argv = target_argv(Invocation(script, {"PATH": "/usr/bin:/bin"}, timeout=None, shell_vars=shell_vars))
    return subprocess.run(argv, capture_output=True, cwd=cwd, timeout=30)


def _payload(template: str, tmp: Path) -> str:
    return template.format(p=str(tmp / "pwned"))


@pytest.mark.parametrize("context", list(EXPANDING))
@pytest.mark.parametrize("hostile", HOSTILE)
def test_expanding_contexts_see_the_exact_value_and_run_nothing(context: str, hostile: str, tmp_path: Path) -> None:
    template, expected = EXPANDING[context]
    value = _payload(hostile, tmp_path)
    if re.search(r"`|\$([(a-zA-Z{]|\Z)", value):  # bash could expand it as a subscript: refused everywhere
        with pytest.raises(TemplateError, match=r"expansion or a backtick"):
            render_shell(template, {"x": value})
        return
    if context == "inside [[ ]]" and "[" in value:
        with pytest.raises(TemplateError, match=r"\[\[ \]\]"):
            render_shell(template, {"x": value})
        return
    rendered = render_shell(template, {"x": value})
    proc = run_bash(rendered.text, rendered.vars, tmp_path)
    assert not (tmp_path / "pwned").exists(), f"{context}: the value ran a command"
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == expected(value).encode(), context


@pytest.mark.parametrize("context", list(REFUSED))
def test_contexts_where_nothing_expands_are_refused(context: str) -> None:
    with pytest.raises(TemplateError, match="expands nothing|set a variable"):
        render_shell(REFUSED[context], {"x": "1"})


def test_arithmetic_takes_integers_only(tmp_path: Path) -> None:
    rendered = render_shell("printf %s $(( {{ n }} * 2 )); (( {{ n }} > 1 )) && printf ' big'", {"n": "21"})
    assert run_bash(rendered.text, rendered.vars, tmp_path).stdout == b"42 big"
    for bad in ["a[$(touch x)]", "1+1", "x", ""]:
        with pytest.raises(TemplateError, match="integer|expansion or a backtick"):
            render_shell("echo $(( {{ n }} + 1 ))", {"n": bad})
        with pytest.raises(TemplateError, match="integer|expansion or a backtick"):
            render_shell("(( {{ n }} ))", {"n": bad})


def test_the_flagship_pattern_is_safe(tmp_path: Path) -> None:
    """The recipe's own `grep -q "release {{ cuda_version }},"`, with the red team's value."""
    value = f"$(touch {tmp_path / 'pwned'})"
    with pytest.raises(TemplateError, match="expansion or a backtick"):  # refused as a whole, at load
        render_shell('echo "Cuda compilation tools, release 12.8, V12.8.93" | grep -q "release {{ v }},"', {"v": value})
    rendered = render_shell('echo "Cuda compilation tools, release 12.8, V12.8.93" | grep -q "release {{ v }},"',
                            {"v": "(touch pwned)"})
    proc = run_bash(rendered.text, rendered.vars, tmp_path)
    assert proc.returncode == 1 and not (tmp_path / "pwned").exists()
    rendered = render_shell('echo "release 12.8, V12" | grep -q "release {{ v }},"', {"v": "12.8"})
    assert run_bash(rendered.text, rendered.vars, tmp_path).returncode == 0


def test_filters_get_their_own_variables(tmp_path: Path) -> None:
    rendered = render_shell("printf '%s ' {{ v }} {{ v | dashed }} {{ v | major }}", {"v": "12.8"})
    assert run_bash(rendered.text, rendered.vars, tmp_path).stdout == b"12.8 12-8 12 "


@settings(max_examples=300, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(value=st.text(st.characters(blacklist_categories=["Cs"], blacklist_characters="\x00"), max_size=40),
       context=st.sampled_from(sorted(EXPANDING)))
def test_any_value_in_any_expanding_context(value: str, context: str, tmp_path: Path) -> None:
    template, expected = EXPANDING[context]
    sentinel = tmp_path / "pwned"
    value = value.replace("TOUCH", f"$(touch {sentinel})")
    try:
        rendered = render_shell(template, {"x": value})
    except TemplateError:
        assert "[" in value or SHELL_EXPANSION.search(value), value
        return
    proc = run_bash(rendered.text, rendered.vars, tmp_path)
    assert not sentinel.exists()
    if context.startswith("heredoc") or "substitution" in context or context == "backticks":
        return  # these strip or add newlines by bash's own rules; what matters is that nothing ran
    assert proc.stdout == expected(value).encode(), (context, value)


@settings(max_examples=300, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(script=st.lists(st.sampled_from([
    "echo ", "'", '"', "$(", ")", "`", "${", "}", "$((", "))", "<<EOF\n", "\nEOF\n", "<<'Q'\n", "\nQ\n", "# ", "\n",
    "[[ ", " ]]", "\\", "{{ x }}", " ", "x", ";", "|", "$'", "((",
]), max_size=25).map("".join))
def test_scanning_arbitrary_text_never_crashes_and_never_runs_the_value(script: str, tmp_path: Path) -> None:
    """Whatever the script's shape, rendering either refuses or yields text where the value is data."""
    sentinel = tmp_path / "pwned"
    try:
        rendered = render_shell(script, {"x": f"$(touch {sentinel})`touch {sentinel}`';touch {sentinel};'"})
    except TemplateError:
        return
    run_bash(rendered.text, rendered.vars, tmp_path)
    assert not sentinel.exists(), script


def test_the_value_is_not_in_the_script_text() -> None:
    """What reaches a target is a variable reference: the value is set once, quoted, before the script."""
    rendered = render_shell('grep -q "release {{ v }},"', {"v": "\"; reboot #"})
    assert "reboot" not in rendered.text and rendered.vars == {"fc_v": "\"; reboot #"}
    assert os.linesep not in rendered.text


@pytest.mark.parametrize("template", [
    "let v={{ n }}+1", "declare -i v={{ n }}", "local -ri v={{ n }}", "a[{{ n }}]=1", "echo $[ {{ n }} + 1 ]",
    'x=1; let "v = {{ n }}"; echo ok', "arr=([{{ n }}]=1)", 'declare -a arr=(["{{ n }}"]=x [2]=y)',
])
def test_other_arithmetic_takes_integers_only(template: str, tmp_path: Path) -> None:
    """bash evaluates these as arithmetic, where `a[$(cmd)]` runs cmd: only integers get through."""
    for hostile in (f"a[$(touch {tmp_path / 'pwned'})]", "M", "x+1"):  # M: a variable holding who knows what
        with pytest.raises(TemplateError, match="integer|expansion or a backtick"):
            render_shell(template, {"n": hostile})
    rendered = render_shell(template, {"n": "3"})
    run_bash("f() {\n" + rendered.text + "\n}; f", rendered.vars, tmp_path)
    assert not (tmp_path / "pwned").exists()


@pytest.mark.parametrize("template", [
    'trap "echo {{ x }}" EXIT', 'PS4="+ {{ x }} "; set -x', 'alias a="echo {{ x }}"', 'mapfile -C "echo {{ x }}" -c 1 a',  # noqa: E501
    'bash -c "echo {{ x }}"', "/bin/sh -c 'echo '{{ x }}", 'sudo -u nobody sh -c "echo {{ x }}"', "eval echo {{ x }}",
])
def test_strings_bash_runs_later_as_code_refuse_values(template: str) -> None:
    with pytest.raises(TemplateError, match="runs as code later"):
        render_shell(template, {"x": "1"})


def test_a_compound_array_assignments_key_is_arithmetic(tmp_path: Path) -> None:
    """`arr=([key]=v)`: bash evaluates the key of an indexed array as arithmetic after expanding it, so a
    value `$(cmd)` there runs cmd even from a quoted variable (found by the export's red team)."""
    pwned = tmp_path / "pwned"
    hostile = f"$(touch {pwned})"
    # What bash does with it when nothing stands in the way: the reason for the refusal below.
    subprocess.run(["bash", "-c", 'v=$1; arr=(["$v"]=1)', "bash", hostile], capture_output=True, timeout=30)
    assert pwned.exists()
    pwned.unlink()
    with pytest.raises(TemplateError, match="integer|expansion or a backtick"):
        render_shell("arr=([{{ n }}]=1)", {"n": hostile})
    rendered = render_shell("arr=([{{ n }}]=1); echo ${arr[3]}", {"n": "3"})
    run_bash(rendered.text, rendered.vars, tmp_path)
    assert not pwned.exists()
