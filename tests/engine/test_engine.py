"""End-to-end engine behaviour on the real SmolLM2: stops, streaming detokenization, logprobs, abort."""

from __future__ import annotations

import pytest
import torch

from dspark import SamplingParams
from tests.conftest import forward_logits

pytestmark = pytest.mark.slow

GREEDY = dict(temperature=0, max_tokens=40)


def chat_ids(llm, text: str) -> list[int]:
    return llm.engine.tokenize_chat([{"role": "user", "content": text}])


def test_chat_finishes_on_eos_with_stats(smollm_llm):
    out = smollm_llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                          SamplingParams(temperature=0, max_tokens=64))[0]
    assert out.finish_reason == "stop" and out.token_ids[-1] == 2  # <|im_end|>
    assert "Paris" in out.text and "<|im_end|>" not in out.text
    s = out.stats
    assert s["num_output_tokens"] == len(out.token_ids) and s["time_to_first_token_s"] > 0
    assert s["decode_tokens_per_s"] > 0


def test_stop_string_cuts_text(smollm_llm):
    ids = chat_ids(smollm_llm, "Write a short poem about the sea.")
    full = smollm_llm.generate([ids], SamplingParams(**GREEDY, ignore_eos=True))[0]
    words = full.text.split()
    stop = words[len(words) // 2]
    cut = smollm_llm.generate([ids], SamplingParams(**GREEDY, ignore_eos=True, stop=[stop]))[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    assert cut.text == full.text[: full.text.index(stop)]
    kept = smollm_llm.generate([ids], SamplingParams(**GREEDY, ignore_eos=True, stop=[stop],
                                                     include_stop_str_in_output=True))[0]
    assert kept.text == full.text[: full.text.index(stop) + len(stop)]


def test_stop_token_ids_and_max_tokens(smollm_llm):
    ids = chat_ids(smollm_llm, "Count from one to ten in words.")
    full = smollm_llm.generate([ids], SamplingParams(**GREEDY, ignore_eos=True))[0]
    t = full.token_ids[5]
    out = smollm_llm.generate([ids], SamplingParams(**GREEDY, stop_token_ids=[t]))[0]
    assert out.finish_reason == "stop" and out.stop_reason == t
    assert out.token_ids == full.token_ids[: full.token_ids.index(t) + 1]
    short = smollm_llm.generate([ids], SamplingParams(temperature=0, max_tokens=3))[0]
    assert short.finish_reason == "length" and short.token_ids == full.token_ids[:3]


def test_streamed_deltas_handle_multibyte_characters(smollm_llm):
    engine = smollm_llm.engine
    prompts = ["Écris une phrase en français avec des accents: é, è, à, ç.",
               "Write the word 'hello' in Japanese, Chinese and Greek, then three emoji."]
    tok = smollm_llm.tokenizer
    for p in prompts:
        rid = engine.add_request(chat_ids(smollm_llm, p), SamplingParams(temperature=0, max_tokens=48))
        deltas, final = [], None
        while engine.has_unfinished():
            for o in engine.step():
                if o.request_id == rid:
                    deltas.append(o.delta_text)
                    final = o if o.finished else final
        text = "".join(deltas)
        assert "\ufffd" not in text
        assert text == final.text == tok.decode(final.token_ids, skip_special_tokens=True)


def test_logprobs_match_the_model(smollm_llm):
    ids = chat_ids(smollm_llm, "Name a colour.")
    out = smollm_llm.generate([ids], SamplingParams(temperature=0, max_tokens=4, logprobs=3))[0]
    assert len(out.logprobs) == len(out.token_ids) == 4
    logits = forward_logits(smollm_llm.engine, ids + out.token_ids[:3])
    ref = torch.log_softmax(logits[len(ids) - 1:], dim=-1)
    for k, entry in enumerate(out.logprobs):
        assert entry["token"] == out.token_ids[k]
        assert abs(entry["logprob"] - float(ref[k, entry["token"]])) < 1e-4
        top_ids = [t for t, _ in entry["top"]]
        assert top_ids == ref[k].topk(3).indices.tolist() and top_ids[0] == entry["token"]  # greedy


def test_abort_frees_blocks_and_others_continue(smollm_llm):
    engine = smollm_llm.engine
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    a = engine.add_request(chat_ids(smollm_llm, "Tell me about cats."), params)
    b = engine.add_request(chat_ids(smollm_llm, "Tell me about dogs."), params)
    for _ in range(3):
        engine.step()
    engine.abort(a)
    assert a not in engine.kv.reqs
    outs = {}
    while engine.has_unfinished() or engine.requests:
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = o
    assert outs[a].finish_reason == "abort" and outs[b].finish_reason == "length"
    assert len(outs[b].token_ids) == 16
    assert engine.kv.check_integrity()["in_use"] == 0


def test_streamed_deltas_never_show_part_of_a_stop_string(smollm_llm):
    engine = smollm_llm.engine
    ids = chat_ids(smollm_llm, "Write a short poem about the sea.")
    full = smollm_llm.generate([ids], SamplingParams(**GREEDY, ignore_eos=True))[0].text
    words = full.split()
    stop = " ".join(words[len(words) // 2: len(words) // 2 + 2])  # a multi-token stop string
    rid = engine.add_request(ids, SamplingParams(**GREEDY, ignore_eos=True, stop=[stop]))
    streamed, final = "", None
    while engine.has_unfinished():
        for o in engine.step():
            if o.request_id == rid:
                streamed += o.delta_text
                final = o if o.finished else final
                assert stop not in streamed and streamed == o.text
    assert final.finish_reason == "stop" and streamed == final.text == full[: full.index(stop)]


def test_final_only_steps_report_finished_requests_whole(smollm_llm):
    """step(final_only=True) (what LLM.generate runs): only requests that ended are reported, each once,
    with the text, token ids and logprobs a streaming consumer ends with; its delta fields hold the
    whole output (nothing was reported before)."""
    engine = smollm_llm.engine
    prompts = [chat_ids(smollm_llm, p) for p in ("Name three colours.", "Count from one to ten.")]
    params = [SamplingParams(temperature=0, max_tokens=12, logprobs=1),
              SamplingParams(temperature=0, max_tokens=20, stop=["five"])]

    def run(final_only: bool) -> tuple[dict, int]:
        rids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
        got, reports = {}, 0
        while engine.has_unfinished():
            for o in engine.step(final_only=final_only):
                reports += 1
                assert o.finished or not final_only
                if o.finished:
                    got[rids.index(o.request_id)] = o
        assert not engine.requests  # every request reported and forgotten
        return got, reports

    streamed, n_streamed = run(False)
    final, n_final = run(True)
    assert n_final == 2 < n_streamed
    for i in (0, 1):
        a, b = streamed[i], final[i]
        assert (b.text, b.token_ids, b.finish_reason, b.stop_reason) == (a.text, a.token_ids, a.finish_reason,
                                                                         a.stop_reason)
        assert b.delta_token_ids == b.token_ids and b.delta_text == b.text
    # the logprobs of the 12 tokens (the second run's prompts hit the prefix cache: rounding may differ)
    la, lb = streamed[0].logprobs, final[0].logprobs
    assert len(lb) == len(la) == 12 and [x["token"] for x in lb] == [x["token"] for x in la]
    assert all(abs(x["logprob"] - y["logprob"]) < 1e-4 for x, y in zip(la, lb))
