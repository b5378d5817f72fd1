"""The dry-run as fleetcuda.plan.view renders it: what a reviewer reads (human), what a person pastes (shell),
and what a program reads (json), for the flagship recipe on the lab inventory and on a local host."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import subprocess
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest

from fleetcuda.connectors import transfer
from fleetcuda.connectors.base import RunResult
from fleetcuda.plan import view
from fleetcuda.plan.command import BuiltCommand, quote
from fleetcuda.plan.inventory import Target, load_inventory
from fleetcuda.plan.recipe import load_recipe
from fleetcuda.remote import catalog
from fleetcuda.run.fingerprint import TARGET_PROGRAM
from fleetcuda.run.locks import TargetLock
from tests.conftest import REPO, run_fleetcuda

GDN = "recipes/gdn-fastpath.yaml"
LAB = "inventories/lab.yaml"
RUN = "deadbeef"
# The programs fleetcuda sends, as the scripts contain them (the body of a quoted heredoc: the file's text).
PROGRAMS = {name: program.text for name, program in catalog().items()}
FINGERPRINT = PROGRAMS["fingerprint"]
DIGEST = hashlib.sha256(FINGERPRINT.encode()).hexdigest()
GDN_STEPS = ["preflight", "gpu-passthrough", "host-toolchain", "cuda-keyring", "cuda-compiler", "cuda-home",
             "build-deps", "torch-matches-nvcc", "causal-conv1d", "fla-core", "fast-path"]
GUTTER = re.compile(r"^\s+(\d+|\+) \| ")


def home_as_cli(target: Target) -> str | None:
    # cli._home: a local host's HOME is this user's.
    return str(Path.home()) if target.spec.kind == "local" and target.container is None else None


def render(fmt: view.Format | str, recipe: str | Path, inventory: str | Path, limit: str | None = None,
           overrides: dict[str, str] | None = None, programs: dict[str, str] = PROGRAMS,
           home: Callable[[Target], str | None] = home_as_cli) -> str:
    """`fmt` "verbose" is the human format's full listing (--verbose); "human" its summary."""
    r, inv = load_recipe(REPO / recipe), load_inventory(REPO / inventory)
    return view.render("human" if fmt == "verbose" else fmt, r, inv, inv.select(limit),  # type: ignore[arg-type]
                       overrides or {}, home, programs, run_id=RUN, verbose=fmt == "verbose")


@pytest.fixture(scope="module")
def local_inventory(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("inv") / "local.yaml"
    path.write_text("hosts:\n  gpu-box:\n    kind: local\n    venv: /opt/fc-venv\n")
    return path


def target_sections(text: str, marker: str) -> dict[str, list[str]]:
    """Lines per target, from the line that starts with `marker` + the target id."""
    sections: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in text.splitlines():
        if line.startswith(marker):
            current = sections.setdefault(line[len(marker):].split()[0], [])
        elif line.startswith("programs"):
            current = None
        elif current is not None:
            current.append(line)
    return sections


def command_lines(lines: list[str]) -> list[str]:
    return [ln for ln in lines if ln and not ln.startswith("#")]


def blocks(text: str) -> list[str]:
    """Each numbered script block of the human format, its gutters removed and wrapped lines joined."""
    out: list[list[str]] = []
    previous_was_block = False
    for line in text.splitlines():
        m = GUTTER.match(line)
        if not m:
            previous_was_block = False
            continue
        body = line[m.end():]
        if m[1] == "+":
            out[-1][-1] += body
        elif m[1] == "1" or not previous_was_block:
            out.append([body])
        else:
            out[-1].append(body)
        previous_was_block = True
    return ["\n".join(b) for b in out]


NEW_HEADER = re.compile(r"# step \d+/\d+ \S+ \(\S+\): (" + "|".join(view.NEW_STEP_PHASES) + r") \(")


def older_parts(shell: str) -> str:
    """The shell format without what the older dry-run did not print: added headers and their lines, remarks."""
    out, lines, i = [], shell.splitlines(), 0
    while i < len(lines):
        if lines[i].startswith("# round trip ") or NEW_HEADER.match(lines[i]):
            i += 2
            continue
        if not lines[i].startswith("#   "):
            out.append(lines[i])
        i += 1
    return "\n".join(out) + "\n"


def cli_dry_run(*args: str, state: Path) -> str:
    """The CLI's shell-format dry-run (plain --dry-run, before the CLI had --format), its run id made ours."""
    help_text = run_fleetcuda("apply", "--help", state=state, check=True).stdout
    fmt = ["--format", "shell"] if "--format" in help_text else []
    out = run_fleetcuda("apply", *args, "--dry-run", *fmt, state=state, check=True).stdout
    found = re.search(r"@([0-9a-f]{8})\b", out)
    return out.replace("@" + found[1], "@" + RUN) if found else out


# -- shell: today's lines, plus what apply also sends ---------------------------------------------------

def test_shell_format_is_the_older_dry_run_byte_for_byte_plus_added_round_trips(tmp_path: Path) -> None:
    """Captured from `fleetcuda apply ... --dry-run` before this module existed: an SSH host with a
    container through sudo on a port, a local host, retries, a skipped step, secrets."""
    recipe, inventory = tmp_path / "r.yaml", tmp_path / "i.yaml"
    recipe.write_text(SMALL_RECIPE)
    inventory.write_text(SMALL_INVENTORY)
    golden = (REPO / "tests/data/dry_run_small.golden").read_text()
    golden = golden.replace("{RECIPE}", str(recipe)).replace("{INVENTORY}", str(inventory))
    shell = render("shell", recipe, inventory, home=lambda t: "/root" if t.spec.kind == "local" else None)
    assert older_parts(shell) == golden
    assert "# round trip lock-release" in shell  # and the added parts are there
    assert "#   (the apply above is tried up to 2 more time(s) after a failure, never after a timeout, waiting 3 s" \
        in shell


@pytest.mark.parametrize("limit", ["lab-a/200", "lab-b/301"])
def test_shell_format_has_todays_cli_lines_for_the_flagship(tmp_path: Path, limit: str) -> None:
    cli = cli_dry_run(str(REPO / GDN), "-i", str(REPO / LAB), "--limit", limit, state=tmp_path)
    shell = render("shell", GDN, LAB, limit)
    assert older_parts(shell) == older_parts(cli)
    assert len(command_lines(shell.splitlines())) > len(command_lines(older_parts(shell).splitlines()))


def test_shell_format_has_todays_cli_lines_on_a_local_host(tmp_path: Path, local_inventory: Path) -> None:
    cli = cli_dry_run(str(REPO / GDN), "-i", str(local_inventory), state=tmp_path)
    assert older_parts(render("shell", GDN, local_inventory)) == older_parts(cli)


def test_shell_format_adds_what_apply_sends_with_when_it_sends_it() -> None:
    lines = render("shell", GDN, LAB, "lab-b/301").splitlines()
    headers = [ln for ln in lines if ln.startswith("# round trip ") or NEW_HEADER.match(ln)]
    said = [re.match(r"# round trip \S+|# step \S+ \S+ \(\S+\): \S+", h)[0] for h in headers]  # type: ignore[index]
    assert said == ["# round trip facts", "# round trip checks",
                    *(f"# step 9/11 causal-conv1d (sdist_build): {p}" for p in
                      ("install-dir", "host-dir", "put", "push", "install", "fetch-dir", "pull", "get", "fetch-cleanup",
                       "cleanup")),
                    "# round trip lock-refresh", "# round trip lock-release", "# round trip host-cleanup"]
    follows = {h: lines[lines.index(h) + 1] for h in headers}
    for header, line in follows.items():
        assert "(" in header and header.endswith(")"), header  # when apply sends it
        assert line.startswith(("ssh ", "scp ")), line
    push = next(v for k, v in follows.items() if ": push (" in k)
    assert "sudo -n -- /usr/sbin/pct push 301" in push  # lab-b reaches pct through sudo
    put = next(v for k, v in follows.items() if ": put (" in k)
    assert put.startswith("scp -F /dev/null")
    assert "-- '<cache>/<wheel>.whl' 'labops@10.250.2.2:/tmp/fleetcuda-push." in put
    batch = next(v for k, v in follows.items() if k.startswith("# round trip checks"))
    assert "fleetcuda-apply-301" in batch and "lock held" in batch  # the lock is taken in the batch


@pytest.mark.skipif(not (shutil.which("bash") and shutil.which("zsh")), reason="needs bash and zsh")
def test_every_shell_line_parses_in_bash_and_zsh_and_is_7_bit(local_inventory: Path) -> None:
    lines = [*command_lines(render("shell", GDN, LAB, "lab-a/200,lab-b/301").splitlines()),
             *command_lines(render("shell", GDN, local_inventory).splitlines())]
    assert len(lines) > 60
    for line in lines:
        assert line.isascii(), line[:200]
        for shell in ("bash", "zsh"):
            proc = subprocess.run([shell, "-n", "-c", line], capture_output=True, text=True, timeout=60)
            assert proc.returncode == 0, (shell, line[:300], proc.stderr)


# -- human: a plan a person can review -------------------------------------------------------------------

@pytest.mark.parametrize("where", ["lab", "local"])
def test_human_format_lines_are_short_7_bit_and_say_each_target_once(where: str, local_inventory: Path) -> None:
    inventory = LAB if where == "lab" else local_inventory
    text = render("verbose", GDN, inventory)
    targets = [t.id for t in load_inventory(REPO / inventory).targets]
    lines = text.splitlines()
    assert max(len(ln) for ln in lines) <= view.MAX_LINE
    assert text.isascii()
    sections = target_sections(text, "target ")
    assert list(sections) == targets
    for tid, body in sections.items():
        assert sum(ln.startswith("  hops: ") for ln in body) == 1, tid
        assert sum(ln.startswith("  environment of every step") for ln in body) == 1, tid
        steps = [m[1] for ln in body if (m := re.match(r"  step \d+/11 (\S+) \(", ln))]
        assert steps == GDN_STEPS, tid


def test_human_hop_chains_name_each_hop() -> None:
    hops = {tid: next(ln for ln in body if ln.startswith("  hops: "))
            for tid, body in target_sections(render("verbose", GDN, LAB), "target ").items()}
    assert hops["lab-a/200"].startswith("  hops: ssh labzsh@10.250.1.2 -> pct exec 200 -> env -i ")
    assert hops["lab-b/301"].startswith("  hops: ssh labops@10.250.2.2 -> sudo -n -> pct exec 301 -> env -i ")


def test_human_environment_is_listed_once_and_scripts_say_only_what_differs() -> None:
    body = target_sections(render("verbose", GDN, LAB, "lab-a/200"), "target ")["lab-a/200"]
    start = body.index("  environment of every step's commands (each script says what it adds or lacks):")
    env = []
    for ln in body[start + 1:]:
        if not ln.startswith("    "):
            break
        env.append(ln.strip())
    path = "PATH=/root/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
    assert env == ["HOME=/root", "LANG=C.UTF-8", path, "VIRTUAL_ENV=/root/venv", "PIP_DISABLE_PIP_VERSION_CHECK=1"]
    text = "\n".join(body)
    assert "env adds CUDA_HOME=/usr/local/cuda-12.8" in text  # from step cuda-home on
    assert "env sets PATH=/usr/local/cuda-12.8/bin:/root/venv/bin:" in text
    # (Scripts' own lines aside: the GPU check's argv into the container names its environment.)
    assert sum("HOME=/root" in ln for ln in body if not GUTTER.match(ln)) == 1


def test_human_fingerprint_program_is_shown_once_and_referred_to() -> None:
    text = render("verbose", GDN, LAB, "lab-a/200")
    reference = f"<program fingerprint sha256:{DIGEST[:12]}>"
    all_blocks = blocks(text)
    shown = FINGERPRINT.rstrip("\n")  # a block holds the program without its final newline
    assert all_blocks.count(shown) == 1  # the program, whole, in the programs section
    assert sum(shown in b for b in all_blocks) == 1
    assert text.count(f"sha256:{DIGEST}") == 1
    # Where the scripts had it: fingerprint, the cached-wheel install (twice), the build, the check (= verify).
    recipe, inv = load_recipe(REPO / GDN), load_inventory(REPO / LAB)
    tv = view.plan_target(recipe, inv.select("lab-a/200")[0], {}, None, run_id=RUN, nonce="0" * 16,
                          lock=TargetLock(view.DEFAULT_LOCK_OWNER))
    distinct = {s.command.argv: s.command for s in tv.sends if s.command}  # a repeated command is shown once
    inlined = sum(view.parse_command(c).script.count(FINGERPRINT) for c in distinct.values())
    assert inlined >= 5
    assert text.count(reference) == inlined
    assert DIGEST[:12] in text.split("\nprograms")[0]  # the references come before the section


def test_human_program_given_unquoted_is_found_in_its_quoted_form() -> None:
    text = render("verbose", GDN, LAB, "lab-a/200", programs={"fp": TARGET_PROGRAM})
    digest = hashlib.sha256(TARGET_PROGRAM.encode()).hexdigest()
    assert f"<program fp sha256:{digest[:12]}>" in text
    assert blocks(text).count(TARGET_PROGRAM.rstrip("\n")) == 1  # shown without its final newline


def test_human_shows_raw_scripts_with_their_prologue_not_one_liners() -> None:
    text = render("verbose", GDN, LAB, "lab-a/200")
    escape = "'\"'\"'"  # a quote inside single quotes, what one-liners are full of
    recipe, inv = load_recipe(REPO / GDN), load_inventory(REPO / LAB)
    tv = view.plan_target(recipe, inv.select("lab-a/200")[0], {}, None, run_id=RUN, nonce="0" * 16,
                          lock=TargetLock(view.DEFAULT_LOCK_OWNER))
    assert sum((s.command.remote or "").count(escape) for s in tv.sends if s.command) > 400  # what SSH is sent
    # What is left is in the scripts themselves (python -c programs quoted as one word), not made by the display.
    assert text.split("\nprograms")[0].count(escape) < 40
    facts = next(b for b in blocks(text) if "fact python_xy" in b)
    assert facts.splitlines()[0] == "fc_python=/root/venv/bin/python"  # the prologue, as `name=value`
    assert "IFS= read -r -d '' fcn" in facts  # the nonce, from stdin
    for expected in ("timeout 7200 s", "apply tried up to 3 more time(s) after a failure", "label fleetcuda:fla-core@"
                     + RUN, "file, by SFTP: <cache>/<wheel>.whl -> labzsh@10.250.1.2:/tmp/fleetcuda-push.XXXXXX/",
                     "/usr/sbin/pct push 200 ", "/usr/sbin/pct pull 200 ", "lock release (", "checks + lock acquire ("):
        assert expected in text, expected


def test_human_shows_a_repeated_command_once() -> None:
    body = target_sections(render("verbose", GDN, LAB, "lab-a/200"), "target ")["lab-a/200"]
    fla = body[body.index("  step 10/11 fla-core (pip_install)"):]
    check = next(int(m[1]) for ln in fla if (m := re.match(r"    \[(\d+)\] check ", ln)))
    verify = next(i for i, ln in enumerate(fla) if re.match(r"    \[\d+\] verify ", ln))
    assert fla[verify + 1].strip().startswith(f"the same command as [{check}]")


def test_human_round_trips_come_in_the_order_apply_sends_them() -> None:
    text = render("verbose", GDN, LAB, "lab-a/200")
    titles = [m[1] for ln in text.splitlines() if (m := re.match(r"\s+\[\d+\] (.+?) \(", ln))]
    numbers = [int(m[1]) for ln in text.splitlines() if (m := re.match(r"\s+\[(\d+)\] ", ln))]
    assert numbers == list(range(1, len(numbers) + 1))
    assert titles[:3] == ["facts: python_xy=auto", "checks + lock acquire", "verify"]
    assert titles[-3:] == ["lock refresh", "lock release", "remove the host's staging directory"]
    shared = titles[titles.index("fingerprint") - 1: titles.index("fingerprint") + 13]
    assert shared == ["check", "fingerprint", "install-dir", "host-dir", "put", "push", "install", "apply",
                      "fetch-dir", "pull", "get", "fetch-cleanup", "cleanup", "verify"]


# -- json ------------------------------------------------------------------------------------------------

TOP_KEYS = {"schema", "recipe", "inventory", "run_id", "programs", "targets"}
TARGET_KEYS = {"id", "host", "container", "vmid", "hops", "environment", "facts_pending", "steps", "round_trips",
               "transfers"}
STEP_KEYS = {"index", "number", "name", "kind", "description", "skipped", "expect", "timeout", "retries",
             "retry_delay", "runs_on", "scripts"}
SCRIPT_KEYS = {"phase", "runs_on", "label", "timeout", "env_changes", "stdin", "programs", "script", "line"}
TRIP_KEYS = {"order", "what", "step", "phase", "when", "kind", "line"}
TRANSFER_KEYS = {"order", "step", "phase", "via", "source", "destination"}


def test_json_has_the_documented_keys_and_the_shell_formats_lines(local_inventory: Path) -> None:
    doc_text = (REPO / "docs/dry-run.md").read_text()
    for inventory in (LAB, local_inventory):
        doc = json.loads(render("json", GDN, inventory))
        assert doc["schema"] == "fleetcuda.plan/1" and set(doc) == TOP_KEYS
        assert {p["name"] for p in doc["programs"]} >= {"fingerprint", "lock"}
        for entry in doc["programs"]:
            assert (entry["sha256"], entry["text"]) == (catalog()[entry["name"]].sha256, PROGRAMS[entry["name"]])
        shell = target_sections(render("shell", GDN, inventory), "# target ")
        for t in doc["targets"]:
            assert set(t) == TARGET_KEYS
            assert [s["name"] for s in t["steps"]] == GDN_STEPS
            for s in t["steps"]:
                assert set(s) == STEP_KEYS
                for phase, script in s["scripts"].items():
                    assert set(script) == SCRIPT_KEYS and script["phase"] == phase
            for trip in t["round_trips"]:
                assert TRIP_KEYS <= set(trip) <= TRIP_KEYS | {"script", "file"}
                assert ("script" in trip) == (trip["step"] is None and trip["kind"] == "command")
                if trip["step"] is not None and trip["kind"] == "command":
                    assert t["steps"][trip["step"]]["scripts"][trip["phase"]]["line"] == trip["line"]
            for move in t["transfers"]:
                assert set(move) == TRANSFER_KEYS
            assert [r["line"] for r in t["round_trips"]] == command_lines(shell[t["id"]])
            assert t["hops"][-1]["kind"] == "bash"
    for key in TOP_KEYS | TARGET_KEYS | STEP_KEYS | SCRIPT_KEYS | TRIP_KEYS | TRANSFER_KEYS:
        assert f"`{key}`" in view.__doc__ and f"`{key}`" in doc_text, key  # type: ignore[operator]


def test_json_hops_and_transfers_are_structured() -> None:
    doc = json.loads(render("json", GDN, LAB, "lab-b/301"))
    [t] = doc["targets"]
    assert [h["kind"] for h in t["hops"]] == ["ssh", "sudo", "pct", "bash"]
    assert t["hops"][0]["user"] == "labops" and t["hops"][0]["address"] == "10.250.2.2"
    assert t["hops"][2]["vmid"] == 301
    assert t["facts_pending"] == ["python_xy"]
    assert [(m["phase"], m["via"]) for m in t["transfers"]] == [("put", "sftp"), ("push", "pct push"),
                                                                ("pull", "pct pull"), ("get", "sftp")]
    causal = t["steps"][8]
    assert causal["timeout"] == 7200 and causal["retries"] == 0
    assert "fingerprint" in causal["scripts"]["fingerprint"]["programs"]
    # The build reports its wheel in a frame: the nonce is read from stdin first.
    assert causal["scripts"]["apply"]["script"].startswith("IFS= read -r -d '' fcn\nset -e -o pipefail\n")
    assert t["steps"][3]["retries"] == 3 and t["steps"][3]["retry_delay"] == 5.0


# -- secrets and hostile values, in every format ------------------------------------------------------------

SMALL_RECIPE = textwrap.dedent("""\
    name: small
    vars:
      greeting: "hello"
      api_token: "tok-GOLDEN-1234"
      dsn: "postgres-conn-GOLDEN"
      skip_me: false
    secrets: [dsn]
    env:
      GREETING: "{{ greeting }}"
    steps:
      - name: write
        description: the greeting file
        check: test "$(cat /tmp/fc-small 2>/dev/null)" = {{ greeting }}
        apply: printf '%s' {{ greeting }} > /tmp/fc-small
        verify: test -f /tmp/fc-small
        retries: 2
        retry_delay: 3
      - name: skipped
        when: skip_me
        verify: "true"
      - name: token
        verify: test -n {{ api_token }} && test -n {{ dsn }}
    """)
SMALL_INVENTORY = textwrap.dedent("""\
    hosts:
      pve:
        address: 192.0.2.10
        user: ops
        sudo: true
        port: 2222
        containers:
          120:
            name: ct-a
            venv: /opt/venv
      box:
        kind: local
    """)

SECRET_RECIPE = textwrap.dedent("""\
    name: secrets
    vars:
      hf_token: ""
      db_password: ""
      plain: ""
      mirror: ""
      dsn: "postgres-conn-Zq81"
    secrets: [dsn]
    env:
      HF_TOKEN: "{{ hf_token }}"
      PLAIN_ENV: "{{ plain }}"
    steps:
      - name: use
        description: uses every value
        check: test -n {{ hf_token }} && test -n {{ db_password }} && test -n {{ dsn }} && test -n {{ plain }}
        apply: echo {{ mirror }} {{ plain }} > /tmp/fc-secret-test
        env:
          DB_PASSWORD: "{{ db_password }}"
          MIRROR: "{{ mirror }}"
      - name: export
        # Its `expect` (what the human and json formats show the step proves) names the values it exports.
        kind: env_file
        path: /etc/profile.d/fc-secret-test.sh
        vars:
          HF_TOKEN: "{{ hf_token }}"
          PLAIN_EXPORT: "{{ plain }}"
    """)


def test_secrets_never_appear_in_any_format(tmp_path: Path) -> None:
    recipe = tmp_path / "r.yaml"
    recipe.write_text(SECRET_RECIPE)
    overrides = {"hf_token": "hf-Sx9-token-value", "db_password": "pw-'q\"$ (id)-7781", "plain": "plain-VALUE-5512",
                 "mirror": "https://ci:hunter2-pw@mirror.invalid/simple"}
    secrets = ["hf-Sx9-token-value", "pw-'q\"$ (id)-7781", "postgres-conn-Zq81", "hunter2-pw"]
    for fmt in ("human", "verbose", "shell", "json"):
        text = render(fmt, recipe, LAB, "lab-a/200", overrides=overrides)
        for secret in secrets:
            assert secret not in text, (fmt, secret)
            assert json.dumps(secret)[1:-1] not in text, (fmt, secret)
        assert "plain-VALUE-5512" in text, fmt  # an ordinary value, used the same ways, is shown
        # A password in a URL makes the whole value a secret: it travels on stdin, so it is shown nowhere.
        assert "mirror.invalid" not in text, fmt


HOSTILE = ["it's \"q\" $ (touch /tmp/fc-pwned) ;id; $ {HOME} \\ ;|&",
           "one\ntwo\n# step 1/1 use (shell): apply (runs only if the check fails)\nrm -rf /tmp/fc-x",
           "\n  step 9/9 fake (shell)\n    [99] apply (now)\n      1 | echo forged\n# round trip lock-release (x)",
           "caf\u00e9 \u202eevil\u202c \x1b[31mred\x1b[0m \u2028sep \x7f"]
HOSTILE_RECIPE = textwrap.dedent("""\
    name: hostile
    vars:
      x: "plain"
    env:
      X_ENV: "{{ x }}"
    steps:
      - name: use
        description: a value in a check, an apply, an env
        check: test {{ x }} = {{ x }}
        apply: printf '%s\\n' {{ x }}
    """)


@pytest.mark.parametrize("value", HOSTILE)
def test_hostile_values_cannot_break_the_human_or_shell_structure(tmp_path: Path, value: str) -> None:
    recipe = tmp_path / "r.yaml"
    recipe.write_text(HOSTILE_RECIPE)
    benign_human = render("verbose", recipe, LAB, "lab-a/200,lab-b/301")
    human = render("verbose", recipe, LAB, "lab-a/200,lab-b/301", overrides={"x": value})
    assert human.isascii() and max(len(ln) for ln in human.splitlines()) <= view.MAX_LINE

    def structure(text: str) -> list[str]:  # every line outside a script block, its values blanked
        return [re.sub(r"X_ENV=.*", "X_ENV=", ln) for ln in text.splitlines() if not GUTTER.match(ln)]

    assert structure(human) == structure(benign_human)
    assert not any(ln.startswith(("# step", "# round trip")) for ln in human.splitlines())

    benign_shell = render("shell", recipe, LAB, "lab-a/200,lab-b/301")
    shell = render("shell", recipe, LAB, "lab-a/200,lab-b/301", overrides={"x": value})
    assert shell.isascii()
    assert [ln for ln in shell.splitlines() if ln.startswith("#")] == \
        [ln for ln in benign_shell.splitlines() if ln.startswith("#")]
    assert len(command_lines(shell.splitlines())) == len(command_lines(benign_shell.splitlines()))
    for line in command_lines(shell.splitlines()):
        for sh in ("bash", "zsh"):
            assert subprocess.run([sh, "-n", "-c", line], capture_output=True, timeout=60).returncode == 0, line
    doc = json.loads(render("json", recipe, LAB, "lab-a/200", overrides={"x": value}))
    check = doc["targets"][0]["steps"][0]["scripts"]["check"]
    assert check["script"].startswith(f"fc_x={quote(value)}\n")  # the data keeps the exact value


# -- the transfer commands are the ones connectors/transfer.py sends -----------------------------------------

class Recorder:
    """A transport that records the commands it is given and answers like mktemp."""

    local = False

    def __init__(self) -> None:
        self.commands: list[BuiltCommand] = []

    def run(self, cmd: BuiltCommand, timeout: float | None = None, on_line: object = None) -> RunResult:
        self.commands.append(cmd)
        return RunResult(0, view.HOST_STAGING_DIR + "\n", 0.0)

    def put(self, local: Path, remote: str) -> None:
        pass

    def get(self, remote: str, local: Path) -> None:
        pass


@pytest.mark.parametrize("limit", ["lab-a/200", "lab-b/301"])
def test_transfer_commands_equal_what_the_engine_sends(limit: str) -> None:
    recipe, inv = load_recipe(REPO / GDN), load_inventory(REPO / LAB)
    [target] = inv.select(limit)
    tv = view.plan_target(recipe, target, {}, None, run_id=RUN, nonce="0" * 16,
                          lock=TargetLock(view.DEFAULT_LOCK_OWNER))
    sent = {s.phase: s.command for s in tv.sends if s.what == "step" and s.step and s.step.name == "causal-conv1d"}
    host_path = f"{view.HOST_STAGING_DIR}/{view.WHEEL}"
    ct_path = f"{view.TARGET_WHEEL_DIR}/{view.WHEEL}"
    rec = Recorder()
    transfer.in_target(rec, target, "mktemp -d /tmp/fleetcuda-wheel.XXXXXX", "mktemp", 60)  # type: ignore[arg-type]
    transfer.host_staging_dir(rec, target)  # type: ignore[arg-type]
    transfer.into_container(rec, target, host_path, ct_path, perms="0600")  # type: ignore[arg-type]
    transfer.out_of_container(rec, target, ct_path, host_path)  # type: ignore[arg-type]
    transfer.remove_on_host(rec, target, view.HOST_STAGING_DIR)  # type: ignore[arg-type]
    transfer.in_target(rec, target, f"rm -rf -- {quote(view.TARGET_WHEEL_DIR)}", "cleanup", timeout=60)  # type: ignore[arg-type]
    assert [sent["install-dir"], sent["host-dir"], sent["push"], sent["pull"], sent["fetch-cleanup"],
            sent["cleanup"]] == rec.commands
    assert sent["fetch-dir"] == sent["host-dir"]


def test_render_refuses_an_unknown_format() -> None:
    with pytest.raises(ValueError, match="unknown dry-run format"):
        render("yaml", GDN, LAB, "lab-a/200")  # type: ignore[arg-type]
