"""`fleetcuda export ansible RECIPE -o DIR`: the recipe and its targets as an Ansible project (fleetcuda.export)."""

from __future__ import annotations

import argparse

from fleetcuda.cli.environment import Environment
from fleetcuda.export import cli as export_cli
from fleetcuda.results import ExitStatus


def add_parser(sub: argparse._SubParsersAction, env: Environment) -> None:
    export_cli.add_parser(sub)


def run(args: argparse.Namespace, env: Environment) -> ExitStatus:
    return ExitStatus(export_cli.run(args, env.stdout))
