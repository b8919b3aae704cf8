"""Incremental detokenization and stop strings.

Text is emitted only once it is stable: a token that ends in the middle of a multi-byte character
decodes to U+FFFD and is held back until the following tokens complete it. Decoding a short window
(prefix_offset..end) keeps the cost per token constant and lets the tokenizer see enough context for
byte-level merges and leading spaces.

This runs for every request in every engine step, so its host time matters (hundreds of requests per
step). Three ways of running the one algorithm, fastest first, all giving the same text:

* ``stream``: the ``tokenizers`` library's Rust ``DecodeStream`` (one call per update, ~0.7 µs). It
  runs the same window algorithm as ``window`` below, but compares the decoded texts by prefix
  (raising ``InvalidPrefix`` when the longer one does not start with the shorter) where ``window``
  compares lengths. The two agree whenever the window's text is a prefix of every longer window's
  text, which holds for byte-level decoders (the text is the lossy UTF-8 decoding of the tokens'
  concatenated bytes) once the context text does not end in U+FFFD; so it is used only for a
  ``ByteLevel`` decoder and a prompt context not ending in U+FFFD. Should it raise anyway, the request
  goes on with ``window`` from the same offsets.
* ``window`` over the Rust tokenizer's own ``decode`` (~1 µs a call instead of ~3.5 µs through
  transformers' wrapper), when the wrapper's decode is that call unchanged (no override, no
  clean-up of spaces).
* ``window`` over ``tokenizer.decode``: anything else.

Only ``token_ids[:num_real_tokens]`` is ever read: the trailing placeholders of async scheduling
(``PENDING_TOKEN``) are not tokens yet.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from dspark.engine.request import Request

_INITIAL_WINDOW = 5  # prompt tokens decoded as context before the first output token
_REPLACEMENT = "\ufffd"
# Text that transformers' clean_up_tokenization would change: a wrapper whose decode differs from the
# Rust decode on it is not used through the Rust decode.
_CLEANUP_PROBE = "a . b ? c ! d , e ' f n't g 'm h 's i 've j 're k"

try:  # the Rust incremental decoder (tokenizers >= 0.21)
    import tokenizers as _tk
    from tokenizers.decoders import DecodeStream as _DecodeStream
except ImportError:  # pragma: no cover - tokenizers comes with transformers
    _tk = None
    _DecodeStream = None


class _Backend:
    """What the fast paths need of a transformers tokenizer: its Rust tokenizer, when the wrapper's
    decode is that tokenizer's decode unchanged, and whether the decoder is byte-level (``stream``
    allowed). Worked out per request (a few µs), so a tokenizer changed in between is seen."""

    __slots__ = ("rust", "decode", "byte_level")

    def __init__(self, tokenizer: Any) -> None:
        self.rust = _plain_rust_tokenizer(tokenizer)
        self.decode: Callable[[list[int]], str] | None = None
        self.byte_level = False
        if self.rust is not None:
            rust_decode = self.rust.decode

            def decode(ids: list[int]) -> str:
                return rust_decode(ids, skip_special_tokens=True)

            self.decode = decode
            self.byte_level = _DecodeStream is not None and isinstance(self.rust.decoder, _tk.decoders.ByteLevel)


_backend = _Backend  # one seam for tests


def _wrapper_classes() -> tuple[Any, Any] | None:
    """transformers' tokenizer base class and Rust-backed tokenizer class, whose decode and _decode
    together are the Rust decode plus an optional clean-up of spaces (None for another transformers)."""
    global _WRAPPER_CLASSES
    if _WRAPPER_CLASSES is None:
        try:
            from transformers.tokenization_utils_base import PreTrainedTokenizerBase
            from transformers.tokenization_utils_tokenizers import TokenizersBackend
            _WRAPPER_CLASSES = (PreTrainedTokenizerBase, TokenizersBackend)
        except ImportError:
            _WRAPPER_CLASSES = ()
    return _WRAPPER_CLASSES or None


_WRAPPER_CLASSES: tuple[Any, ...] | None = None


def _plain_rust_tokenizer(tokenizer: Any) -> Any:
    """The tokenizer's Rust ``tokenizers.Tokenizer`` if ``tokenizer.decode(ids, skip_special_tokens=True)``
    is exactly ``rust.decode(ids, skip_special_tokens=True)``, else None."""
    classes = _wrapper_classes() if _tk is not None else None
    if classes is None:
        return None
    base, backend = classes
    cls = type(tokenizer)
    if getattr(cls, "decode", None) is not base.decode or getattr(cls, "_decode", None) is not backend._decode:
        return None  # a tokenizer class with its own decoding
    rust = getattr(tokenizer, "_tokenizer", None)
    if not isinstance(rust, _tk.Tokenizer):
        return None
    if getattr(tokenizer, "clean_up_tokenization_spaces", False):
        # transformers skips the clean-up for BPE models (with a warning); for one, check that the wrapper
        # really returns the Rust text where the clean-up would change it. Any other model keeps the wrapper.
        if type(rust.model).__name__ != "BPE":
            return None
        try:
            ids = rust.encode(_CLEANUP_PROBE, add_special_tokens=False).ids
            if tokenizer.decode(ids, skip_special_tokens=True) != rust.decode(ids, skip_special_tokens=True):
                return None
        except Exception:
            return None
    return rust


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, request: Request) -> None:
        self.tokenizer = tokenizer
        self.request = request
        n = request.num_prompt_tokens
        self.prefix_offset = max(n - _INITIAL_WINDOW, 0)
        self.read_offset = n
        self.stop = request.params.stop
        self.max_stop_len = max((len(s) for s in self.stop), default=0)
        self._fed = n  # tokens decoded so far (the prompt counts as fed: it is context, not output)
        self._prefix_text: str | None = None  # decode(token_ids[prefix_offset:read_offset]), cached
        self._stream: Any = None
        self._rust: Any = None
        self._decode: Callable[[list[int]], str] = self._wrapper_decode
        # how update() runs (see the module docstring): "stream" | "rust_window" | "window" | "none"
        self.mode = "none" if tokenizer is None else "window"
        if tokenizer is None:
            return
        b = _backend(tokenizer)
        if b.decode is None:
            return
        self._decode = b.decode
        self.mode = "rust_window"
        if b.byte_level:
            context = request.token_ids[self.prefix_offset:n]
            if not b.decode(context).endswith(_REPLACEMENT):
                self._stream = _DecodeStream(context, skip_special_tokens=True)
                self._rust = b.rust
                self.mode = "stream"

    def _wrapper_decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def update(self) -> str | None:
        """Decode the request's new tokens into ``request.output_text``. Returns the stop string that
        matched (the text is then cut there), else None."""
        if self.tokenizer is None:
            return None
        r = self.request
        end = r.num_real_tokens  # pending placeholders past ``end`` are not tokens yet
        fed = self._fed
        if end <= fed:  # nothing new: the same window decodes to the same (held back) text
            return None
        if self._stream is not None:
            ids = r.token_ids
            try:
                text = self._stream.step(self._rust, ids[fed] if end == fed + 1 else ids[fed:end])
            except Exception:  # not expected (see the module docstring): go on with the window algorithm
                self._stream = None
                self._prefix_text = None
                self.mode = "rust_window"
                return self._update_window(r, end)
            self._fed = end
            if text is None:
                return None
            self.prefix_offset = self.read_offset
            self.read_offset = end
            if not self.stop:
                r.output_text += text
                return None
            return self._emit(r, text)
        return self._update_window(r, end)

    def flush(self) -> str | None:
        """The last update of a request that has ended: every token since the last emitted text decoded
        in one window, and where that window ends inside a character (U+FFFD), the longest run of whole
        tokens that does not is taken. So an unfinished last character is left out but the whole
        characters before it are not (per-step updates hold back a step's tokens together), and a
        request whose per-step updates were skipped (LLMEngine._apply: final outputs only, no stop
        strings) gets its text in one go. Returns the stop string that matched, else None."""
        if self.tokenizer is None:
            return None
        r = self.request
        end = r.num_real_tokens
        if end <= self.read_offset:  # nothing since the last emitted text
            return None
        if self._stream is not None:  # the stream would hold back all of it for an unfinished last character
            self._stream = None
            self._prefix_text = None
            self.mode = "rust_window"
        return self._update_window(r, end, back_off=True)

    def _update_window(self, r: Request, end: int, back_off: bool = False) -> str | None:
        """The window algorithm: the text of tokens [read_offset, j) as the window [prefix_offset, j) decodes
        it past [prefix_offset, read_offset), for j = end, or (``back_off``) the largest j <= end whose
        window does not end inside a character; nothing while the window ends in U+FFFD."""
        ids = r.token_ids
        prefix_text = self._prefix_text
        if prefix_text is None:
            prefix_text = self._prefix_text = self._decode(ids[self.prefix_offset:self.read_offset])
        self._fed = end
        for j in range(end, self.read_offset, -1) if back_off else (end,):
            new_text = self._decode(ids[self.prefix_offset:j])
            if len(new_text) > len(prefix_text) and not new_text.endswith(_REPLACEMENT):
                self.prefix_offset, self.read_offset = self.read_offset, j
                self._prefix_text = None
                return self._emit(r, new_text[len(prefix_text):])
        return None

    def _emit(self, r: Request, text: str) -> str | None:
        before = len(r.output_text)
        r.output_text += text
        if not self.stop:
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
