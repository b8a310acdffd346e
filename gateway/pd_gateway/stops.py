"""Stop sequences on text as it is decoded (pure): the text before the first stop sequence is the
answer, and while the answer runs, text that could still turn out to start a stop sequence is held
back, so nothing sent to a client is ever taken back."""
from __future__ import annotations


class StopScanner:
    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.pending = ""
        self.stopped: str | None = None     # the stop sequence met, once met

    def push(self, text: str) -> str:
        """The text that can be sent now; after a stop sequence nothing more."""
        if self.stopped is not None:
            return ""
        self.pending += text
        hit = min(((self.pending.find(s), s) for s in self.stops if s in self.pending), default=None)
        if hit is not None:
            out, self.pending, self.stopped = self.pending[:hit[0]], "", hit[1]
            return out
        if not self.hold:
            out, self.pending = self.pending, ""
            return out
        cut = max(0, len(self.pending) - self.hold)
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out

    def flush(self) -> str:
        """The answer ended without a stop sequence: what was held back."""
        out, self.pending = ("" if self.stopped is not None else self.pending), ""
        return out
