"""No value fleetcuda accepts runs as code where bash evaluates it as a number or a name (issue 22, item 1).

bash evaluates a variable's text as arithmetic wherever a script uses it as a number ([[ -ge ]], (( )), $(( )),
let, declare -i, ...) or as a variable's name (printf -v, ${!v}, declare -n, read NAME, [[ -v ]] ...), and
expands a `name[subscript]` in that text. A script may copy any value into such a variable, so the rule
(templating.check_value) must hold for every value in every such context. A differential fuzzer: values drawn
from the pieces that build expansions (and the outside red team's own), delivered as fleetcuda delivers them
(a `{{ x }}` rendered by render_shell, the variable set by the command builder), run by the real bash in every
context below; a value check_value accepts must never create the sentinel file in any of them.
"""

from __future__ import annotations

import json
import random
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from fleetcuda.plan import templating
from fleetcuda.plan.command import Invocation, target_argv
from fleetcuda.plan.templating import TemplateError, check_value, render_shell
from tests.ansible_export import export

# Every context where bash evaluates a variable's text as arithmetic or as a variable's name; `$w` holds the value.
CONTEXTS = [
    "[[ 1 -ge $w ]]", "[[ $w -eq 1 ]]", "[[ $w -lt 2 ]]", "(( w ))", "(( w > 0 ))", "(( $w ))",
    ": $(( w + 1 ))", ": $(( $w ))", "let 'n = w'", "let n=w", "let \"n=$w\"",
    "declare -i n; n=$w", "declare -i n=\"$w\"", "local -i n 2>/dev/null; typeset -i m; m=$w",
    "declare -i n; read -r n <<<\"$w\"", "printf -v \"$w\" %s 1", "printf -v n %d \"$w\"",
    ": \"${!w}\"", "declare -n ref=\"$w\"; : \"$ref\"", "arr=(1 2); : \"${arr[$w]}\"", "arr=(1 2); : \"${arr[w]}\"",
    "arr[$w]=1", "declare -A h; h[$w]=1; : \"${h[$w]}\"", "[[ -v $w ]]", "[ -v \"$w\" ]", "test -v \"$w\"",
    "unset -v \"$w\"", "unset \"$w\"", "declare \"$w=1\"", "export \"$w=1\"", "read -r \"$w\" <<<1",
    "s=abcdef; : \"${s:$w}\"", "s=abcdef; : \"${s:w:1}\"", "for ((i = 0; i < w && i < 2; i++)); do :; done",
    "[ \"$w\" -eq 1 ]", "printf '%d' \"$w\" >/dev/null", "x=$w; (( x ))", "eval_num() { return $(( $1 )); }; "
    "eval_num \"$w\"", "v=$w; v2=v; (( v2 ))", "a=(); a+=([$w]=1)", "shift \"$w\" 2>/dev/null",
    "mapfile -t \"$w\" </dev/null", "getopts a \"$w\"", "w2=\"a[$w]\"; (( w2 ))",
    # the script writes the subscript around the value, or joins two values (the next one is `$u`)
    "declare -A t=([12.8]=570); ref=\"t[$w]\"; [[ -n \"${!ref}\" ]]", "slot=\"seen[$w]\"; (( slot >= 0 ))",
    "ref=\"t[$w]\"; [[ -v $ref ]]", "c=\"$w$u\"; (( c ))", "c=\"$u$w\"; [[ 1 -ge $c ]]",
    "ref=\"t[$w$u]\"; : \"${!ref}\"", "c=\"$w[$u]\"; (( c ))", "c=\"a[$w$u]\"; (( c ))",
]

# The pieces values are built from: what starts an expansion, the brackets, quotes, escapes and the sentinel.
PIECES = [
    "a", "x", "0", "1", "[", "]", "[", "]", "$(", ")", "`", "$", "${", "}", "\\044", "\\", "@P", "x:?", ":-",
    "'", '"', "$'", " ", "+", "-", "$[", "$((", "))", "<(", "w", "fc_x", "$w", "${w@P}", "${fc_x@P}", "\\140",
    "touch PWN", "touch PWN", ";", "#", "$x", "$0", "$$", "!", "*", "@", "\n", "$\"",
]
SEEDS = [
    # the outside red team's value, and its relatives
    "a[\\044(touch PWN)\\044{x:?}${fc_x@P}]", "a[\\044(touch PWN)]${fc_x@P}", "a[$(touch PWN)]", "a[`touch PWN`]",
    "a[${x:-$(touch PWN)}]", "a[$[$(touch PWN)]]", "a[$((`touch PWN`))]", "a[\\$(touch PWN)]", "a[$'\\044(touch PWN)']",
    "x[y[$(touch PWN)]]", "a]$(touch PWN)[", "a[\\140touch PWN\\140${fc_x@P}]", "w[$w]", "a[${w@P}]",
    "a[$\"$(touch PWN)\"]", "a['$(touch PWN)']", "a[\"$(touch PWN)\"]", "a[ $( touch PWN ) ]",
    "$(touch PWN)", "`touch PWN`", "a[", "$", "x$", "(touch PWN)]",
    # values an operator writes, which must stay accepted
    "12.8", "sm_90", "^torch [0-9]+ $", "http://[::1]:8080/", "[a-z]*", "cuda-[0-9]", "a[1]", "a[b]", "p%24ss",
    "100$ ", "cost: $5", "a[$]",
]
ACCEPTED_EXAMPLES = ["12.8", "sm_90", "http://[::1]:8080/", "[a-z]*", "a[1]", "a[$]", "p%24ss", "cost: 5 $/h"]


def _values(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    values = list(SEEDS)
    while len(values) < n:
        values.append("".join(rng.choice(PIECES) for _ in range(rng.randint(1, 9))))
    return values


def accepted(value: str) -> bool:
    try:
        check_value("x", value)
    except TemplateError:
        return False
    return True


def _script(n: int) -> tuple[str, dict[str, str]]:
    """One bash script running every context for values 0..n-1, each in its own directory and subshells."""
    lines = []
    for i in range(n):
        lines.append(f"mkdir d{i} && cd d{i} || exit 99")
        lines.append(f"w={{{{ x{i} }}}}")  # as a recipe's check would copy the value: want={{ min_cpus }}
        lines.append(f"u={{{{ x{(i + 1) % n} }}}}")  # the next value, for the contexts that join two
        # A CPU-second cap per context: some joins recurse until bash's own limit, slowly, but run nothing.
        lines.extend(f"( ulimit -t 1; {ctx} ) </dev/null >/dev/null 2>&1" for ctx in CONTEXTS)
        lines.append("cd .. || exit 99")
    return "\n".join(lines) + "\n", {}


def _run(values: list[str], cwd: Path) -> list[int]:
    """Indexes of the values whose payload ran (the sentinel appeared in their directory)."""
    text, _ = _script(len(values))
    # `fc_x` in a value names the variable fleetcuda set from it, as the red team's `${fc_min_cpus@P}` did.
    rendered = render_shell(text, {f"x{i}": v.replace("fc_x", f"fc_x{i}") for i, v in enumerate(values)})
    argv = target_argv(Invocation(rendered.text, {"PATH": "/usr/bin:/bin"}, timeout=None,
                                  shell_vars=rendered.vars))
    subprocess.run(argv, cwd=cwd, capture_output=True, timeout=600, check=False)
    return [i for i in range(len(values)) if (cwd / f"d{i}" / "PWN").exists()]


def test_the_outside_red_teams_value_is_refused() -> None:
    with pytest.raises(TemplateError) as exc:
        check_value("{{ min_cpus }}", "a[\\044(touch F)\\044{x:?}${fc_min_cpus@P}]")
    assert "\\044" not in str(exc.value)  # the message describes the value; it never quotes it


def test_values_an_operator_writes_stay_accepted() -> None:
    assert [v for v in ACCEPTED_EXAMPLES if not accepted(v)] == []


def test_the_fuzzer_has_teeth(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the rule, the seeds run their payload in these contexts, and under the earlier deny-list (a `[`
    followed by `$(`, a backtick or a process substitution) some still did: the fuzzer sees a break."""
    earlier = re.compile(r"\[.*(\$\(|`|<\(|>\()", re.S)
    monkeypatch.setattr(templating, "check_value", lambda what, value: None)
    # (Seeds 1 and 11 are left out: their self-referencing `@P` recursion takes a CPU second per context.)
    seeds = [v for i, v in enumerate(SEEDS[:24]) if i not in (1, 11)]
    ran = [seeds[i] for i in _run(seeds, tmp_path)]
    assert len(ran) >= 14, ran
    assert [v for v in ran if not earlier.search(v)], "the earlier rule let no running seed through"
    # No `[` of their own: they run where a script writes the subscript around them.
    assert "$(touch PWN)" in ran and "`touch PWN`" in ran


def test_no_accepted_value_runs_in_any_arithmetic_or_name_context(tmp_path: Path) -> None:
    values = [v for v in _values(2500, seed=22) if "\x00" not in v]
    ok = [v for v in values if accepted(v)]
    assert len(ok) > 500  # the rule is not "refuse everything"
    # Batches keep each bash's script to a size the kernel passes as one argument.
    ran: list[str] = []
    for start in range(0, len(ok), 25):
        batch = ok[start:start + 25]
        (tmp_path / str(start)).mkdir()
        ran += [batch[i] for i in _run(batch, tmp_path / str(start))]
    assert ran == []


def test_the_exports_run_time_assertion_refuses_exactly_what_fleetcuda_refuses(tmp_path: Path) -> None:
    """An exported playbook checks secrets when it runs, with its own pattern (Ansible's `search` is Python's re):
    no value passes there that fleetcuda refuses, nor the other way round."""
    r = tmp_path / "r.yaml"
    r.write_text(json.dumps({"name": "r", "vars": {"api_token": "1"}, "secrets": ["api_token"],
                             "steps": [{"name": "s", "verify": "true"}]}))
    i = tmp_path / "i.yaml"
    i.write_text("hosts:\n  h:\n    kind: local\n")
    assert export(str(r), "-i", str(i), "-o", str(tmp_path / "out")).returncode == 0
    play = yaml.safe_load((tmp_path / "out" / "site.yml").read_text())[0]
    pattern = play["vars"]["fleetcuda_refused_value"]
    differ = [v for v in _values(3000, seed=27) if (re.search(pattern, v) is None) != accepted(v)]
    assert differ == []
