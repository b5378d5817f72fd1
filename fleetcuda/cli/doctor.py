"""`fleetcuda doctor`: per target, nvcc, torch, the GPU, causal_conv1d, fla and transformers' fast path; with
--model, how many of that model's layers take the fast path there."""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import TYPE_CHECKING

from fleetcuda.cli import common
from fleetcuda.cli.environment import Environment
from fleetcuda.results import ExitStatus

if TYPE_CHECKING:
    from fleetcuda.connectors.base import TransportPool
    from fleetcuda.plan.inventory import Target


def add_parser(sub: argparse._SubParsersAction, env: Environment) -> None:
    dp = sub.add_parser("doctor", help="per target: nvcc, torch, GPU, causal_conv1d, fla, transformers' fast path")
    common.add_inventory_option(dp, env)
    dp.add_argument("--limit")
    dp.add_argument("--format", choices=["table", "json"], default="table")
    dp.add_argument("--model", metavar="PATH",
                    help="a local model directory or its config.json (Qwen3.5, Qwen3.5-MoE, Qwen3-Next): say per "
                         "target how many of its layers take the fast path")


def run(args: argparse.Namespace, env: Environment) -> ExitStatus:
    from fleetcuda.connectors.base import TransportPool
    from fleetcuda.errors import HostKeyError, UnreachableError
    from fleetcuda.plan.inventory import load_inventory
    from fleetcuda.plan.model import read_model
    from fleetcuda.run import doctor

    inventory = load_inventory(args.inventory)
    targets = inventory.select(args.limit)
    # Read before connecting: a config it cannot read is bad input (exit 2), found before any round trip.
    model = read_model(args.model, env.cwd) if args.model is not None else None
    pool = TransportPool(common.transport_factory(inventory))
    home = common.local_home(env)
    reports: dict[str, dict] = {}
    code = ExitStatus.OK
    try:
        for t in targets:
            try:
                res = pool.get(t.host).run(doctor.command(t, home(t)), timeout=300, on_line=lambda line: None)
                reports[t.id] = doctor.parse(res.output)
                gpu_passthrough(pool, t, reports[t.id], home(t))
            except (UnreachableError, HostKeyError) as exc:
                reports[t.id] = {"error": str(exc)}
                code = ExitStatus.UNREACHABLE
    finally:
        pool.close()
    found = {tid: doctor.findings(r) + doctor.gpu_findings(r["gpu_passthrough"]) if "gpu_passthrough" in r
             else doctor.findings(r) for tid, r in reports.items()}
    verdicts = {tid: doctor.model_verdict(model, r) for tid, r in reports.items()} if model is not None else {}
    for tid, v in verdicts.items():  # the model's row counts like any other: a fallback fails doctor
        assert model is not None
        found[tid].append(v.finding(model))
    if any(f.status == "fail" for items in found.values() for f in items) and code == ExitStatus.OK:
        code = ExitStatus.FAILED
    if args.format == "json":
        doc = {tid: {"report": reports[tid], "findings": [dataclasses.asdict(f) for f in items]}
               for tid, items in found.items()}
        if model is not None:
            for tid, v in verdicts.items():
                doc[tid]["model"] = v.as_json(model)
        print(json.dumps(doc, indent=2), file=env.stdout)
    else:
        doctor.render(found, env.console(), verdicts, model)
    return code


def gpu_passthrough(pool: TransportPool, target: Target, report: dict, home: str | None) -> None:
    """The GPU passthrough check, on the target's host: its findings go into the report as `gpu_passthrough`."""
    from fleetcuda.run import doctor

    torch = report.get("torch")
    cuda = str(torch.get("cuda") or "") if isinstance(torch, dict) else ""
    cmd = doctor.gpu_command(target, cuda, home)
    if cmd is not None:
        res = pool.get(target.host).run(cmd, timeout=300, on_line=lambda line: None)
        report["gpu_passthrough"] = doctor.gpu_report(res.output)
