"""dspark's model equals HF transformers': SmolLM2 (from the GGUF) and tiny random Llama/Qwen2/Qwen3."""

from __future__ import annotations

import pytest
import torch

from dspark import LLM, SamplingParams
from tests.conftest import TINY_ARCHS, forward_logits

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a land far away,",
    "List three prime numbers:",
    "Translate to German: The weather is nice today.",
    "import numpy as np\nx = np.arange(10)\n",
    "Q: What is 12 times 12?\nA:",
    "The quick brown fox",
]


def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    """HF ``generate``, greedy, exactly n new tokens: EOS neither stops nor is suppressed (as with
    dspark's ignore_eos). generate falls back to the model's generation_config for an unset EOS, so
    that is where it is cleared."""
    gc = model.generation_config
    saved = gc.eos_token_id
    gc.eos_token_id = None
    try:
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, pad_token_id=0)
    finally:
        gc.eos_token_id = saved
    out = out[0, len(ids):].tolist()
    assert len(out) == n
    return out


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.slow
def test_smollm2_logits_match_hf(smollm_llm, hf_smollm):
    ids = smollm_llm.tokenizer(PROMPTS[2] + " " + PROMPTS[4])["input_ids"]
    ours = forward_logits(smollm_llm.engine, ids)
    with torch.no_grad():
        ref = hf_smollm(torch.tensor([ids])).logits[0].float()
    assert rel_err(ours, ref) < 1e-4


@pytest.mark.slow
def test_smollm2_greedy_matches_hf_generate(smollm_llm, hf_smollm):
    tok = smollm_llm.tokenizer
    prompts = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True)
               for p in PROMPTS]
    prompts = [p if isinstance(p, list) else p["input_ids"] for p in prompts]
    outs = smollm_llm.generate(prompts, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True))
    for ids, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(hf_smollm, ids, 64)


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_tiny_checkpoint_matches_hf(arch, tiny_checkpoints):
    import transformers

    path = tiny_checkpoints[arch]
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(str(path), device="cpu", dtype="float32", block_size=4, num_kv_blocks=256)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(2, 512, (n,), generator=g).tolist() for n in (5, 17, 33, 9)]
    ours = forward_logits(llm.engine, prompts[1])
    with torch.no_grad():
        want = ref(torch.tensor([prompts[1]])).logits[0]
    assert rel_err(ours, want) < 1e-4
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    for ids, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(ref, ids, 24)
    llm.engine.kv.check_integrity()
