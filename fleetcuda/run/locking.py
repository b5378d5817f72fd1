"""The engine's side of run.locks' protocol: one apply at a time per target.

The lock is taken in the first round trip (with the batched checks, see batching), a dead owner's lock is
taken over, every held lock is refreshed by a thread while the run lasts, and each is released when its
target ends (after Ctrl-C: by the main thread, once what was running there is stopped). A lock may have been
taken as soon as the command that takes it was sent: from then on it is released however the target ends,
even when no answer said it was held (a signal or a lost connection during the first round trip). The target
keeps a lock while processes of its run still run there (lock.sh): then the release says `kept`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

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
        self.maybe: set[str] = set()  # targets whose apply lock this run may hold (the acquire was sent)
        self._refresh_stop = threading.Event()
        self._refresher: threading.Thread | None = None

    # -- taking it ------------------------------------------------------------------------

    def acquire(self, plan: Plan, channel: TargetChannel) -> None:
        """The lock on its own, for a target with fewer than two checks to batch it with."""
        if self.lock is None:
            return
        cmd = lock_command(plan, self.lock.acquire(vmid_of(plan)))
        self.sending_acquire(plan)
        res = channel.exec("lock", "acquire", cmd, None)
        if self.took_over_dead_lock(plan, channel, res):
            res = channel.exec("lock", "acquire", cmd, None)
        self.settle(plan, res)

    def sending_acquire(self, plan: Plan) -> None:
        """Said before a command that takes the lock is sent: from then on the lock may be this run's."""
        self.maybe.add(plan.target.id)

    def took_over_dead_lock(self, plan: Plan, channel: TargetChannel, res: RunResult) -> bool:
        """A lock left by a run of this machine whose process is gone (killed, crashed) is taken over, unless
        the target says processes of that run still run there (then the target is locked, TargetLocked)."""
        assert self.lock is not None
        word, fields = lock_state(framing.parse(res.output, plan.nonce))
        if word == "busy":
            self.maybe.discard(plan.target.id)  # the target said whose it is: not this run's
        if word != "busy" or len(fields) < 2:
            return False
        owner = " ".join(fields[1:])
        if not owner_is_dead(owner):
            return False
        cmd = lock_command(plan, self.lock.take_over(vmid_of(plan), owner))
        done = channel.exec("lock", "take-over", cmd, None)
        frames = framing.parse(done.output, plan.nonce)
        working = _working(frames)
        if working:
            raise TargetLocked(_locked(plan, fields[0], owner, working, ended=True))
        if lock_state(frames)[0] != "taken-over":
            return False
        self.ctx.reporter.notice(plan.target.id, f"took over the lock of a run that is gone: {owner}")
        return True

    def settle(self, plan: Plan, res: RunResult) -> None:
        """What the target said of its lock: held (noted), released, or busy (the target fails, TargetLocked)."""
        frames = framing.parse(res.output, plan.nonce)
        if any(f.kind == "lock" for f in frames):
            self.maybe.discard(plan.target.id)  # the target said what became of it: `held` says if it is ours
        for f in frames:
            if f.kind != "lock" or not f.fields:
                continue
            word, fields = f.fields[0], f.fields[1:]
            if word == "busy":
                where, owner = (fields[0] if fields else "?"), " ".join(fields[1:])
                raise TargetLocked(_locked(plan, where, owner, _working(frames)))
            if word == "stale":
                self.ctx.reporter.notice(plan.target.id, f"took over a stale lock (not refreshed for "
                                                         f"{LOCK_STALE_S // 60} min): {' '.join(fields) or '?'}")
            elif word == "held":
                self.held.add(plan.target.id)
            elif word == "released":
                self.held.discard(plan.target.id)
        if plan.target.id not in self.held and res.rc != 0:
            maybe_unreachable(res, plan.target)

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

    def may_hold(self, target: Target) -> bool:
        return target.id in self.held or target.id in self.maybe

    def release(self, target: Target, plan: Plan | None, channel: TargetChannel) -> None:
        if self.lock is None or plan is None or not self.may_hold(target):
            return
        try:
            res = channel.exec_always("lock", "release", lock_command(plan, self.lock.release(vmid_of(plan))))
            self._released(target, plan, res, channel.write)
        except (FleetcudaError, OSError) as exc:
            channel.write(f"# could not release the lock: {exc}")
            self._not_released(target, str(exc))

    def release_after_interrupt(self, target: Target) -> None:
        plan = self.ctx.plans.get(target.id)
        if plan is None or self.lock is None or not self.may_hold(target):
            return
        try:
            res = self.ctx.pool.get(target.host).run(lock_command(plan, self.lock.release(vmid_of(plan))),
                                                     timeout=60, on_line=lambda line: None)
            if self._released(target, plan, res, lambda line: self.ctx.append_log(target, line)):
                self.ctx.append_log(target, "# lock released after the interruption")
        except (FleetcudaError, OSError) as exc:
            self._not_released(target, str(exc))

    def _not_released(self, target: Target, why: str) -> None:
        """Said on the console, not only in the target's log: other runs wait for this lock."""
        self.ctx.reporter.notice(target.id, f"could not release the apply lock ({why}): other runs wait for it "
                                            f"until it is stale ({LOCK_STALE_S // 60} min)")

    def _released(self, target: Target, plan: Plan, res: RunResult, say: Callable[[str], None]) -> bool:
        """What a release's answer means: released (True), kept by the target while processes of this run
        still run there (said), or nothing (not this run's lock, or no answer)."""
        frames = framing.parse(res.output, plan.nonce)
        word = lock_state(frames)[0]
        if word in ("released", "kept"):  # either way, this run is done with it: nothing to refresh
            self.held.discard(target.id)
            self.maybe.discard(target.id)
        if word == "kept":
            n, label = (_working(frames) or ["?", "?"])[:2]
            kept = (f"lock kept: {n} process(es) of this run still run on {target.id} ({label}); no other apply "
                    f"takes it while they run")
            say("# " + kept)
            self.ctx.reporter.notice(target.id, kept)
        elif word is None and res.rc == 0:
            self.maybe.discard(target.id)  # the target answered: not ours to release
        elif word is None:
            self._not_released(target, f"exit {res.rc}")
        return word == "released"


def _working(frames: list[framing.Frame]) -> list[str]:
    """The fields of lock.sh's last `working` frame: how many processes of the lock's run still run on the
    target, and the first one's label; [] when it said none."""
    found = [f.fields[1:] for f in frames if f.kind == "lock" and f.fields and f.fields[0] == "working"]
    return list(found[-1]) if found else []


def _locked(plan: Plan, where: str, owner: str, working: list[str], *, ended: bool = False) -> str:
    """The message of a target another run's lock keeps from this apply."""
    if working:
        n, label = (working + ["?", "?"])[:2]
        gone = "its fleetcuda process has ended, but " if ended else ""
        return (f"another fleetcuda apply holds {where} on {plan.target.id}: {owner or '?'}; {gone}{n} process(es) "
                f"of that run still run there ({label}): the lock is taken over only once they have ended "
                f"(wait with --lock-wait SECONDS, or stop them)")
    return (f"another fleetcuda apply holds {where} on {plan.target.id}: {owner or '?'}"
            f" (wait with --lock-wait SECONDS; a lock its run has not refreshed for "
            f"{LOCK_STALE_S // 60} min is taken over)")
