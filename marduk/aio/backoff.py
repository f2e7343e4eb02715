"""Exponential backoff: the pause before each retry, pure (no clock, no sleep)."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(slots=True)
class Backoff:
    """Pauses that start at ``initial`` and grow by ``factor`` up to ``cap``.

    ``next()`` gives the pause to wait now and moves on; ``reset()`` (after a success) starts
    over. ``delay`` is the pause ``next()`` gives before jitter: what to log. With ``jitter``
    (0.2: +-20%), each pause is scaled by ``uniform(1 - jitter, 1 + jitter)`` so that many
    clients that failed together do not retry together; the growth itself is not jittered.
    """

    initial: float
    cap: float
    factor: float = 2.0
    jitter: float = 0.0
    uniform: Callable[[float, float], float] = field(default=random.uniform, repr=False)
    delay: float = field(init=False)

    def __post_init__(self) -> None:
        if self.initial < 0 or self.cap < 0 or self.factor < 1 or not 0 <= self.jitter < 1:
            raise ValueError(
                f"not a backoff: initial {self.initial}, cap {self.cap}, factor {self.factor}, "
                f"jitter {self.jitter}"
            )
        self.delay = self.initial

    def next(self) -> float:
        """The pause before the next attempt (jittered); the one after it grows."""
        pause = self.delay
        self.delay = min(self.delay * self.factor, self.cap)
        if self.jitter:
            pause *= self.uniform(1 - self.jitter, 1 + self.jitter)
        return pause

    def reset(self) -> None:
        """It worked: the next failure waits ``initial`` again."""
        self.delay = self.initial
