"""The pure core: inventory and recipe models, templating, the command builder and the planner (no I/O)."""
