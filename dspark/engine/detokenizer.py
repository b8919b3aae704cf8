"""Incremental detokenization and stop strings.

Text is emitted only once it is stable: a token that ends in the middle of a multi-byte character
decodes to U+FFFD and is held back until the following tokens complete it. Decoding a short window
(prefix_offset..end) keeps the cost per token constant and lets the tokenizer see enough context for
byte-level merges and leading spaces.
"""

from __future__ import annotations

from typing import Any

from dspark.engine.request import Request

_INITIAL_WINDOW = 5  # prompt tokens decoded as context before the first output token


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, request: Request) -> None:
        self.tokenizer = tokenizer
        self.request = request
        n = request.num_prompt_tokens
        self.prefix_offset = max(n - _INITIAL_WINDOW, 0)
        self.read_offset = n
        self.stop = request.params.stop
        self.max_stop_len = max((len(s) for s in self.stop), default=0)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def update(self) -> str | None:
        """Decode the request's new tokens into ``request.output_text``. Returns the stop string that
        matched (the text is then cut there), else None."""
        r = self.request
        if self.tokenizer is None:
            return None
        ids, end = r.token_ids, r.num_real_tokens  # pending placeholders past ``end`` are not tokens yet
        before = len(r.output_text)
        prefix_text = self._decode(ids[self.prefix_offset:self.read_offset])
        new_text = self._decode(ids[self.prefix_offset:end])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            r.output_text += new_text[len(prefix_text):]
            self.prefix_offset = self.read_offset
            self.read_offset = end
        if not self.stop or len(r.output_text) == before:
            return None
        search_from = max(0, before - self.max_stop_len + 1)
        best: tuple[int, str] | None = None
        for s in self.stop:
            i = r.output_text.find(s, search_from)
            if i != -1 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return None
        i, s = best
        r.output_text = r.output_text[: i + len(s) if r.params.include_stop_str_in_output else i]
        return s
