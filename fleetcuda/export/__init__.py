"""Exports of a recipe and its targets to other tools (`fleetcuda export ansible`): `export.ansible` renders
an Ansible project from the planner's commands (pure), `export.writer` writes it, `export.cli` is the command.
Nothing is imported here, so that building the CLI's parser stays light."""
