"""Reporters at the edge: live terminal/plain output, machine-readable reports, history."""
