"""IncrementalDetokenizer on the real SmolLM2 tokenizer: each of its ways of running (the Rust
DecodeStream, the window over the Rust decode, the window over transformers' decode) gives, after every
update, exactly the text of the reference window algorithm over ``tokenizer.decode`` (what the engine
did before the fast paths), and in the end the full decode of the output tokens; stop strings; tokens
still pending on the GPU are never read."""

from __future__ import annotations

import random
from unittest import mock

import pytest

from dspark.engine import detokenizer
from dspark.engine.detokenizer import IncrementalDetokenizer
from dspark.engine.request import PENDING_TOKEN, Request
from dspark.models.gguf_loader import default_gguf_path, load_gguf_tokenizer
from dspark.sampling_params import SamplingParams

FFFD = "\ufffd"
MODES = ("stream", "rust_window", "window")
TEXTS = [
    "The quick brown fox jumps over the lazy dog.  Two  spaces,\ttabs\tand\nnew lines\n\n  indented.",
    "Écris une phrase en français avec des accents: é, è, à, ç, œ, ÿ. Übermäßig größer, naïve café.",
    "中文文本和日本語のテキスト、한국어 텍스트도 있습니다。",
    "Emoji: 🎉🚀 👩‍👩‍👧 family, flags 🇫🇷🇯🇵, skin tones 👍🏽, keycap 1️⃣ and ∑∫√ math ≤ ≥ ≠.",
    " leading space, then   many    spaces and trailing ones   ",
    "mixed 🎉 ascii 中 é 🎉🎉 x\u200by \u00a0nbsp \ufffd literal replacement char \ufffd.",
    "Code:\n    def f(x):\n        return x ** 2  # comment → arrow\n",
]


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map (the ByteLevel alphabet)."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


@pytest.fixture(scope="module")
def tok():
    return load_gguf_tokenizer(default_gguf_path())


@pytest.fixture(scope="module")
def chat_prompt(tok) -> list[int]:
    out = tok.apply_chat_template([{"role": "user", "content": "Say something."}], add_generation_prompt=True)
    return list(out["input_ids"] if not isinstance(out, list) else out)


@pytest.fixture(scope="module")
def byte_tokens(tok) -> list[int]:
    """Tokens of single bytes 0x80..0xFF: lead and continuation bytes of multi-byte characters."""
    vocab = tok.get_vocab()
    m = _bytes_to_unicode()
    ids = [vocab[m[b]] for b in range(0x80, 0x100) if m[b] in vocab]
    assert len(ids) > 100
    return ids


class WrapperOnly:
    """A tokenizer with no Rust backend the detokenizer can see: only ``decode``."""

    def __init__(self, tok) -> None:
        self._tok = tok

    def decode(self, ids, skip_special_tokens=False):
        assert all(i >= 0 for i in ids), ids
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)


def make(tok, request: Request, mode: str) -> IncrementalDetokenizer:
    if mode == "window":
        return IncrementalDetokenizer(WrapperOnly(tok), request)
    if mode == "rust_window":
        b = detokenizer._Backend(tok)
        b.byte_level = False
        with mock.patch.object(detokenizer, "_backend", lambda t: b):
            return IncrementalDetokenizer(tok, request)
    return IncrementalDetokenizer(tok, request)


def reference(tok, prompt: list[int], chunks: list[list[int]], stop=(), include=False):
    """The window algorithm over ``tokenizer.decode`` as the engine ran it before the fast paths:
    ``(output_text, stop)`` after each update, ending at the update that hit a stop string."""
    ids = list(prompt)
    n = len(ids)
    po, ro = max(n - 5, 0), n
    text = ""
    max_stop = max((len(s) for s in stop), default=0)
    out = []
    for chunk in chunks:
        ids.extend(chunk)
        end = len(ids)
        before = len(text)
        prefix_text = tok.decode(ids[po:ro], skip_special_tokens=True)
        new_text = tok.decode(ids[po:end], skip_special_tokens=True)
        hit = None
        if len(new_text) > len(prefix_text) and not new_text.endswith(FFFD):
            text += new_text[len(prefix_text):]
            po, ro = ro, end
        if stop and len(text) != before:
            best = None
            for s in stop:
                i = text.find(s, max(0, before - max_stop + 1))
                if i != -1 and (best is None or i < best[0]):
                    best = (i, s)
            if best is not None:
                i, hit = best
                text = text[: i + len(hit) if include else i]
        out.append((text, hit))
        if hit is not None:
            break
    return out


def drive(tok, prompt, chunks, mode="stream", stop=(), include=False, expect_mode=None):
    """Feed the chunks (one update each) through an IncrementalDetokenizer: ``(output_text, stop)``
    after each update, ending at a stop string like the engine."""
    r = Request("r", prompt, SamplingParams(stop=list(stop), include_stop_str_in_output=include), 0, ())
    d = make(tok, r, mode)
    assert d.mode == (expect_mode or mode)
    out = []
    for chunk in chunks:
        r.token_ids.extend(chunk)
        hit = d.update()
        out.append((r.output_text, hit))
        if hit is not None:
            break
    return out


def random_chunks(rng: random.Random, ids: list[int], max_chunk: int = 8, empty: bool = False) -> list[list[int]]:
    chunks, i = [], 0
    while i < len(ids):
        k = rng.randint(0 if empty else 1, max_chunk)
        chunks.append(ids[i:i + k])
        i += k
    return chunks


# ------------------------------------------------------------------------------------------ modes
def test_mode_selection(tok, chat_prompt, byte_tokens):
    r = Request("r", chat_prompt, SamplingParams(), 0, ())
    assert IncrementalDetokenizer(tok, r).mode == "stream"
    assert IncrementalDetokenizer(WrapperOnly(tok), r).mode == "window"
    # a prompt (given as ids) ending in the middle of a character: the context decodes to ...U+FFFD
    mid = Request("m", chat_prompt + [byte_tokens[0xE2 - 0x80]], SamplingParams(), 0, ())
    assert IncrementalDetokenizer(tok, mid).mode == "rust_window"
    for prompt in ([], [1], [1, 2, 1]):  # no context, only special tokens
        assert IncrementalDetokenizer(tok, Request("e", prompt, SamplingParams(), 0, ())).mode == "stream"

    none = IncrementalDetokenizer(None, r)
    r.token_ids.extend(tok.encode("hello world"))
    assert none.mode == "none" and none.update() is None and r.output_text == ""


def test_cleanup_of_spaces_keeps_the_wrapper_when_it_changes_text(tok):
    t = load_gguf_tokenizer(default_gguf_path())
    r = Request("r", tok.encode("Hi"), SamplingParams(), 0, ())
    t.clean_up_tokenization_spaces = True  # transformers ignores it for a BPE model: the Rust text is the text
    assert IncrementalDetokenizer(t, r).mode == "stream"
    t.clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output = True  # now it cleans up
    d = IncrementalDetokenizer(t, r)
    assert d.mode == "window"
    r.token_ids.extend(tok.encode(" a . b , c"))
    d.update()
    assert r.output_text == " a. b, c"


# ------------------------------------------------------------------------------------------ text
@pytest.mark.parametrize("mode", MODES)
def test_text_matches_full_decode(tok, chat_prompt, mode):
    rng = random.Random(0)
    for text in TEXTS:
        ids = tok.encode(text)
        for chunks in ([[t] for t in ids], random_chunks(rng, ids), random_chunks(rng, ids, empty=True)):
            got = drive(tok, chat_prompt, chunks, mode)
            assert got == reference(tok, chat_prompt, chunks)
            assert got[-1][0] == tok.decode(ids, skip_special_tokens=True) == text
        # the first output token's leading space and merges come out as after the prompt's last tokens
        for prompt in (tok.encode("Hello"), tok.encode("x ="), chat_prompt[:-1], chat_prompt):
            chunks = [[t] for t in ids[:6]]
            assert drive(tok, prompt, chunks, mode) == reference(tok, prompt, chunks)


@pytest.mark.parametrize("mode", MODES)
def test_special_tokens_are_skipped(tok, chat_prompt, mode):
    im_start, im_end, eos = tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>", "<|endoftext|>"])
    a, b = tok.encode(" café 🎉"), tok.encode("中文 next")
    ids = [im_start, *a, im_end, eos, *b[:1], im_start, *b[1:], eos, im_end]
    rng = random.Random(1)
    for chunks in ([[t] for t in ids], *(random_chunks(rng, ids) for _ in range(20))):
        got = drive(tok, chat_prompt, chunks, mode)
        assert got == reference(tok, chat_prompt, chunks)
        assert got[-1][0] == tok.decode(ids, skip_special_tokens=True) == " café 🎉中文 next"


@pytest.mark.parametrize("mode", MODES)
def test_random_and_adversarial_tokens(tok, chat_prompt, byte_tokens, mode):
    """Random vocabulary tokens, lone lead/continuation bytes, special tokens and pieces of real text in
    random chunks: the text after every update is the reference's, and the last text is the full
    decode whenever that ends with a complete character."""
    rng = random.Random(2 + MODES.index(mode))
    text_ids = [t for s in TEXTS for t in tok.encode(s)]
    vocab = len(tok)
    prompts = [chat_prompt, [], [1], tok.encode("a"), tok.encode("🎉 x"), chat_prompt + [2, 198]]
    full_checked = 0
    for _ in range(120):
        ids = []
        for _ in range(rng.randint(1, 60)):
            kind = rng.random()
            if kind < 0.35:
                ids.append(rng.choice(byte_tokens))
            elif kind < 0.5:
                ids.append(rng.randrange(vocab))
            elif kind < 0.6:
                ids.append(rng.randrange(17))  # special tokens
            else:
                j = rng.randrange(len(text_ids))
                ids.extend(text_ids[j:j + rng.randint(1, 4)])
        prompt = rng.choice(prompts)
        chunks = random_chunks(rng, ids, empty=True) if rng.random() < 0.7 else [[t] for t in ids]
        got = drive(tok, prompt, chunks, mode)
        assert got == reference(tok, prompt, chunks), (prompt, chunks)
        full = tok.decode(ids, skip_special_tokens=True)
        if not full.endswith(FFFD):
            assert got[-1][0] == full
            full_checked += 1
    assert full_checked > 30


@pytest.mark.parametrize("mode", ("stream", "rust_window"))
def test_prompt_ending_mid_character(tok, chat_prompt, byte_tokens, mode):
    """Prompt ids that end inside a character (the reference drops the completed character, which is
    half prompt): the same text as the reference, through the window algorithm."""
    rng = random.Random(3)
    euro = tok.encode("€")  # the bytes E2 82 AC
    assert tok.decode(euro) == "€"
    cont = [byte_tokens[0x82 - 0x80], byte_tokens[0xAC - 0x80]]
    for prompt in (chat_prompt + [byte_tokens[0xE2 - 0x80]], chat_prompt + [byte_tokens[0xE2 - 0x80], cont[0]]):
        for _ in range(10):
            ids = cont[len(prompt) - len(chat_prompt) - 1:] + tok.encode(rng.choice(TEXTS))
            chunks = random_chunks(rng, ids)
            assert drive(tok, prompt, chunks, mode, expect_mode="rust_window") == reference(tok, prompt, chunks)


# ------------------------------------------------------------------------------------------ stop strings
@pytest.mark.parametrize("mode", MODES)
def test_stop_strings(tok, chat_prompt, mode):
    text = "The quick brown fox jumps over the lazy dog. 🎉 Fin, café 中文 end."
    ids = tok.encode(text)
    rng = random.Random(4)
    stops = [["lazy dog"], ["🎉"], ["x jum"], ["."], ["absent"], ["end.", "brown"], ["é 中"], ["Fin", "n, c"],
             ["The quick brown fox jumps over the lazy dog. 🎉 Fin, café 中文 end."]]
    for stop in stops:
        found = [(text.find(s), s) for s in stop if s in text]
        for include in (False, True):
            for chunks in ([[t] for t in ids], *(random_chunks(rng, ids) for _ in range(5))):
                got = drive(tok, chat_prompt, chunks, mode, stop=stop, include=include)
                assert got == reference(tok, chat_prompt, chunks, stop=stop, include=include)
                if found:
                    i, s = min(found)
                    assert got[-1] == (text[: i + len(s) if include else i], s)
                else:
                    assert got[-1] == (text, None) and len(got) == len(chunks)


@pytest.mark.parametrize("mode", MODES)
def test_stop_string_spanning_two_updates(tok, chat_prompt, mode):
    ids = tok.encode("Over the lazy dog and more")
    k = next(i for i in range(len(ids)) if tok.decode(ids[:i + 1]).endswith("lazy"))
    chunks = [ids[:k + 1], ids[k + 1:k + 3], ids[k + 3:]]  # "...lazy" | " dog and" | " more"
    got = drive(tok, chat_prompt, chunks, mode, stop=["azy do"])
    assert got == [("Over the lazy", None), ("Over the l", "azy do")]
    got = drive(tok, chat_prompt, chunks, mode, stop=["azy do"], include=True)
    assert got == [("Over the lazy", None), ("Over the lazy do", "azy do")]


# ------------------------------------------------------------------------------------------ pending tokens
class SpyList(list):
    """Token ids that record every read: no placeholder is read, and no read copies more than a window."""

    def __init__(self, items, request) -> None:
        super().__init__(items)
        self.request = request
        self.max_slice = 0

    def __getitem__(self, key):
        real = self.request.num_real_tokens
        if isinstance(key, slice):
            start, stop, _ = key.indices(len(self))
            assert stop <= real, f"read token_ids[{start}:{stop}] past the {real} real tokens"
            self.max_slice = max(self.max_slice, stop - start)
        else:
            assert 0 <= key < real, f"read token_ids[{key}], not a real token"
        value = super().__getitem__(key)
        assert PENDING_TOKEN not in (value if isinstance(key, slice) else [value])
        return value


class SpyStream:
    def __init__(self, stream) -> None:
        self.stream = stream
        self.fed: list[int] = []

    def step(self, rust, ids):
        batch = ids if isinstance(ids, list) else [ids]
        assert all(i >= 0 for i in batch), batch
        self.fed.extend(batch)
        return self.stream.step(rust, ids)


@pytest.mark.parametrize("mode", MODES)
def test_pending_placeholders_are_never_decoded(tok, chat_prompt, mode):
    ids = tok.encode(" ".join(TEXTS) * 5)  # a long sequence: no update may copy it whole
    rng = random.Random(5)
    chunks = random_chunks(rng, ids, empty=True)
    r = Request("r", chat_prompt, SamplingParams(stop=["never there"]), 0, ())
    d = make(tok, r, mode)
    assert d.mode == mode
    spy = r.token_ids = SpyList(r.token_ids, r)
    if mode == "stream":
        d._stream = SpyStream(d._stream)
    for _ in range(rng.randint(1, 3)):
        r.append_pending()  # steps launched before the first update
    got = []
    for chunk in chunks:
        for t in chunk:  # this step's tokens come back from the GPU ...
            if r.num_pending == 0:
                r.append_pending()
            r.resolve_pending(t)
        for _ in range(rng.randint(0, 2)):  # ... while the next steps are already launched
            r.append_pending()
        assert r.num_pending == 0 or list.__getitem__(r.token_ids, -1) == PENDING_TOKEN
        assert d.update() is None
        got.append((r.output_text, None))
    r.drop_pending()
    assert got == reference(tok, chat_prompt, chunks, stop=["never there"])
    assert r.output_text == tok.decode(ids, skip_special_tokens=True)
    assert len(r.token_ids) == len(chat_prompt) + len(ids) > 1000
    assert 0 < spy.max_slice <= 64  # a window (longer while CJK characters split over chunks), not the list
    if mode == "stream":
        assert d._stream.fed == ids


# ------------------------------------------------------------------------------------------ fallback
class FailingStream:
    def __init__(self, stream, fail_at: int) -> None:
        self.stream, self.left = stream, fail_at

    def step(self, rust, ids):
        self.left -= 1
        if self.left < 0:
            raise Exception("Invalid prefix encountered")
        return self.stream.step(rust, ids)


def test_stream_error_goes_on_with_the_window_algorithm(tok, chat_prompt):
    rng = random.Random(6)
    for text in TEXTS:
        ids = tok.encode(text)
        chunks = random_chunks(rng, ids, max_chunk=3)
        for fail_at in (0, 1, len(chunks) // 2, len(chunks) - 1):
            r = Request("r", chat_prompt, SamplingParams(), 0, ())
            d = IncrementalDetokenizer(tok, r)
            d._stream = FailingStream(d._stream, fail_at)
            got = []
            for chunk in chunks:
                r.token_ids.extend(chunk)
                d.update()
                got.append((r.output_text, None))
            assert d.mode == "rust_window"
            assert got == reference(tok, chat_prompt, chunks)


# ------------------------------------------------------------------------------------------ flush
@pytest.mark.parametrize("mode", MODES)
def test_flush_decodes_every_whole_character(tok, chat_prompt, mode):
    """``flush`` (a request's last update; final outputs only: the updates of its last steps skipped,
    then one flush) ends with the full decode of the output without an unfinished last character, so
    it keeps the whole characters of a last step whose tokens end inside one (per-step updates hold
    back the step's tokens together): text, special tokens, characters spelled in single-byte tokens,
    outputs ending inside a character."""
    rng = random.Random(7 + MODES.index(mode))
    vocab, m = tok.get_vocab(), _bytes_to_unicode()
    byte_id = {b: vocab[m[b]] for b in range(256) if m[b] in vocab}
    words = [tok.encode(" " + w) for s in TEXTS for w in s.split() if FFFD not in w]  # whole characters each
    chars = [c for c in "€本赭é🎉中ÿ한" if all(b in byte_id for b in c.encode())]
    assert len(chars) >= 6
    unfinished = recovered = 0
    for i in range(80):
        ids = []
        for _ in range(rng.randint(1, 30)):
            kind = rng.random()
            if kind < 0.25:
                ids += [byte_id[b] for b in rng.choice(chars).encode()]
            elif kind < 0.35:
                ids.append(rng.randrange(17))  # special tokens
            else:
                ids += rng.choice(words)
        whole = tok.decode(ids, skip_special_tokens=True)
        assert not whole.endswith(FFFD)
        if i % 3 == 0:  # the output ends inside a character: its bytes are held back
            c = rng.choice([c for c in chars if len(c.encode()) > 2]).encode()
            ids += [byte_id[b] for b in c[:rng.randint(1, len(c) - 1)]]
            unfinished += 1
        chunks = random_chunks(rng, ids)
        k = rng.randint(0, len(chunks))
        rest = [t for c in chunks[k:] for t in c]
        per_step = reference(tok, chat_prompt, chunks)[-1][0]
        assert whole.startswith(per_step)
        recovered += per_step != whole  # the per-step updates held back whole characters
        r = Request("r", chat_prompt, SamplingParams(), 0, ())
        d = make(tok, r, mode)
        for chunk in chunks[:k]:  # per-step updates up to some step, ...
            r.token_ids.extend(chunk)
            d.update()
        r.token_ids.extend(rest)  # ... the rest skipped ...
        assert d.flush() is None  # ... and decoded at the end
        assert r.output_text == whole, (ids, chunks, k)
        assert d.flush() is None and r.output_text == whole  # nothing new: nothing changes
    assert unfinished >= 20 and recovered >= 10
