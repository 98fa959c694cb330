"""When to restart something that died (``remp up``'s children, the agent's engine): a growing
delay and a limit per time window. Pure: the caller passes the time."""

from __future__ import annotations

from dataclasses import dataclass, field

RESTART_WINDOW_S = 600.0


@dataclass
class RestartBudget:
    """After a death: restart after ``base_s`` · 2^(deaths in the window − 1) seconds (at most
    ``max_delay_s``), or never (``None``) once more than ``limit`` deaths fell within
    ``window_s``."""

    limit: int = 5
    window_s: float = RESTART_WINDOW_S
    base_s: float = 1.0
    max_delay_s: float = 30.0
    deaths: list[float] = field(default_factory=list)

    def on_death(self, now: float) -> float | None:
        self.deaths = [t for t in self.deaths if now - t < self.window_s] + [now]
        if len(self.deaths) > self.limit:
            return None
        return min(self.max_delay_s, self.base_s * 2 ** (len(self.deaths) - 1))

    @property
    def count(self) -> int:
        return len(self.deaths)
