"""One way to wait for another process: poll a condition, log progress, give up at a deadline."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TypeVar

from ckptd.errors import DeadlineError

T = TypeVar("T")

log = logging.getLogger("ckptd.elastic")


def wait_for(condition: Callable[[], T | None], *, what: str, timeout_s: float, hint: str | None = None,
             on_poll: Callable[[], None] | None = None, poll_s: float = 0.01, log_every_s: float = 5.0) -> T:
    """Call ``condition`` until it returns something other than None (or False) and return that.

    ``on_poll`` runs at every round (a heartbeat, or a check that raises to abandon the wait). Every
    ``log_every_s`` seconds the wait logs what it still waits for; past ``timeout_s`` it raises
    :class:`~ckptd.errors.DeadlineError` naming ``what``."""
    start = time.monotonic()
    next_log = start + log_every_s
    delay = min(0.001, poll_s)
    while True:
        if on_poll is not None:
            on_poll()
        value = condition()
        if value is not None and value is not False:
            return value
        now = time.monotonic()
        if now - start > timeout_s:
            raise DeadlineError(f"gave up waiting for {what} after {timeout_s:g} s", hint=hint)
        if now >= next_log:
            log.warning("still waiting for %s (%.0f s of %g s)", what, now - start, timeout_s)
            next_log = now + log_every_s
        time.sleep(delay)
        delay = min(poll_s, delay * 2)
