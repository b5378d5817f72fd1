"""Build once per ABI fingerprint: the first target of a fingerprint builds its wheel and brings it to the control
machine's cache; the others wait (BuildBroker), then install the cached wheel, copied over SFTP then `pct push`
(once per host). A build that gives no wheel lets each waiter build for itself."""

from __future__ import annotations

import json
import shutil
import threading
import time
from pathlib import Path

from fleetcuda import __version__
from fleetcuda.connectors import transfer
from fleetcuda.connectors.base import RunResult
from fleetcuda.errors import FleetcudaError
from fleetcuda.plan.command import quote
from fleetcuda.plan.inventory import Target
from fleetcuda.plan.planner import PlannedStep, install_command
from fleetcuda.run import fingerprint
from fleetcuda.run.channel import Interrupted, RunContext, TargetChannel, now, private_file
from fleetcuda.run.diagnosis import maybe_unreachable
from fleetcuda.run.retry import Sleep, apply_with_retries
from fleetcuda.run.wheelcache import BuildBroker, CacheEntry, WheelCache
from fleetcuda.run.wheelhouse import sha256


class SharedBuilds:
    def __init__(self, ctx: RunContext, cache: WheelCache, sleep: Sleep):
        self.ctx = ctx
        self.cache = cache
        self.broker = BuildBroker(cache)
        self.sleep = sleep  # between an apply's retries
        # A cached wheel goes to each host once, whatever the number of its containers that install it.
        self._host_copies: dict[tuple[str, str], tuple[Target, str]] = {}
        self._host_copy_locks: dict[tuple[str, str], threading.Lock] = {}
        self._host_copy_guard = threading.Lock()
        self._host_copies_closed = False

    def apply(self, channel: TargetChannel, step: PlannedStep) -> tuple[RunResult, str]:
        """Install the cached wheel for this target's fingerprint; or build it here (one target per fingerprint
        builds, the others wait for it) and bring it back to the cache; or, if that gave no wheel, build here."""
        shared = step.shared
        assert shared is not None
        target = channel.target
        channel = channel.for_step(step.name)
        res = channel.exec(step.name, "fingerprint", shared.fingerprint, 300)
        fp = fingerprint.parse(res.output) if res.rc == 0 else None
        if fp is None:
            maybe_unreachable(res, target)
            channel.write("# no ABI fingerprint (see above): building here, and not sharing the wheel")
            return self._build_alone(channel, step), "applied and verified (built here; no ABI fingerprint)"
        fkey = fingerprint.key(fp)
        channel.write(f"# ABI fingerprint {fkey}: {fingerprint.describe(fp)}")

        def waiting(builder: str) -> None:
            channel.write(f"# waiting for {builder}, which builds the wheel for fingerprint {fkey}")
            self.ctx.reporter.step_started(target.id, step.name, f"waiting for the build on {builder}")

        turn = self.broker.turn(fp, target.id, self.ctx.cancel.is_set, waiting)
        if turn.role == "build":
            return self._build_and_publish(channel, step, fp, turn.note)
        if turn.role == "cancelled":
            raise Interrupted()
        if turn.note:
            channel.write(f"# {turn.note}")
        if turn.role == "build-alone":
            return self._build_alone(channel, step), f"applied and verified (built here: {turn.note})"
        assert turn.role == "install" and turn.entry is not None
        try:
            res = self._install_cached(channel, step, turn.entry)
        except (FleetcudaError, OSError) as exc:
            res = RunResult(1, str(exc), 0.0)
            channel.write(f"# {exc}")
        if res.rc == 0:
            built_on = turn.entry.provenance.get("built_on", "?")
            return res, f"installed the wheel built on {built_on} for fingerprint {fkey}"
        channel.write("# the cached wheel did not install (see above): building here instead")
        return self._build_alone(channel, step), "applied and verified (built here: the cached wheel failed)"

    def _build_and_publish(self, channel: TargetChannel, step: PlannedStep, fp: dict[str, str],
                           note: str) -> tuple[RunResult, str]:
        """The build the other targets of this fingerprint wait for: whatever happens, they are told."""
        target = channel.target
        entry, why = None, ""
        try:
            if note:
                channel.write(f"# {note}")
            res = apply_with_retries(channel, step, self.sleep)
            if res.rc != 0:
                why = f"the build failed on {target.id}"
                return res, ""
            try:
                entry = self._publish(channel, step, fp, res)
            except (FleetcudaError, OSError) as exc:
                why = f"fetching it from {target.id} failed: {exc}"
                channel.write(f"# the wheel stays installed here, but is not cached: {why}")
                return res, "applied and verified (built here; the wheel could not be cached)"
            return res, f"built here and cached for fingerprint {fingerprint.key(fp)} (sha256 {entry.sha256[:12]})"
        except BaseException as exc:
            why = why or ("interrupted" if isinstance(exc, Interrupted | KeyboardInterrupt)
                          else f"{type(exc).__name__}: {exc}")
            raise
        finally:
            self.broker.finished(fp, entry, target.id, why)

    def _build_alone(self, channel: TargetChannel, step: PlannedStep) -> RunResult:
        res = apply_with_retries(channel, step, self.sleep)
        wheel = fingerprint.parse_wheel(res.output) if res.rc == 0 else None
        if wheel is not None:  # nobody fetches it: remove what the build left for the control machine
            self._cleanup_wheel(channel, wheel[0])
        return res

    def _cleanup_wheel(self, channel: TargetChannel, path: str) -> None:
        try:
            transfer.in_target(channel.uncancellable(), channel.target, f"rm -rf -- {quote(str(Path(path).parent))}",
                               "removing the built wheel's directory", timeout=60)
        except (FleetcudaError, OSError) as exc:
            channel.write(f"# could not remove {Path(path).parent}: {exc}")

    def _publish(self, channel: TargetChannel, step: PlannedStep, fp: dict[str, str], res: RunResult) -> CacheEntry:
        """Bring the wheel a build left in the target to the cache, checked against the sha256 it printed."""
        target = channel.target
        wheel = fingerprint.parse_wheel(res.output)
        if wheel is None:
            raise FleetcudaError("the build printed no wheel to fetch")
        path, sha = wheel
        try:
            recorded = fingerprint.parse(res.output)
            if recorded != fp:
                raise FleetcudaError("the target's ABI fingerprint changed during the build")
            scratch = self.cache.incoming()
            try:
                local = scratch / Path(path).name
                start = time.monotonic()
                transfer.fetch(channel, target, path, local)
                actual = sha256(local)
                if actual != sha:
                    raise FleetcudaError(f"{local.name} arrived with sha256 {actual}, not the {sha} the target read")
                entry = self.cache.store(local, fp, {
                    "built_on": target.id, "host": target.host,
                    "vmid": target.container.vmid if target.container else None,
                    "built_at": now(), "build_seconds": round(res.duration, 1), "recipe": self.ctx.recipe.path,
                    "step": step.name, "fleetcuda": __version__}, sha=actual)
                channel.write(f"# cached {local.name} ({entry.provenance['size']} bytes, sha256 {sha}) in "
                              f"{entry.path}, fetched in {time.monotonic() - start:.1f}s")
                return entry
            finally:
                shutil.rmtree(scratch, ignore_errors=True)
        finally:
            self._cleanup_wheel(channel, path)

    def _install_cached(self, channel: TargetChannel, step: PlannedStep, entry: CacheEntry) -> RunResult:
        assert step.shared is not None
        target = channel.target
        start = time.monotonic()
        where = transfer.in_target(channel, target, "mktemp -d /tmp/fleetcuda-wheel.XXXXXX", "mktemp", 60)
        ct_dir = where.strip().splitlines()[-1]
        ct_path = f"{ct_dir}/{entry.wheel.name}"
        try:
            if target.container is None:
                transfer.to_host(channel, entry.wheel, ct_path)
            else:
                transfer.into_container(channel, target, self._host_copy(channel, entry), ct_path, perms="0600")
        except BaseException:
            self._cleanup_wheel(channel, ct_path)  # the install script, which removes it, will not run
            raise
        channel.write(f"# {entry.wheel.name} (sha256 {entry.sha256}, built on {entry.provenance.get('built_on')} at "
                      f"{entry.provenance.get('built_at')}) copied to {ct_path} in {time.monotonic() - start:.1f}s")
        provenance = {"source": "control machine cache", "wheel_sha256": entry.sha256, "key": entry.key,
                      "built_on": entry.provenance.get("built_on"), "built_at": entry.provenance.get("built_at")}
        cmd = install_command(target, step, ct_path, entry.sha256, json.dumps(entry.fingerprint),
                              json.dumps(provenance))
        res = channel.exec(step.name, "install", cmd, step.timeout)
        if res.rc == 0:
            self.cache.note_install(entry, target.id)
        return res

    def _host_copy(self, channel: TargetChannel, entry: CacheEntry) -> str:
        """The cached wheel on the target's host, uploaded once per host and run (pct reads local files)."""
        target = channel.target
        if channel.local:  # pct reads the cache's file where it is
            return str(entry.wheel)
        slot = (target.host, entry.key)
        with self._host_copy_guard:
            lock = self._host_copy_locks.setdefault(slot, threading.Lock())
        with lock:
            with self._host_copy_guard:
                if self._host_copies_closed:
                    raise Interrupted()
                known = self._host_copies.get(slot)
            if known is None:
                staging = transfer.host_staging_dir(channel, target)
                start = time.monotonic()
                try:
                    transfer.to_host(channel, entry.wheel, f"{staging}/{entry.wheel.name}")
                except BaseException:
                    transfer.remove_on_host(channel.uncancellable(), target, staging)
                    raise
                channel.write(f"# uploaded {entry.wheel.name} to {target.host}:{staging} for this host's containers "
                              f"in {time.monotonic() - start:.1f}s")
                # Only a complete upload is remembered (a failed one is tried again by the next container).
                with self._host_copy_guard:
                    self._host_copies[slot] = known = (target, staging)
            return f"{known[1]}/{entry.wheel.name}"

    def remove_host_copies(self) -> None:
        """At the end of the run (after Ctrl-C too): the hosts keep no copy of a cached wheel."""
        with self._host_copy_guard:
            self._host_copies_closed = True
            copies = list(self._host_copies.values())
            self._host_copies.clear()
        for target, staging in copies:
            try:
                # Logged, after the target's result, in the log of the target that uploaded it.
                with private_file(self.ctx.log_path(target)) as log:
                    cleanup = TargetChannel(self.ctx, target, log, "cleanup", cancellable=False)
                    transfer.remove_on_host(cleanup, target, staging)
            except (FleetcudaError, OSError):
                pass
