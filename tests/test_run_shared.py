"""Build once per ABI fingerprint, in-process on the fake connector: of two containers with one fingerprint one
builds, the other waits, then installs the cached wheel (SFTP to the host, then pct push); a failed build
ends the waiter too (it builds for itself), never leaves it waiting."""

from __future__ import annotations

import hashlib
import shlex
import threading
import time
from pathlib import Path

from fleetcuda.connectors.base import RunResult
from fleetcuda.connectors.fake import Call, FakeTransport, exit_with, framed, ok
from fleetcuda.results import StepStatus, TargetStatus
from fleetcuda.run import fingerprint
from fleetcuda.run.engine import Engine
from fleetcuda.run.wheelcache import CacheEntry, WheelCache
from tests.run_support import FP, STEP, TWO_CONTAINERS, WHEEL, WHEEL_BYTES, Recorder, fake_fleet, log_of, make_engine


def build_leaves_a_wheel(fake: FakeTransport, entered: threading.Event, held: threading.Event) -> None:
    """The build (held until `held` is set) leaves a wheel in its container and says where, as sdist_build's does."""
    def build(call: Call) -> RunResult:
        entered.set()
        held.wait(5)
        path = f"/tmp/fleetcuda-wheel.Ab12Cd/{WHEEL}"
        fake.files.write(call.place, path, WHEEL_BYTES)
        sha = hashlib.sha256(WHEEL_BYTES).hexdigest()
        return ok("fleetcuda: building causal_conv1d-1.7.0.tar.gz\n" + framed(call, "fingerprint", FP)
                  + framed(call, "wheel", path, sha))

    fake.on(step="ext", phase="apply", reply=build)


def release_once_waiting(engine: Engine, recorder: Recorder, gate_release: threading.Event,
                         entered: threading.Event) -> threading.Thread:
    """Holds the build until the other target says it waits for it."""
    def watch() -> None:
        entered.wait(5)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            if any(e[0] == "started" and e[3].startswith("waiting for the build on ") for e in list(recorder.events)):
                break
            time.sleep(0.005)
        gate_release.set()

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def run_bounded(engine: Engine) -> list:
    """engine.run(), failing the test (instead of hanging it) if the run does not end within 5 s."""
    out: list = []
    worker = threading.Thread(target=lambda: out.extend(engine.run()), daemon=True)
    worker.start()
    worker.join(5)
    assert not worker.is_alive(), "the run did not end: a target is still waiting"
    return out


def test_one_target_builds_the_other_waits_and_installs_the_cached_wheel(tmp_path: Path) -> None:
    fake = fake_fleet()
    recorder = Recorder()
    engine, _ = make_engine(tmp_path, STEP, inventory=TWO_CONTAINERS, fake=fake, reporter=recorder)
    held, entered = threading.Event(), threading.Event()
    build_leaves_a_wheel(fake, entered, held)
    watcher = release_once_waiting(engine, recorder, held, entered)
    results = {r.target: r for r in run_bounded(engine)}
    watcher.join(5)

    [built] = fake.calls_for(step="ext", phase="apply")  # one build for the fingerprint
    builder = built.target
    waiter = ({"h/201", "h/202"} - {builder}).pop()
    key = fingerprint.key(FP)
    assert results[builder].steps[0].detail.startswith(f"built here and cached for fingerprint {key} (sha256 ")
    assert results[waiter].steps[0].detail == f"installed the wheel built on {builder} for fingerprint {key}"
    assert all(r.status == TargetStatus.CHANGED for r in results.values())
    assert ("started", waiter, "ext", f"waiting for the build on {builder}") in recorder.events
    assert [c.target for c in fake.calls_for(phase="install")] == [waiter]

    # The wheel came to the control machine's cache, then went to the waiter: SFTP put to the host, pct push.
    [entry] = WheelCache(tmp_path / "cache").entries()
    assert isinstance(entry, CacheEntry) and entry.provenance["built_on"] == builder
    assert entry.wheel.read_bytes() == WHEEL_BYTES
    [put] = fake.calls_for(kind="put")
    assert put.target == waiter and put.paths[1].startswith("/tmp/fleetcuda-push.")
    pushes = [shlex.split(c.script) for c in fake.calls_for(phase="transfer") if " push " in c.script]
    vmid = waiter.split("/")[1]
    assert [(w[1], w[2], w[3]) for w in pushes] == [("push", vmid, put.paths[1])]
    assert fake.files.read(int(vmid), pushes[0][4]) == WHEEL_BYTES
    [fetched] = fake.calls_for(kind="get")
    assert fetched.target == builder
    # Nothing left behind: not the host's staging copies, not the wheel the build left in the builder.
    assert fake.files.paths(None) == [] and fake.files.paths(int(builder.split("/")[1])) == []
    # Transfers are in the target's log like commands.
    assert " ext put\n$ put " in log_of(engine, waiter) and " ext get\n$ get " in log_of(engine, builder)


def test_a_failed_build_ends_the_waiter_too(tmp_path: Path) -> None:
    fake = fake_fleet()
    recorder = Recorder()
    engine, _ = make_engine(tmp_path, STEP, inventory=TWO_CONTAINERS, fake=fake, reporter=recorder)
    held = threading.Event()
    entered = threading.Event()

    def failing_build(call: Call) -> RunResult:
        entered.set()
        held.wait(5)
        return exit_with(1, "error: command '/usr/bin/g++' failed with exit code 1")

    fake.on(step="ext", phase="apply", reply=failing_build)
    watcher = release_once_waiting(engine, recorder, held, entered)
    results = {r.target: r for r in run_bounded(engine)}
    watcher.join(5)

    builder = next(e[1] for e in recorder.events if e[0] == "started" and e[3] == "apply")
    waiter = ({"h/201", "h/202"} - {builder}).pop()
    assert ("started", waiter, "ext", f"waiting for the build on {builder}") in recorder.events
    for target in (builder, waiter):
        assert results[target].status == TargetStatus.FAILED
        assert results[target].steps[0].status == StepStatus.FAILED
        assert results[target].steps[0].detail == "apply: apply failed (exit 1)"
    # The waiter was told why no wheel came, then tried the build itself.
    assert (f"# the build on {builder} gave no wheel (the build failed on {builder}); building here"
            in log_of(engine, waiter))
    assert [c.target for c in fake.calls_for(phase="apply")].count(waiter) == 1
    assert fake.calls_for(phase="install") == [] and fake.calls_for(kind="put") == []
    assert WheelCache(tmp_path / "cache").entries() == []


def test_a_wheel_cached_earlier_is_installed_everywhere_and_uploaded_once_per_host(tmp_path: Path) -> None:
    wheel = tmp_path / WHEEL
    wheel.write_bytes(WHEEL_BYTES)
    WheelCache(tmp_path / "cache").store(wheel, FP, {"built_on": "h/900", "built_at": "2026-11-30T00:00:00Z"})
    fake = fake_fleet()
    engine, _ = make_engine(tmp_path, STEP, inventory=TWO_CONTAINERS, fake=fake)
    results = run_bounded(engine)
    assert [r.steps[0].detail for r in results] == [
        f"installed the wheel built on h/900 for fingerprint {fingerprint.key(FP)}"] * 2
    assert fake.calls_for(phase="apply") == []
    assert len(fake.calls_for(kind="put")) == 1  # one upload for the host's two containers
    assert len([c for c in fake.calls_for(phase="transfer") if " push " in c.script]) == 2
    assert fake.files.paths(None) == []  # the host's copy is removed at the end of the run
