"""Generated ids -> text for one sequence: incremental detokenization and stop strings.

Shared by :class:`framework.llm.LLM` and the API server. Stop strings are matched on the text,
across token boundaries; while streaming, text that could still become a stop string is held
back (at most ``len(longest stop) - 1`` characters) so no part of a stop string ever leaks out.
"""

from __future__ import annotations

from framework.sampling_params import SamplingParams
from framework.tokenizer import Tokenizer


class SequenceText:
    """Text state of one generated sequence."""

    def __init__(self, tokenizer: Tokenizer, params: SamplingParams) -> None:
        self.detokenizer = tokenizer.detokenizer(params.skip_special_tokens)
        self.stops = [s for s in params.stop if s]
        self.include_stop = params.include_stop_str_in_output
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.text = ""  # everything produced so far (after stop truncation)
        self.sent = 0  # characters already handed out as deltas
        self.stopped = False
        self.stop_string: str | None = None  # the stop string that ended the text

    def add(self, token_ids: list[int]) -> bool:
        """Feed new ids; True if a stop string was found (the text is cut there)."""
        if self.stopped:
            return True
        for token_id in token_ids:
            piece = self.detokenizer.step(token_id)
            if not piece:
                continue
            search_from = max(0, len(self.text) - self.hold)
            self.text += piece
            if self._cut_at_stop(search_from):
                return True
        return False

    def _cut_at_stop(self, search_from: int) -> bool:
        best = None
        for stop in self.stops:
            at = self.text.find(stop, search_from)
            if at >= 0 and (best is None or at < best[0]):
                best = (at, stop)
        if best is None:
            return False
        at, stop = best
        self.text = self.text[: at + len(stop)] if self.include_stop else self.text[:at]
        self.stopped, self.stop_string = True, stop
        return True

    def delta(self, finished: bool = False) -> str:
        """New text safe to send: holds back a possible stop-string prefix unless finished."""
        end = (
            len(self.text) if finished or self.stopped or not self.stops else max(self.sent, len(self.text) - self.hold)
        )
        piece, self.sent = self.text[self.sent : end], end
        return piece
