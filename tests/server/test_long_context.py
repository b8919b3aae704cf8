"""Long-context pass-key recall under concurrency (SmolLM2, max_model_len 8192).

16 requests, each a haystack of filler with its own 5-digit pass key hidden at a random depth, asking
for the key. They run once one at a time and once all 16 concurrently; the concurrent run must recall
exactly the keys the serial run recalls, with the same greedy answers (a batching bug shows up as a
recall drop under concurrency). Prefix caching is off so both runs compute every prompt in full.

Size: the issue asks for ~3,000-6,000 tokens per request. On a 2-core CPU that is out of reach today:
the reference attention backend pads a mixed prefill/decode batch to [requests, longest query chunk,
longest context], so 16 concurrent 6,000-token prompts cost ~16x the attention work of running them
one at a time (see docs/server.md). By default the haystacks are therefore 600-1,000 tokens;
``DSPARK_LONGCTX_TOKENS=3000,6000 DSPARK_TEST_DEVICE=cuda`` runs the full size on a GPU (still fp32), and ``DSPARK_TEST_SPEC_CONFIG='{"model":
"DRAFTER_DIR"}'`` runs it with speculation on.
"""

from __future__ import annotations

import asyncio
import os
import random
import time

import pytest

from tests.server.conftest import start_server

pytestmark = pytest.mark.slow

N = 16
LO, HI = (int(x) for x in os.environ.get("DSPARK_LONGCTX_TOKENS", "600,1000").split(","))
MAX_TOKENS = 12
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
INTRO = ("There is an important piece of information hidden inside a lot of irrelevant text. Find it and "
         "memorize it. I will ask you about it afterwards.\n\n")
QUESTION = "\n\nWhat is the pass key? Answer with the number only."
BYTES_PER_TOKEN_KV = 2 * 30 * 3 * 64 * 4  # SmolLM2-135M, fp32: 2 (K, V) x layers x KV heads x head dim x 4 B


@pytest.fixture(scope="module")
def long_server(tmp_path_factory):
    kv_gb = max(1.0, 1.2 * N * (HI + 300) * BYTES_PER_TOKEN_KV / 2**30)
    spec = os.environ.get("DSPARK_TEST_SPEC_CONFIG")  # a trained drafter: run the recall test speculating
    srv = start_server(tmp_path_factory, "long_ctx", [
        "--max-model-len", "8192", "--kv-cache-memory-gb", f"{kv_gb:.2f}", "--max-num-seqs", str(N),
        "--max-num-batched-tokens", "2048", "--no-enable-prefix-caching", "--dtype", "float32",
        "--device", os.environ.get("DSPARK_TEST_DEVICE", "cpu"),
        *(["--speculative-config", spec] if spec else []),
    ])
    yield srv
    srv.stop()


def haystacks(tokenizer) -> list[tuple[str, str, int]]:
    """(user message, key, approximate token count) for N requests of LO..HI tokens of filler."""
    rng = random.Random(6)
    per_filler = len(tokenizer(FILLER, add_special_tokens=False)["input_ids"])
    out = []
    for _ in range(N):
        target = rng.randint(LO, HI)
        reps = max(2, target // per_filler)
        depth = rng.randint(0, reps)
        key = str(rng.randint(10000, 99999))
        needle = f"The pass key is {key}. Remember it. {key} is the pass key. "
        text = INTRO + FILLER * depth + needle + FILLER * (reps - depth) + QUESTION
        out.append((text, key, len(tokenizer(text, add_special_tokens=False)["input_ids"])))
    return out


def test_recall_under_concurrency_equals_serial(long_server, smollm_llm):
    items = haystacks(smollm_llm.tokenizer)

    async def ask(client, text: str) -> str:
        r = await client.chat.completions.create(model="smollm2-135m-instruct", max_tokens=MAX_TOKENS,
                                                 temperature=0, messages=[{"role": "user", "content": text}])
        return r.choices[0].message.content

    async def serial() -> list[str]:
        async with long_server.async_openai(timeout=1800) as c:
            return [await ask(c, text) for text, _, _ in items]

    async def concurrent() -> list[str]:
        async with long_server.async_openai(timeout=1800) as c:
            return list(await asyncio.gather(*(ask(c, text) for text, _, _ in items)))

    t0 = time.perf_counter()
    one_by_one = asyncio.run(serial())
    t1 = time.perf_counter()
    together = asyncio.run(concurrent())
    t2 = time.perf_counter()
    recall_serial = [key in a for (_, key, _), a in zip(items, one_by_one)]
    recall_conc = [key in a for (_, key, _), a in zip(items, together)]
    sizes = [n for _, _, n in items]
    print(f"\nlong-context recall: {sum(recall_serial)}/{N} one at a time ({t1 - t0:.0f}s), "
          f"{sum(recall_conc)}/{N} with {N} concurrent ({t2 - t1:.0f}s); prompts {min(sizes)}-{max(sizes)} tokens")
    for (_, key, n), a, b in zip(items, one_by_one, together):
        print(f"  {n:5d} tokens, key {key}: serial {a!r}, concurrent {b!r}")
    assert recall_conc == recall_serial
    assert together == one_by_one
    state = long_server.wait_idle(timeout=30)
    assert state["integrity_ok"] and state["integrity"]["in_use"] == 0, state
