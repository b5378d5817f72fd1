"""Read-only round trips: the target's facts (then its plan), and every check of its steps in one batch (with
the apply lock taken in the same round trip); the checks of steps that run on the host in one batch there."""

from __future__ import annotations

from fleetcuda.connectors.base import RunResult
from fleetcuda.plan.command import Invocation
from fleetcuda.plan.inventory import Target
from fleetcuda.plan.planner import (
    Plan,
    Secrets,
    base_values,
    batch_command,
    fact_values,
    facts_command,
    make_plan,
    parse_batch,
    parse_facts,
    pending_facts,
)
from fleetcuda.redact import Redactor
from fleetcuda.run.channel import RunContext, TargetChannel
from fleetcuda.run.diagnosis import maybe_unreachable
from fleetcuda.run.locking import LockKeeper
from fleetcuda.run.locks import TargetLock


def plan_target(ctx: RunContext, target: Target, overrides: dict[str, str], channel: TargetChannel) -> Plan:
    """The target's plan, its `auto` facts read from it first (one round trip)."""
    values = base_values(ctx.recipe, target, overrides)
    # Secrets known before facts are read; the plan's own list (facts included) replaces it.
    ctx.redactors[target.id] = Redactor(Secrets(ctx.recipe, values).values)
    names = pending_facts(ctx.recipe, values)
    home = ctx.home(target)
    if names:
        cmd = facts_command(ctx.recipe, target, values, names, home, nonce=ctx.nonce, run_id=ctx.run_id)
        # A secret fact's value is known only once read: its output is logged after, masked, never as it comes.
        res = channel.exec("facts", "read", cmd, timeout=120, hold_output=True)
        read = fact_values(res.output, ctx.nonce)
        ctx.redactors[target.id] = Redactor(Secrets(ctx.recipe, {**values, **read}).values)
        channel.write("# the facts' output, logged once read (their secrets masked):\n"
                      + ctx.redact(target, res.output.rstrip("\n")))
        if res.rc != 0:
            maybe_unreachable(res, target)
        values = {**values, **parse_facts(res.output, names, ctx.nonce, ctx.recipe)}
    prepared = ctx.prepared.get(target.id)
    if not names and prepared is not None:
        plan = prepared  # planned once, before the run: nothing read from the target changes it
    else:
        plan = make_plan(ctx.recipe, target, values, home, run_id=ctx.run_id, nonce=ctx.nonce,
                         defer_step_errors=bool(names))
    ctx.redactors[target.id] = Redactor(plan.secrets)
    if names:
        channel.write(ctx.redact(target, "# facts: " + ", ".join(f"{n}={values[n]}" for n in names)))
    ctx.plans[target.id] = plan
    return plan


def batched_checks(ctx: RunContext, locks: LockKeeper, plan: Plan, channel: TargetChannel) -> dict[int, RunResult]:
    """Each step's read-only check (verify's probe in verify mode) by step index, from one round trip per place:
    the container's (with the apply lock) and, for steps with `on: host`, the host's; {} for a place with fewer
    than two to batch, or whose batch gave no answer (then each of its steps checks on its own)."""
    verify = ctx.mode == "verify"
    lock = locks.lock if ctx.mode == "apply" else None
    probes = [(s.index, s.on_host, p) for s in plan.steps if not s.skipped
              for p in [s.verify_probe if verify else s.pre_probe] if p is not None]
    results = _batch(ctx, locks, plan, channel, [(i, p) for i, on_host, p in probes if not on_host], lock)
    host = [(i, p) for i, on_host, p in probes if on_host]
    if len(host) >= 2:
        results.update(_batch(ctx, locks, plan, channel, host, None, on_host=True))
    return results


def _batch(ctx: RunContext, locks: LockKeeper, plan: Plan, channel: TargetChannel,
           probes: list[tuple[int, Invocation]], lock: TargetLock | None, *, on_host: bool = False
           ) -> dict[int, RunResult]:
    verify = ctx.mode == "verify"
    if len(probes) < 2:
        if lock is not None:
            locks.acquire(plan, channel)
        return {}
    cmd = batch_command(plan, probes, lock, on_host=on_host)
    name = "host-steps" if on_host else "all-steps"
    if lock is not None:
        locks.sending_acquire(plan)  # from here on the lock may be this run's, answer or not
    res = channel.exec(name, "verify" if verify else "check", cmd, None)
    if lock is not None:
        if locks.took_over_dead_lock(plan, channel, res):
            res = channel.exec(name, "check", cmd, None)
        locks.settle(plan, res)
    # The batch shell always ends with exit 0 after its `done` frame: any other status (a check killed it,
    # after writing frames it read the nonce for into its stdout) means its frames are not believed.
    parsed = parse_batch(res.output, plan.nonce) if res.rc == 0 else {}
    if not parsed:
        maybe_unreachable(res, plan.target)
        return {}
    for i, r in sorted(parsed.items()):  # the log has the framed stream; say each check's answer plainly
        channel.write(f"# batched {plan.steps[i].name}: exit {r.rc} after {r.duration_ms} ms")
    # (A check over its own timeout already came back 124 from the batch shell: planner.batch_parts.)
    return {i: RunResult(r.rc, r.output, r.duration_ms / 1000) for i, r in parsed.items()}
