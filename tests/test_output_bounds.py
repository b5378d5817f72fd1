"""What fleetcuda keeps of a target's output is bounded (issue 22.3): a check or command that prints without
end costs the control machine (and, for a batch, the target's batch shell) a bounded amount of memory and the
run log a bounded size, and what was dropped is said. Through the real CLI on a `kind: local` target, where
the target is the control machine itself: the memory measured is the largest of fleetcuda's process and every
process it ran (the batch shell included), as a parent sees it (getrusage of its children).

The same over SSH and `pct exec`: tests/test_lab_output_bounds.py."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from fleetcuda.connectors import base
from tests.conftest import REPO

# 1000-character lines: many bytes in few lines, so that the run before the fix ends in seconds too.
LINE = "yes \"$(printf '%01000d' 0)\""
MAX_RSS_MB = 90  # fleetcuda alone is about 50 MB; before the fix these runs held 150 MB to 4 GB
MAX_LOG = 1024 * 1024 + 3 * 64 * 1024  # LOG_HEAD, then the tail (docs/operations.md: what is kept of an output)

_MEASURE = """\
import resource, subprocess, sys
proc = subprocess.run(sys.argv[1:], capture_output=True, text=True)
sys.stdout.write(f"{proc.returncode} {resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss}\\n")
sys.stdout.write(proc.stdout + proc.stderr)
"""


def _run(tmp_path: Path, recipe: str, *args: str) -> tuple[int, int, str, Path]:
    """(exit status, largest RSS in MB of fleetcuda and what it ran, what it printed, the target's log)."""
    r = tmp_path / "r.yaml"
    r.write_text(textwrap.dedent(recipe))
    i = tmp_path / "i.yaml"
    i.write_text("hosts:\n  h:\n    kind: local\n")
    state = tmp_path / "state"
    env = {**os.environ, "FLEETCUDA_STATE_DIR": str(state), "COLUMNS": "200"}
    proc = subprocess.run([sys.executable, "-c", _MEASURE, sys.executable, "-m", "fleetcuda", *args, str(r), "-i",
                           str(i), "--plain"], capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
    first, _, out = proc.stdout.partition("\n")
    rc, rss_kb = map(int, first.split())
    [log] = state.glob("runs/*/h.log")
    return rc, rss_kb // 1024, out, log


def test_a_batched_check_with_a_huge_output_costs_bounded_memory_and_log(tmp_path: Path) -> None:
    rc, rss, out, log = _run(tmp_path, f"""\
        name: r
        steps:
          - name: quiet
            verify: "true"
          - name: loud
            verify: |
              {LINE} | head -c 40000000; echo; echo the end
        """, "verify")
    assert rc == 0, out
    assert rss < MAX_RSS_MB, f"{rss} MB"
    text = log.read_text()
    assert "all-steps" in text  # it was batched
    assert log.stat().st_size < MAX_LOG
    # The batch said what it dropped of the check (on the target), and the check's last line is its answer.
    assert re.search(r"\| \[\.\.\. \d+ bytes dropped \.\.\.\]", text)
    assert "loud: exit 0" in text and "| the end" in text


def test_a_check_alone_with_a_huge_output_costs_bounded_memory_and_log(tmp_path: Path) -> None:
    rc, rss, out, log = _run(tmp_path, f"""\
        name: r
        steps:
          - name: loud
            verify: |
              {LINE} | head -c 40000000; echo; echo the end
        """, "verify")
    assert rc == 0, out
    assert "1 target(s): 1 ok" in out or "loud: ok" in out, out
    assert rss < MAX_RSS_MB, f"{rss} MB"
    assert log.stat().st_size < MAX_LOG
    m = re.search(r"^\[\.\.\. (\d+) bytes dropped \.\.\.\]$", log.read_text(), re.M)
    assert m and 38_000_000 < int(m[1]) < 40_000_000
    lines = log.read_text().splitlines()
    assert lines[[i for i, ln in enumerate(lines) if ln.startswith("## exit 0")][-1] - 1] == "the end"


def test_an_endless_output_alone_costs_bounded_memory_and_log(tmp_path: Path) -> None:
    rc, rss, out, log = _run(tmp_path, f"""\
        name: r
        steps:
          - name: endless
            timeout: 3
            verify: |
              {LINE}
        """, "verify")
    assert rc == 1 and "endless: failed (verification timed out after 3s" in out, out
    assert rss < MAX_RSS_MB, f"{rss} MB"
    assert log.stat().st_size < MAX_LOG
    assert re.search(r"^\[\.\.\. \d+ bytes dropped \.\.\.\]$", log.read_text(), re.M)


def test_yes_in_a_batch_is_bounded(tmp_path: Path) -> None:
    # `yes`: two-byte lines, the most lines per byte, each prefixed by the batch.
    rc, rss, out, log = _run(tmp_path, """\
        name: r
        steps:
          - name: quiet
            verify: "true"
          - name: yeses
            verify: "yes | head -c 10000000; echo the end"
        """, "verify")
    assert rc == 0, out
    assert rss < MAX_RSS_MB, f"{rss} MB"
    assert log.stat().st_size < MAX_LOG
    assert "yeses: exit 0" in log.read_text() and "| the end" in log.read_text()


# -- the control side's splitter, in-process --------------------------------------------------------------------


def _split(chunks: list[bytes], keep: int = 0) -> tuple[list[str], str]:
    lines: list[str] = []
    splitter = base._LineSplitter(lines.append, keep)
    for c in chunks:
        splitter.feed(c)
    return lines, splitter.finish()


def test_a_small_output_is_kept_whole() -> None:
    lines, out = _split([b"a\r\nb", b"\xc3", b"\xa9\nc"])
    assert lines == ["a", "b\u00e9", "c"] and out == "a\nb\u00e9\nc"


@pytest.mark.parametrize("line", [b"y\n", b"x" * 999 + b"\n", b"z"])
def test_a_long_output_keeps_its_head_and_tail_and_says_what_was_dropped(line: bytes) -> None:
    data = line * (20_000_000 // len(line)) + b"last"
    lines, out = _split([data[i:i + 65536] for i in range(0, len(data), 65536)])
    assert len(out) < 3 * base.KEEP_TAIL and sum(map(len, lines)) < base.LOG_HEAD + 3 * base.KEEP_TAIL
    assert out.endswith("last") and lines[-1].endswith("last")
    for text in (out, "\n".join(lines) + "\n"):
        [count] = [int(n) for n in re.findall(r"^\[\.\.\. (\d+) bytes dropped \.\.\.\]$", text, re.M)]
        kept = text.replace(f"[... {count} bytes dropped ...]\n", "")
        # (A line cut into lines of MAX_LINE gains their newlines: one per 64 KiB at most.)
        assert 0 <= len(kept.encode()) + count - len(data) <= len(data) // 65536 + 1


# -- the batch shell's cap, run for real ------------------------------------------------------------------------


def test_a_batched_checks_output_is_whole_up_to_its_cap_then_head_dropped_count_tail(tmp_path: Path) -> None:
    from tests.test_check_batch import _plan, _run_batch

    steps = "".join(f"  - name: s{n}\n    verify: |\n      {script}\n" for n, script in enumerate([
        r"head -c 65530 /dev/zero | tr '\0' x; printf 'a\nb\n'; exit 3",  # across the head's end: whole
        "seq 1 100000",  # 588895 bytes: cut
        "printf 'no newline'",
    ]))
    plan = _plan(tmp_path, steps, sys.executable)
    results, _ = _run_batch(plan)
    assert results[0].rc == 3 and results[0].output == "x" * 65530 + "a\nb"
    assert results[2].rc == 0 and results[2].output == "no newline"
    out = results[1].output
    assert results[1].rc == 0
    [count] = [int(n) for n in re.findall(r"^\[\.\.\. (\d+) bytes dropped \.\.\.\]$", out, re.M)]
    head, _, tail = out.partition(f"\n[... {count} bytes dropped ...]\n")
    whole = "".join(f"{n}\n" for n in range(1, 100001))
    assert whole.startswith(head) and whole.rstrip("\n").endswith("\n" + tail)
    assert len(head) + count + len(tail) + 1 == len(whole)  # (the head ends within a line: a newline is added)
    assert len(out) < 2 * 65536 + 100


@pytest.mark.parametrize("stream", ["", ">&2"])
def test_nul_output_escaped_for_the_log_stays_bounded(tmp_path: Path, stream: str) -> None:
    """NUL bytes are logged as `\\x00`, four characters each: the log's bound holds for what it writes (the second
    attack: 20 MB of NULs wrote a 4.5 MB log and a 262 KB console line)."""
    rc, rss, out, log = _run(tmp_path, f"""\
        name: r
        steps:
          - name: zeros
            verify: |
              head -c 20000000 /dev/zero {stream}; false
        """, "verify")
    assert rc == 1, out
    from fleetcuda.run.channel import LOG_BUDGET

    assert log.stat().st_size < LOG_BUDGET + 64 * 1024, log.stat().st_size
    assert "characters of escaped output not logged" in log.read_text()
    assert max(len(line) for line in out.splitlines()) < 2000, max(len(line) for line in out.splitlines())
    assert rss < MAX_RSS_MB, f"{rss} MB"
