"""A rank's own watchdog: a run that stops making progress ends as a `timeout` note.

On NCCL a hung collective never raises in the main thread: it blocks in a synchronize while
NCCL's watchdog aborts the process from its own thread, and no note gets written. A rank that
hangs outside any collective leaves the others waiting just as silently. This thread knows
which phase the rank is in (a warm-up step, a timed repeat, gathering the results) and how
long that phase may take; past that it writes the note the main thread cannot, and ends the
process. Blocking waits would give the main thread an exception too, but they serialise
FSDP2's asynchronous collectives, which destroys the overlap being measured.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class Watchdog:
    """Calls `on_expire(phase, waited_s)` once when an armed phase outlives its allowance."""

    def __init__(self, on_expire: Callable[[str, float], None], poll_s: float = 1.0) -> None:
        self._on_expire = on_expire
        self._poll_s = poll_s
        self._lock = threading.Lock()
        self._phase = ""
        self._armed_at = 0.0
        self._deadline: float | None = None
        self._thread = threading.Thread(target=self._watch, name="fsdp-bench-watchdog", daemon=True)
        self._thread.start()

    def arm(self, phase: str, allowance_s: float) -> None:
        """From now, `phase` must end (another arm or a disarm) within `allowance_s`."""
        now = time.monotonic()
        with self._lock:
            self._phase, self._armed_at, self._deadline = phase, now, now + allowance_s

    def disarm(self) -> None:
        with self._lock:
            self._deadline = None

    def _watch(self) -> None:
        while True:
            time.sleep(self._poll_s)
            with self._lock:
                deadline, phase, armed_at = self._deadline, self._phase, self._armed_at
            now = time.monotonic()
            if deadline is not None and now > deadline:
                self._on_expire(phase, now - armed_at)
                return
