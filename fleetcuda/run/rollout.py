"""A rollout in batches (`apply --canary N`, `--serial K`): which targets run together, and why the rest stop.

Pure and light (the dry-run imports it to show the batches): the executor runs the batches one after the
other and starts none after one that did not fully succeed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class Batch(Generic[T]):
    """Targets converged together (at most --forks at once); `number` counts from 1 of `total`."""

    number: int
    total: int
    canary: bool
    targets: tuple[T, ...]

    @property
    def name(self) -> str:
        return f"canary batch {self.number}/{self.total}" if self.canary else f"batch {self.number}/{self.total}"


def batches(targets: Sequence[T], canary: int | None = None, serial: int | None = None) -> list[Batch[T]]:
    """The targets in their order (the inventory's, after --limit): the first `canary` alone, then the rest
    `serial` at a time (all at once without --serial). A canary or serial at least as large as what is left
    is one batch; neither option: a single batch of every target."""
    if canary is not None and canary < 1 or serial is not None and serial < 1:
        raise ValueError("canary and serial count targets: at least 1")
    chunks: list[tuple[tuple[T, ...], bool]] = []
    rest = list(targets)
    if canary is not None and rest:
        chunks.append((tuple(rest[:canary]), True))
        rest = rest[canary:]
    step = serial or len(rest) or 1
    chunks += [(tuple(rest[i:i + step]), False) for i in range(0, len(rest), step)]
    return [Batch(i + 1, len(chunks), is_canary, chunk) for i, (chunk, is_canary) in enumerate(chunks)]


def stop_reason(batch: Batch[T], failed: Sequence[tuple[str, str]]) -> str:
    """Why the targets after `batch` were not started: `failed` is (target id, its status) of the batch's
    targets that did not succeed; a few are named, then how many more."""
    named = ", ".join(f"{target} {status}" for target, status in failed[:3])
    more = f" and {len(failed) - 3} more" if len(failed) > 3 else ""
    what = "canary batch" if batch.canary else batch.name
    return f"not started: {what} failed ({named}{more})"
