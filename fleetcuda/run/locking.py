"""The engine's side of run.locks' protocol: one apply at a time per target.

The lock is taken in the first round trip (with the batched checks, see batching), a dead owner's lock is
taken over, every held lock is refreshed by a thread while the run lasts, and each is released when its
target ends (after Ctrl-C: by the main thread, once what was running there is stopped).
"""

from __future__ import annotations

import threading

from fleetcuda.connectors.base import RunResult
from fleetcuda.errors import FleetcudaError
from fleetcuda.plan.inventory import Target
from fleetcuda.plan.planner import Plan, lock_command, vmid_of
from fleetcuda.remote import framing
from fleetcuda.run.channel import RunContext, TargetChannel
from fleetcuda.run.diagnosis import maybe_unreachable
from fleetcuda.run.locks import LOCK_STALE_S, TargetLock, lock_state, owner_is_dead


class TargetLocked(FleetcudaError):
    pass


class LockKeeper:
    """The apply locks of one run. `lock` is None outside apply: then every method does nothing."""

    def __init__(self, ctx: RunContext, lock: TargetLock | None, refresh_s: float):
        self.ctx = ctx
        self.lock = lock
        self.refresh_s = refresh_s
        self.held: set[str] = set()  # targets whose apply lock this run holds
        self._refresh_stop = threading.Event()
        self._refresher: threading.Thread | None = None

    # -- taking it ------------------------------------------------------------------------

    def acquire(self, plan: Plan, channel: TargetChannel) -> None:
        """The lock on its own, for a target with fewer than two checks to batch it with."""
        if self.lock is None:
            return
        cmd = lock_command(plan, self.lock.acquire(vmid_of(plan)))
        res = channel.exec("lock", "acquire", cmd, None)
        if self.took_over_dead_lock(plan, channel, res):
            res = channel.exec("lock", "acquire", cmd, None)
        self.settle(plan, res)

    def took_over_dead_lock(self, plan: Plan, channel: TargetChannel, res: RunResult) -> bool:
        """A lock left by a run of this machine whose process is gone (killed, crashed) is taken over."""
        assert self.lock is not None
        word, fields = lock_state(framing.parse(res.output, plan.nonce))
        if word != "busy" or len(fields) < 2:
            return False
        owner = " ".join(fields[1:])
        if not owner_is_dead(owner):
            return False
        cmd = lock_command(plan, self.lock.take_over(vmid_of(plan), owner))
        done = channel.exec("lock", "take-over", cmd, None)
        if self.word(plan, done) != "taken-over":
            return False
        self.ctx.reporter.notice(plan.target.id, f"took over the lock of a run that is gone: {owner}")
        return True

    def settle(self, plan: Plan, res: RunResult) -> None:
        """What the target said of its lock: held (noted), released, or busy (the target fails, TargetLocked)."""
        for f in framing.parse(res.output, plan.nonce):
            if f.kind != "lock" or not f.fields:
                continue
            word, fields = f.fields[0], f.fields[1:]
            if word == "busy":
                where, owner = (fields[0] if fields else "?"), " ".join(fields[1:])
                raise TargetLocked(f"another fleetcuda apply holds {where} on {plan.target.id}: {owner or '?'}"
                                   f" (wait with --lock-wait SECONDS; a lock its run has not refreshed for "
                                   f"{LOCK_STALE_S // 60} min is taken over)")
            if word == "stale":
                self.ctx.reporter.notice(plan.target.id, f"took over a stale lock (not refreshed for "
                                                         f"{LOCK_STALE_S // 60} min): {' '.join(fields) or '?'}")
            elif word == "held":
                self.held.add(plan.target.id)
            elif word == "released":
                self.held.discard(plan.target.id)
        if plan.target.id not in self.held and res.rc != 0:
            maybe_unreachable(res, plan.target)

    @staticmethod
    def word(plan: Plan, res: RunResult) -> str | None:
        return lock_state(framing.parse(res.output, plan.nonce))[0]

    # -- keeping it -----------------------------------------------------------------------

    def start_refreshing(self) -> None:
        if self.lock is None:
            return
        self._refresher = threading.Thread(target=self._refresh_loop, name="fleetcuda-lock-refresh", daemon=True)
        self._refresher.start()

    def stop_refreshing(self) -> None:
        self._refresh_stop.set()

    def _refresh_loop(self) -> None:
        """Touch every lock this run holds, so that a long step never lets another run take it as stale."""
        assert self.lock is not None
        while not self._refresh_stop.wait(self.refresh_s):
            for tid in list(self.held):
                plan = self.ctx.plans.get(tid)
                if plan is None:
                    continue
                cmd = lock_command(plan, self.lock.refresh(vmid_of(plan)))
                try:
                    self.ctx.pool.get(plan.target.host).run(cmd, timeout=60, on_line=lambda line: None)
                except Exception:  # the next refresh tries again; a lost host fails its own step
                    pass

    # -- giving it back -------------------------------------------------------------------

    def release(self, target: Target, plan: Plan | None, channel: TargetChannel) -> None:
        if self.lock is None or plan is None or target.id not in self.held:
            return
        try:
            res = channel.exec_always("lock", "release", lock_command(plan, self.lock.release(vmid_of(plan))))
            if self.word(plan, res) == "released":
                self.held.discard(target.id)
                return
            why = f"exit {res.rc}"
        except (FleetcudaError, OSError) as exc:
            channel.write(f"# could not release the lock: {exc}")
            why = str(exc)
        self.ctx.reporter.notice(target.id, f"could not release the apply lock ({why}): other runs wait for it "
                                            f"until it is stale ({LOCK_STALE_S // 60} min)")

    def release_after_interrupt(self, target: Target) -> None:
        plan = self.ctx.plans.get(target.id)
        if plan is None or self.lock is None or target.id not in self.held:
            return
        try:
            res = self.ctx.pool.get(target.host).run(lock_command(plan, self.lock.release(vmid_of(plan))),
                                                     timeout=60, on_line=lambda line: None)
            if self.word(plan, res) == "released":
                self.held.discard(target.id)
                self.ctx.append_log(target, "# lock released after the interruption")
                return
            why = f"exit {res.rc}"
        except (FleetcudaError, OSError) as exc:
            why = str(exc)
        self.ctx.reporter.notice(target.id, f"could not release the apply lock ({why}): other runs wait for it "
                                            f"until it is stale ({LOCK_STALE_S // 60} min)")
