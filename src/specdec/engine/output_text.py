"""One sequence's output as its tokens come: where it stops, its text, and the text safe to stream.

The engine hands `OutputText.append` the tokens a step emitted; it keeps them one by one until a rule ends
the sequence, exactly where plain decoding would have ended it: EOS (left out of the text), a
`stop_token_ids` token (kept, as vLLM does), a stop string (the text cut before it), or `max_tokens`.
Text is detokenized incrementally (`IncrementalDetokenizer`); `new_text` is what the text gained since
the last call less a tail as long as the longest stop string but one, which may yet begin a stop string
(so a client is never sent text that a completed stop string then removes).

Example, stop ["\\n\\n"]: after "a = 1\\n" `new_text` gives "a = 1"; the next token "\\n" completes the stop
string, the text becomes "a = 1" and `new_text` gives "".

Used by the engine, and by anything standing in for it (the server's unit-test fake).
"""

from __future__ import annotations

from specdec.config import SamplingParams
from specdec.engine.stop_strings import StopStrings
from specdec.models.tokenizer import IncrementalDetokenizer


class OutputText:
    def __init__(self, tokenizer, params: SamplingParams, eos_ids: frozenset[int]) -> None:
        self.params = params
        self.eos_ids = frozenset() if params.ignore_eos else frozenset(eos_ids)
        self.stop_ids = frozenset(params.stop_token_ids)
        self.ends_on = self.eos_ids | self.stop_ids  # the tokens that end the sequence where they appear
        self.stops = StopStrings(params.stop) if params.stop else None
        self.detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens=True)
        self.num_tokens = 0  # kept so far
        self.text = ""
        self.finish_reason: str | None = None  # "stop", "length", or "abort" (`abort`)
        self.stop_reason: str | int | None = None  # the EOS / stop token or the stop string that ended it
        self._sent = 0  # characters `new_text` has given

    def append(self, tokens: list[int]) -> list[int]:
        """Keep `tokens` one by one until one ends the sequence; returns those kept (the one that ended it
        included)."""
        kept: list[int] = []
        for token in tokens:
            kept.append(token)
            self.num_tokens += 1
            if token in self.eos_ids:
                self.finish_reason, self.stop_reason = "stop", token
                break
            start = len(self.text)
            self.text += self.detokenizer.add([token])
            if token in self.stop_ids:
                self.finish_reason, self.stop_reason = "stop", token
                break
            if self._hit_stop_string(start):
                break
            if self.num_tokens >= self.params.max_tokens:
                self.finish_reason = "length"
                break
        if self.finish_reason is not None and self.stop_reason is None:  # the detokenizer's held-back bytes
            start = len(self.text)
            self.text += self.detokenizer.flush()
            self._hit_stop_string(start)
        return kept

    def _hit_stop_string(self, start: int) -> bool:
        """Whether a stop string ends in the text added from `start` on; if so, cut the text before it and
        stop. Of several, the one completed first (see `StopStrings.find`)."""
        hit = None if self.stops is None else self.stops.find(self.text, start)
        if hit is None:
            return False
        self.text = self.text[:hit.begins]
        self.finish_reason, self.stop_reason = "stop", hit.string
        return True

    def abort(self) -> None:
        self.finish_reason = "abort"

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def new_text(self) -> str:
        """The text gained since the last call, less the tail that may yet begin a stop string (all of it once
        finished)."""
        end = len(self.text)
        if self.finish_reason is None and self.stops is not None:
            end = max(self._sent, end - (self.stops.longest - 1))
        delta = self.text[self._sent:end]
        self._sent = end
        return delta
