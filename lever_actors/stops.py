"""Stop strings over streamed text: release what can no longer become a stop, hold back the rest.

A stop string may span token boundaries, so a chunk that ends with ``"</"`` cannot be sent while
``"</code>"`` is a stop: the next token decides whether those two characters are output or the
start of the end. :class:`StopScanner` keeps exactly the longest tail of the text that is a proper
prefix of some stop string and releases everything before it. A stop is found the moment it is
complete, and the output ends where it begins (the stop itself is never output, as in the OpenAI
API); when several are complete at once, the one that begins first wins.
"""
from __future__ import annotations


class StopScanner:
    """Feed text in order; get back the text that is safe to send, and whether a stop was hit."""

    def __init__(self, stops: tuple[str, ...] | list[str]) -> None:
        self.stops = tuple(s for s in stops if s)
        self._held = ""
        self.stopped = False

    def feed(self, piece: str) -> str:
        """Add ``piece``; return the text now safe to send (``stopped`` tells if a stop ended it)."""
        if self.stopped:
            return ""
        text = self._held + piece
        hits = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.stopped, self._held = True, ""
            return text[:min(hits)]
        keep = self._hold_back(text)
        self._held = text[len(text) - keep:] if keep else ""
        return text[:len(text) - keep]

    def flush(self) -> str:
        """The generation ended without a stop: what was held back is output after all."""
        held, self._held = self._held, ""
        return "" if self.stopped else held

    def _hold_back(self, text: str) -> int:
        """Length of the longest tail of ``text`` that is a proper prefix of a stop string."""
        best = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:n]):
                    best = n
                    break
        return best
