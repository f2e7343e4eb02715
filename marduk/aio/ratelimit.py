"""A logger that says the first few of each kind per window and counts the rest silently."""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass, field
from typing import Any


@dataclass(slots=True)
class RateLimitedLog:
    """Logs the first ``burst`` lines of each key per ``window_s``, then one ``more`` line (if
    any; ``%s`` in it is the key), then nothing until the next window: a flood of bad input
    must not flood the log. Callers count every occurrence themselves (their ``stats``).

    ``clock`` is injectable (tests); windows are aligned on it (``now // window_s``).
    """

    logger: logging.Logger
    _: KW_ONLY
    burst: int = 5
    window_s: float = 60.0
    more: str | None = "(more %s this minute are counted, not logged)"
    clock: Callable[[], float] = time.monotonic
    max_keys: int = 1000
    _window: int = field(default=-1, init=False, repr=False)
    _seen: Counter[str] = field(default_factory=Counter, init=False, repr=False)

    def seen(self, key: str) -> int:
        """Count one occurrence of ``key``; how many there were in this window, this one too."""
        window = int(self.clock() // self.window_s)
        if window != self._window or len(self._seen) >= self.max_keys:
            self._window = window
            self._seen.clear()
        self._seen[key] += 1
        return self._seen[key]

    def log(self, key: str, level: int, msg: str, *args: Any, **kwargs: Any) -> bool:
        """``logger.log(level, msg, *args, **kwargs)`` if ``key`` is under its burst; True if
        it was logged."""
        n = self.seen(key)
        if n <= self.burst:
            self.logger.log(level, msg, *args, **kwargs)
            return True
        if n == self.burst + 1 and self.more is not None:
            self.logger.log(level, self.more, *((key,) if "%s" in self.more else ()))
        return False
