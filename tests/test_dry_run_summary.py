"""The default dry-run (`apply --dry-run`, the human format's summary): one screen per plan, in an operator's
words, values resolved, equal plans said once. Goldens: tests/data/dry_run_flagship_one.golden (README's first
command: the flagship on inventories/example.yaml) and tests/data/dry_run_flagship_four.golden (four containers
of one shape, tests/data/four_containers.yaml). FLEETCUDA_UPDATE_GOLDENS=1 rewrites them."""

from __future__ import annotations

import io
import os
import re
import textwrap
from pathlib import Path

import pytest

from fleetcuda.cli import main
from fleetcuda.cli.environment import Environment
from fleetcuda.results import ExitStatus
from tests.conftest import REPO

GDN = "recipes/gdn-fastpath.yaml"
GOLDENS = {
    "one": (["-i", "inventories/example.yaml"], "tests/data/dry_run_flagship_one.golden"),
    "four": (["-i", "tests/data/four_containers.yaml"], "tests/data/dry_run_flagship_four.golden"),
}
# A program's digest changes with its text: the goldens are compared with digests blanked.
DIGEST = re.compile(r"\b[0-9a-f]{12}\b")


def dry_run(*args: str, recipe: str = GDN) -> str:
    """`fleetcuda apply RECIPE ARGS --dry-run`, in-process, from the repository (relative paths as a user types)."""
    out, err = io.StringIO(), io.StringIO()
    env = Environment.with_streams(out, err, io.StringIO(), environ={}, home=REPO, cwd=REPO,
                                   state_dir=REPO / ".no-state")
    cwd = os.getcwd()
    os.chdir(REPO)
    try:
        code = main(["apply", recipe, *args, "--dry-run"], env)
    finally:
        os.chdir(cwd)
    assert code == ExitStatus.OK, err.getvalue()
    return out.getvalue()


@pytest.mark.parametrize("which", sorted(GOLDENS))
def test_the_summary_is_the_golden(which: str) -> None:
    args, golden = GOLDENS[which]
    text = dry_run(*args)
    path = REPO / golden
    if os.environ.get("FLEETCUDA_UPDATE_GOLDENS"):
        path.write_text(text)
    assert DIGEST.sub("<digest>", text) == DIGEST.sub("<digest>", path.read_text())


def test_the_flagship_fits_a_screen_on_one_target_and_on_four() -> None:
    one, four = dry_run("-i", "inventories/example.yaml"), dry_run("-i", "tests/data/four_containers.yaml")
    for text, most in ((one, 80), (four, 100)):
        lines = text.splitlines()
        assert len(lines) <= most and max(map(len, lines)) <= 120 and text.isascii()
    # Four containers of one shape: one plan, each target and its hops named once.
    assert "pve1/202, pve1/203, pve2/202, pve2/203: same plan\n" in four
    assert four.count(" cuda-compiler: ") == 1
    for hop in ("pve1/202 (train-a): ssh root@10.1.2.6 -> pct exec 202",
                "pve2/203 (train-d): ssh ops@10.1.2.7 -> sudo -n pct exec 203"):
        assert f"\n  {hop}\n" in four


def test_each_line_of_the_summary_wraps_at_words() -> None:
    text = dry_run("-i", "tests/data/four_containers.yaml", "--var", "wheelhouse=/srv/wheels")
    words = set(" ".join(text.split("\n")).split())
    # Every token of every line is whole: a wrapped line never cuts a word, so each word is one of the text's.
    for token in ("https://developer.download.nvidia.com/compute/cuda/repos,",
                  "PATH=/root/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                  "cuda-nvcc-<cuda_version|dashed>", "/srv/wheels,"):
        assert token in words, token


def test_values_read_at_run_time_read_as_what_they_are() -> None:
    # inventories/h200.yaml leaves cuda_version, max_jobs and python_xy to the target, and the distro and archs.
    text = dry_run("-i", "inventories/h200.yaml")
    flat = " ".join(line.strip() for line in text.splitlines())
    assert "read from the target at run time: <cuda_version>, <max_jobs>, <python_xy>" in flat
    assert "apt: install cuda-nvcc-<cuda_version|dashed> cuda-cudart-dev-<cuda_version|dashed> (" in flat
    assert "apt: install g++ python<python_xy>-dev (" in flat
    assert "file: /etc/profile.d/cuda-home.sh (0644, replaced atomically): CUDA_HOME=/usr/local/cuda-<cuda_version>" \
        in flat
    assert "MAX_JOBS=<max_jobs>" in flat and "for the GPUs present" in flat and "<distro>/<arch>/ of" in flat
    assert not re.search(r"\bauto\b", text), "an `auto` value spliced into the summary"


def test_each_kind_says_what_it_does_with_values_resolved() -> None:
    text = dry_run("-i", "inventories/lab-real.yaml", "--var", "cuda_version=12.8", "--var", "max_jobs=4",
                   "--var", "python_xy=3.11")
    flat = " ".join(line.strip() for line in text.splitlines())
    for said in [
        "apt: install g++ python3.11-dev (apt-get update first; waits up to 300 s for dpkg's lock",
        "apt: install cuda-nvcc-12-8 cuda-cudart-dev-12-8 (",
        "apt's sources include the repo of step cuda-keyring",
        "apt: keyring cuda-keyring (/usr/share/keyrings/cuda-archive-keyring.gpg): cuda-keyring_1.1-1_all.deb from "
        "<distro>/<arch>/ of file:///srv/fleetcuda-lab/apt/compute/cuda/repos, then apt-get update",
        "file: /etc/profile.d/cuda-home.sh (0644, replaced atomically): CUDA_HOME=/usr/local/cuda-12.8 "
        "PATH=/usr/local/cuda-12.8/bin:$PATH",
        "build: causal-conv1d 1.7.0 (sdist only from the wheelhouse /srv/fleetcuda-lab/wheelhouse) for sm_90 "
        "(--no-build-isolation against the venv's torch, no cache",
        "env CAUSAL_CONV1D_FORCE_BUILD=TRUE MAX_JOBS=4 PIP_VERBOSE=1",
        "pip: fla-core==0.6.0 only from the wheelhouse /srv/fleetcuda-lab/wheelhouse (pip;",
        "program: fast_path_gate (sha256:",
        "shell: an assertion: verify (66 lines)",
        "2 gpu-passthrough: skipped (",
    ]:
        assert said in flat, said


def test_a_recipe_of_ones_own_and_its_secrets(tmp_path: Path) -> None:
    recipe = tmp_path / "mine.yaml"
    recipe.write_text(textwrap.dedent("""\
        name: mine
        vars: {hf_token: "", where: /opt/x}
        steps:
          - name: venv
            check: test -x {{ where }}/bin/python
            apply: python3 -m venv {{ where }}
          - name: token
            kind: env_file
            vars: {HF_TOKEN: "{{ hf_token }}", WHERE: "{{ where }}"}
          - name: sane
            verify: "{{ where }}/bin/python -c 'import sys'"
            on: host
          - name: login
            check: hf auth whoami --token {{ hf_token }}
            apply: hf auth login --token {{ hf_token }}
            env: {INDEX_URL: "{{ mirror }}"}
        """).replace('where: /opt/x}', 'where: /opt/x, mirror: ""}'))
    text = dry_run("-i", "inventories/example.yaml", "--var", "hf_token=hf_abcdefghijkl0123",
                   "--var", "mirror=https://ci:hunter2-pw@mirror.invalid/simple", recipe=str(recipe))
    assert "hf_abcdefghijkl0123" not in text and "hunter2" not in text and "mirror.invalid" not in text
    assert "      env INDEX_URL=***\n" in text  # a password in a URL: the whole URL is a secret
    # One-line scripts are shown with their values in place; secrets masked as everywhere.
    assert "  1 venv: shell: check `test -x /opt/x/bin/python`; apply `python3 -m venv /opt/x`\n" in text
    assert "  2 token: file: /etc/profile.d/token.sh (0644, replaced atomically): HF_TOKEN=*** WHERE=/opt/x;" in text
    assert ("  3 sane: shell: an assertion: verify `/opt/x/bin/python -c 'import sys'`\n"
            "      runs on the host, through its login shell\n") in text
    assert "  4 login: shell: check `hf auth whoami --token ***`; apply `hf auth login --token ***`\n" in text


def test_at_80_columns_no_line_is_longer_and_only_a_long_path_is_cut_after_a_colon() -> None:
    from fleetcuda.plan import view
    from fleetcuda.plan.inventory import load_inventory
    from fleetcuda.plan.recipe import load_recipe
    from fleetcuda.remote import catalog

    recipe, inv = load_recipe(REPO / GDN), load_inventory(REPO / "tests/data/four_containers.yaml")
    programs = {name: p.text for name, p in catalog().items()}
    narrow = view.render("human", recipe, inv, inv.targets, {}, lambda t: None, programs, width=80)
    wide = view.render("human", recipe, inv, inv.targets, {}, lambda t: None, programs, width=120)
    assert max(map(len, narrow.splitlines())) <= 80 and max(map(len, wide.splitlines())) <= 120
    # The same words either way: lines break at spaces, and a word longer than a line (the venv's PATH, 79
    # characters) after one of its colons, behind the indent.
    def words(text: str) -> str:  # below the header, whose continuation lines start with `#`
        return " ".join(text.split("\n\n", 1)[1].split()).replace(": /usr/", ":/usr/").replace(": /bin ", ":/bin ")

    assert words(narrow) == words(wide)
    assert "\n    PATH=/root/venv/bin:/usr/local/sbin:/usr/local/bin:\n    /usr/sbin:" in narrow or \
        "\n    PATH=/root/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:\n    /bin " in narrow
