"""Errors the CLI turns into exit codes. Bad input always names file, line and field."""

from __future__ import annotations

from dataclasses import dataclass


class FleetcudaError(Exception):
    """Base class for errors reported to the user without a traceback."""


@dataclass
class InputError(FleetcudaError):
    """Bad inventory, recipe or argument: exit code 2."""

    file: str
    line: int | None
    field: str
    message: str

    def __str__(self) -> str:
        where = f"{self.file}:{self.line}" if self.line else self.file
        field = f" {self.field}:" if self.field else ""
        return f"{where}:{field} {self.message}"


class HostKeyError(FleetcudaError):
    """An SSH host key is unknown or changed; never auto-accepted."""


class UnreachableError(FleetcudaError):
    """A host could not be connected to: exit code 3."""
