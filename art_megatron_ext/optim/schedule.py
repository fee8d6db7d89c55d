"""When to save: every `save_interval` steps, on the final step, and on a clean stop.

Why: the final step of an RL job is often not known in advance (the job stops when the
rollout queue drains or a stop is requested). A loop that only saves on `step % N == 0`
loses up to N-1 steps on such a stop; this object remembers the last completed step and
saves it when the loop ends cleanly, whether or not that step was announced as final.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType

__all__ = ["PeriodicSaver", "SaveSchedule"]


@dataclass(frozen=True)
class SaveSchedule:
    """How often to checkpoint. `save_interval` counts optimizer steps (>= 1)."""

    save_interval: int = 5

    def __post_init__(self) -> None:
        if isinstance(self.save_interval, bool) or not isinstance(self.save_interval, int):
            raise TypeError(f"save_interval must be an int, got {self.save_interval!r}")
        if self.save_interval < 1:
            raise ValueError(f"save_interval must be >= 1, got {self.save_interval}")

    def is_due(self, step: int) -> bool:
        return step % self.save_interval == 0


class PeriodicSaver:
    """Calls `save(step)` on schedule; use as a context manager around the training loop.

    `step_done(step)` after each optimizer step saves when the step is due or `final=True`.
    Leaving the `with` block without an exception (or calling `stop()`) is a clean stop: the
    last completed step is saved unless it already was. Leaving with an exception saves
    nothing, so a half-updated state never replaces the last committed generation, and calls
    `on_abort(exc)` so the owner can stop trusting its in-memory state.
    """

    def __init__(
        self,
        save: Callable[[int], object],
        schedule: SaveSchedule | None = None,
        *,
        last_saved_step: int | None = None,
        on_abort: Callable[[BaseException], None] | None = None,
        drain: Callable[[], object] | None = None,
    ) -> None:
        """`drain`: waits for saves that `save` queued (async saves); called on every stop."""
        self._save = save
        self._on_abort = on_abort
        self._drain = drain
        self.schedule = schedule or SaveSchedule()
        self.last_saved_step = last_saved_step
        self.last_step: int | None = last_saved_step

    def step_done(self, step: int, *, final: bool = False) -> bool:
        """Record a completed step; returns True when it was saved."""
        if self.last_step is not None and step <= self.last_step:
            raise ValueError(
                f"step {step} is not after the last completed step {self.last_step}; "
                "steps must increase. Nothing was saved."
            )
        self.last_step = step
        if final or self.schedule.is_due(step):
            return self._save_now(step)
        return False

    def stop(self) -> bool:
        """Clean stop: save the last completed step if it is not saved yet, and wait until
        every queued save has committed (its error raises here)."""
        saved = False
        if self.last_step is not None and self.last_step != self.last_saved_step:
            saved = self._save_now(self.last_step)
        if self._drain is not None:
            self._drain()
        return saved

    def _save_now(self, step: int) -> bool:
        self._save(step)
        self.last_saved_step = step
        return True

    def __enter__(self) -> PeriodicSaver:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc is None:
            self.stop()
            return
        if self._drain is not None:
            # An earlier, complete step may still be committing: let it, but the loop's own
            # exception is what propagates.
            try:
                self._drain()
            except Exception as drain_exc:
                exc.add_note(f"a queued checkpoint save also failed: {drain_exc!r}")
        if self._on_abort is not None:
            self._on_abort(exc)
