"""Small helpers shared by the switching and rebalancing tests."""
from __future__ import annotations

import datetime as dt


def parse_time(s: str) -> float:
    """An RFC 3339 time from status (with or without milliseconds) as epoch seconds."""
    return dt.datetime.fromisoformat(s.replace("Z", "+00:00")).timestamp()
