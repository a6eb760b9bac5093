"""Stop strings: the first one completed in a growing text, found in time independent of how many there are.

The text grows at its end; each check looks only at the positions where a stop string could end in what
was added since the last check, and at each position asks a set, once per distinct stop-string length,
whether the text ending there is a stop string. A check costs (characters added) x (distinct lengths)
set lookups, whatever the number of stop strings.

    >>> stops = StopStrings(("\\n\\n", "END", "D"))
    >>> stops.find("x = 1\\nEN", start=0) is None
    True
    >>> stops.find("x = 1\\nEND;", start=8)   # "END" and "D" both end at 9: the longer began first
    StopHit(begins=6, string='END')
"""

from __future__ import annotations

from typing import NamedTuple


class StopHit(NamedTuple):
    begins: int  # where the stop string begins in the text
    string: str  # the stop string


class StopStrings:
    def __init__(self, stops: tuple[str, ...]):
        if not stops or not all(stops):
            raise ValueError("stop strings must be non-empty, and there must be at least one")
        self._set = frozenset(stops)
        self._lengths = sorted({len(s) for s in self._set}, reverse=True)  # the longest first
        self.longest = self._lengths[0]

    def find(self, text: str, start: int) -> StopHit | None:
        """The stop string of `text` that ends first, past `start` (text[start:] is what is new), and where it
        begins; of those ending at the same place the longest. None if none ends there."""
        for end in range(start + 1, len(text) + 1):
            for length in self._lengths:
                if length <= end and text[end - length:end] in self._set:
                    return StopHit(end - length, text[end - length:end])
        return None
