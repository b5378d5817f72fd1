"""An Engine on the fake connector, for the in-process tests of the engine's parts (tests/test_run_*.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from fleetcuda.connectors.base import TransportPool
from fleetcuda.connectors.fake import FakeTransport, exit_with, framed, ok
from fleetcuda.plan.inventory import load_inventory
from fleetcuda.plan.recipe import load_recipe
from fleetcuda.reports.live import Reporter
from fleetcuda.results import StepResult, TargetResult
from fleetcuda.run.engine import Engine
from fleetcuda.run.locks import TargetLock, run_owner
from fleetcuda.run.wheelcache import WheelCache

LOCAL_HOST = "hosts:\n  h:\n    kind: local\n"
TWO_CONTAINERS = ("hosts:\n  h:\n    address: 10.0.0.1\n    user: root\n    containers:\n"
                  "      201:\n        venv: /root/venv\n      202:\n        venv: /root/venv\n")


@dataclass
class Recorder(Reporter):
    """What the engine told its reporter, in order."""

    events: list[tuple[str, ...]] = field(default_factory=list)

    def step_started(self, target: str, step: str, phase: str) -> None:
        self.events.append(("started", target, step, phase))

    def step_finished(self, target: str, result: StepResult) -> None:
        self.events.append(("finished", target, result.name, str(result.status)))

    def target_finished(self, result: TargetResult) -> None:
        self.events.append(("target", result.target, str(result.status)))


@dataclass
class Sleeps:
    """Stands in for time.sleep between retries: records how long each wait would have been."""

    waits: list[float] = field(default_factory=list)

    def __call__(self, seconds: float) -> None:
        self.waits.append(seconds)


def make_engine(tmp_path: Path, steps: str, *, mode: str = "apply", inventory: str = LOCAL_HOST,
                fake: FakeTransport | None = None, locked: bool = False, forks: int = 8,
                reporter: Reporter | None = None, recipe_vars: str = "",
                **engine_kw: object) -> tuple[Engine, FakeTransport]:
    """`steps`: the recipe's steps, as YAML list items indented by two spaces; `recipe_vars`: its `vars:` block."""
    recipe_path = tmp_path / "r.yaml"
    recipe_path.write_text(f"name: r\n{recipe_vars}steps:\n{steps}")
    inv = tmp_path / "i.yaml"
    inv.write_text(inventory)
    fake = fake or FakeTransport()
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    lock = TargetLock(run_owner()) if locked else None
    engine = Engine(load_recipe(recipe_path), load_inventory(inv).targets, {}, mode,  # type: ignore[arg-type]
                    TransportPool(lambda host: fake), reporter or Reporter(), run_dir, forks=forks, lock=lock,
                    cache=WheelCache(tmp_path / "cache"), **engine_kw)  # type: ignore[arg-type]
    return engine, fake


def log_of(engine: Engine, target: str) -> str:
    return (engine.run_dir / (target.replace("/", "_") + ".log")).read_text()


# A shared build (sdist_build) on two containers of one ABI fingerprint.
STEP = "  - name: ext\n    kind: sdist_build\n    package: causal-conv1d\n    version: '1.7.0'\n"
FP = {"package": "causal-conv1d", "version": "1.7.0", "python": "3.11", "abi": "cpython-311-x86_64-linux-gnu",
      "platform": "linux-x86_64", "glibc": "2.36", "torch": "2.11.0+cu128", "torch_cuda": "12.8", "cxx11_abi": "1",
      "nvcc": "12.8", "archs": "upstream"}
WHEEL = "causal_conv1d-1.7.0-cp311-cp311-linux_x86_64.whl"
WHEEL_BYTES = b"PK\x03\x04 a wheel built in the container"


def fake_fleet() -> FakeTransport:
    """Two containers of one fingerprint whose extension is not installed yet; a build leaves a wheel."""
    fake = FakeTransport()
    fake.on(step="ext", phase="check", reply=exit_with(1, "No module named 'causal_conv1d'"))
    fake.on(step="ext", phase="fingerprint", reply=lambda call: ok(framed(call, "fingerprint", FP)))
    return fake
