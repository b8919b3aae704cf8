"""`dspark bench correctness`: the real command on the embedded default model (SmolLM2-135M + the shipped
drafter + HF transformers on the same GGUF weights) on the CPU in fp32, a few tokens; and the
divergence helpers (first diverging position, fp32 reference logit gap) on hand-made inputs."""

from __future__ import annotations

import json

import pytest
import torch

from dspark.bench.correctness import (PAIRS, compare, first_divergence, format_report, reference_gap,
                                      summarize)
from dspark.cli import main
from dspark.drafters import shipped_drafter


@pytest.mark.skipif(shipped_drafter(None) is None, reason="the shipped drafter's weights are not installed")
def test_cli_correctness_on_the_default_model_cpu_fp32(tmp_path, one_thread, capsys):
    out = tmp_path / "correctness.json"
    rc = main(["bench", "correctness", "--device", "cpu", "--kv-cache-memory-gb", "0.05", "--prompts", "code",
               "--num-prompts", "2", "--max-tokens", "8", "--hf-control-batch-size", "2", "--out", str(out)])
    assert rc == 0
    stdout = capsys.readouterr().out
    res = json.loads(out.read_text())
    assert res["model"] == "smollm2-135m-instruct" and res["device"] == "cpu" and res["dtype"] == "torch.float32"
    assert res["num_prompts"] == 2 and res["max_tokens"] == 8 and res["fixed_length"] is True
    assert res["speculative_config"]["num_spec_tokens"] >= 1
    assert res["hf"] == {"mode": "eager", "batch_size": 1, "left_padding": False, "dtype": "torch.float32",
                         "control_batch_size": 2}
    assert set(res["summary"]) == set(PAIRS) and len(res["records"]) == 2
    for i, r in enumerate(res["records"]):
        assert r["index"] == i and r["prompt_tokens"] > 0 and r["prompt"]
        assert set(r["tokens"]) == {"dspark_plain", "dspark_spec", "hf", "hf_control"}
        assert all(len(t) == 8 for t in r["tokens"].values())
        # greedy speculation is lossless: in fp32 on the CPU DSpark generates exactly what dspark does without it
        assert r["spec_vs_plain"]["identical"] and r["tokens"]["dspark_spec"] == r["tokens"]["dspark_plain"]
        assert r["plain_vs_hf"]["identical"] == (r["tokens"]["dspark_plain"] == r["tokens"]["hf"])
        # HF batched with left padding (the two code prompts differ in length) = HF alone, in fp32
        assert r["hf_vs_hf"]["identical"] and r["tokens"]["hf_control"] == r["tokens"]["hf"]
    s = res["summary"]["spec_vs_plain"]
    assert s["compared"] == 2 and s["identical"] == 2 and s["fraction_identical"] == 1.0 and s["passed"] is True
    assert res["summary"]["plain_vs_hf"]["compared"] == 2 and res["summary"]["hf_vs_hf"]["identical"] == 2
    assert res["records"][0]["prompt_tokens"] != res["records"][1]["prompt_tokens"]  # so the control pads
    assert "dspark + DSpark vs dspark (no spec): 2/2 identical (100.0%), meets the 95% threshold" in stdout


def test_first_divergence_and_compare():
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3, 4], [1, 2, 7, 4]) == 2
    assert first_divergence([5, 2], [1, 2]) == 0
    assert first_divergence([1, 2], [1, 2, 3]) == 2  # a proper prefix: differs where the shorter ends
    assert first_divergence([], []) is None
    assert compare([1, 2, 3], [1, 2, 3]) == dict(identical=True, position=None, length_a=3, length_b=3,
                                                 token_a=None, token_b=None)
    assert compare([9, 8, 7, 6], [9, 8, 5, 6]) == dict(identical=False, position=2, length_a=4, length_b=4,
                                                       token_a=7, token_b=5)
    assert compare([9, 8], [9, 8, 5]) == dict(identical=False, position=2, length_a=2, length_b=3,
                                              token_a=None, token_b=5)


def test_reference_gap_and_summary_and_report(tiny_checkpoints):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_checkpoints["llama"]).eval()
    ids = [3, 14, 15, 92, 65]
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, -1].float()
    order = torch.argsort(logits, descending=True).tolist()
    a, b = order[1], order[4]  # the 2nd and 5th most likely tokens
    ref = reference_gap(model, ids, a, b)
    assert ref["top1"] == order[0] and ref["top2"] == order[1]
    assert ref["top2_gap"] == pytest.approx(float(logits[order[0]] - logits[order[1]]), abs=1e-5)
    assert ref["pair_gap"] == pytest.approx(float(logits[a] - logits[b]), abs=1e-5) and ref["pair_gap"] > 0
    assert ref["rank_a"] == 1 and ref["rank_b"] == 4 and ref["argmax_is"] == "neither"
    assert reference_gap(model, ids, order[0], a)["argmax_is"] == "a"

    div = compare([1, 2, a], [1, 2, b]) | dict(reference=ref, near_tie=False, token_a_text=f"{a} 'x'",
                                               token_b_text=f"{b} 'y'", context="..")
    records = [dict(index=0, spec_vs_plain=compare([1, 2], [1, 2]), plain_vs_hf=div),
               dict(index=1, spec_vs_plain=compare([1, 2], [1, 2]), plain_vs_hf=compare([4], [4]))]
    s = summarize(records, "plain_vs_hf", 0.95)
    assert (s["compared"], s["identical"], s["fraction_identical"], s["passed"]) == (2, 1, 0.5, False)
    assert s["other_divergences"] == 1 and s["near_tie_divergences"] == 0 and s["first_divergence_positions"] == [2]
    assert s["reference_argmax"] == {"a": 0, "b": 0, "neither": 1}  # the reference's argmax is order[0]
    assert summarize(records, "spec_vs_plain", 0.95)["passed"] is True
    text = format_report(dict(summary={p: summarize(records, p, 0.95) for p in PAIRS}, records=records,
                              near_tie_gap=0.5))
    assert "PASS" in text and "MISS" in text and "plain_vs_hf" in text and f"{ref['pair_gap']:.3f}" in text
    assert "argmax is dspark's token in 0, HF's in 0, neither in 1" in text
