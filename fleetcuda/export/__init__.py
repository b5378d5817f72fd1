"""Exports of a recipe and its targets to other tools (`fleetcuda export ansible`)."""

from fleetcuda.export.ansible import MARKER, render_project
from fleetcuda.export.writer import write_project

__all__ = ["MARKER", "render_project", "write_project"]
