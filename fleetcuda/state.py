"""Where fleetcuda keeps its state on the control machine: run directories (logs), history, locks of schedules.

FLEETCUDA_STATE_DIR, else `${XDG_STATE_HOME:-~/.local/state}/fleetcuda`. No import beyond the standard library:
the engine, history, schedules and the CLI all read it.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping
from datetime import UTC, datetime
from pathlib import Path

from fleetcuda.errors import InputError


def state_dir(environ: Mapping[str, str] | None = None, home: Path | None = None) -> Path:
    environ = os.environ if environ is None else environ
    if environ.get("FLEETCUDA_STATE_DIR"):
        return Path(environ["FLEETCUDA_STATE_DIR"])
    base = environ.get("XDG_STATE_HOME") or str((home or Path(os.path.expanduser("~"))) / ".local" / "state")
    return Path(base) / "fleetcuda"


def default_inventory(environ: Mapping[str, str] | None = None, home: Path | None = None) -> Path:
    """The one default inventory file: `${XDG_CONFIG_HOME:-~/.config}/fleetcuda/inventory.yaml`."""
    environ = os.environ if environ is None else environ
    base = environ.get("XDG_CONFIG_HOME") or str((home or Path(os.path.expanduser("~"))) / ".config")
    return Path(base) / "fleetcuda" / "inventory.yaml"


def inventory_path(given: str | None, environ: Mapping[str, str] | None = None, home: Path | None = None) -> str:
    """The inventory a command reads: `-i FILE`, else $FLEETCUDA_INVENTORY, else default_inventory() when it
    exists. Never an example of the docs: without any of them it is bad input (exit 2), saying so."""
    environ = os.environ if environ is None else environ
    if given:
        return given
    if environ.get("FLEETCUDA_INVENTORY"):
        return environ["FLEETCUDA_INVENTORY"]
    path = default_inventory(environ, home)
    if os.path.lexists(path):
        return str(path)
    raise InputError("inventory", None, "", f"none given: pass -i FILE, set FLEETCUDA_INVENTORY, or write {path} "
                     "(inventories/example.yaml shows the format)")


def make_run_dir(mode: str, recipe: str, root: Path | None = None) -> Path:
    """A new private directory for one run's logs, under the state directory (or `root`)."""
    base = root or state_dir()
    runs = base / "runs"
    try:
        runs.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(runs.parent, 0o700)
        os.chmod(runs, 0o700)
        stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
        # mkdtemp: unique even for two runs of one process within a second; created 0700.
        path = Path(tempfile.mkdtemp(prefix=f"{stamp}-{mode}-{recipe}-{os.getpid()}-", dir=runs))
    except OSError as exc:
        where = "FLEETCUDA_STATE_DIR" if os.environ.get("FLEETCUDA_STATE_DIR") else "state directory"
        raise InputError(where, None, str(base), f"cannot make the run directory there: {exc.strerror or exc}; "
                         "set FLEETCUDA_STATE_DIR to a directory of yours") from None
    return path
