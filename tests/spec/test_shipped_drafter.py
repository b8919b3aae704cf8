"""The DSpark drafter dspark ships for SmolLM2-135M-Instruct (dspark/drafters): size limits, loading,
greedy losslessness, and a floor on its greedy acceptance on the CPU.

The acceptance floor here guards the shipped weights against regressions (a broken load, a wrong
tap, a mismatched config all drop τ to ~1.0, which a random drafter gets). It is the figure measured
for the current drafter less a margin, not the issue's target (τ >= 2 on these prompts): see the model
card, dspark/drafters/smollm2-135m-instruct/README.md.
"""

from __future__ import annotations

import json

import pytest

from dspark import LLM, SamplingParams
from dspark.drafters import default_speculative_config, shipped_drafter
from dspark.models.dspark_drafter import DrafterConfig

pytestmark = pytest.mark.slow

PROMPTS = ["Write a short story about a lighthouse keeper who finds a message in a bottle.",
           "Explain how a refrigerator works.",
           "Give me three tips for learning to play the guitar."]
# measured 1.73 on these prompts (fp32, CPU, 64 tokens; the block-5 drafters: session 18 1.74, session 14
# 1.76, session 13 1.70, session 10 1.65, stop 8 1.44: these three generic prompts do not follow the
# held-out ShareGPT gains); a random drafter gives ~1.0
TAU_FLOOR = 1.5
MiB = 2**20


def test_shipped_drafter_files_fit_the_limits():
    d = shipped_drafter(None)
    assert d is not None and d == shipped_drafter("SmolLM2-135M-Instruct")
    assert shipped_drafter("/some/other/model") is None
    files = {f.name: f.stat().st_size for f in d.iterdir() if f.suffix in (".safetensors", ".json")}
    assert all(size <= 16 * MiB for size in files.values()), files
    assert sum(files.values()) <= 64 * MiB
    cfg = DrafterConfig.from_dict(json.loads((d / "config.json").read_text()))
    assert cfg.block_size == 7 and cfg.num_hidden_layers == 2 and cfg.markov_rank == 64
    assert (d / "README.md").is_file()  # the model card
    spec = default_speculative_config(None)
    assert spec["model"] == str(d) and spec["draft_sample_method"] == "probabilistic"
    assert spec["rejection_sample_method"] == "block"


@pytest.fixture(scope="module")
def spec_llm():
    # {"method": "dspark"} without "model": the engine picks the shipped drafter for the default target
    return LLM(device="cpu", dtype="float32", max_model_len=2048, kv_cache_memory_gb=0.5,
               speculative_config={"method": "dspark"})


def test_shipped_drafter_is_lossless_and_accepts(spec_llm, smollm_llm):
    assert spec_llm.engine.spec_config.model == str(shipped_drafter(None))
    prompts = [spec_llm.engine.tokenize_chat([{"role": "user", "content": q}]) for q in PROMPTS]
    greedy = SamplingParams(temperature=0, max_tokens=64)
    from dspark.spec.metrics import SpecStats

    spec_llm.engine.spec_stats = SpecStats()
    spec_out = [o.token_ids for o in spec_llm.generate(prompts, greedy)]
    plain_out = [o.token_ids for o in smollm_llm.generate(prompts, greedy)]
    assert spec_out == plain_out
    st = spec_llm.engine.spec_stats
    assert st.tau >= TAU_FLOOR, (st.tau, st.conditional_acceptance)


def test_shipped_drafter_brings_its_settings_unless_named(spec_llm) -> None:
    """{"method": "dspark"} without "model" gets the shipped drafter with the settings `dspark generate`
    uses for it (probabilistic drafts, block verification: default_speculative_config), not vLLM's
    greedy / standard defaults, which would draft sampled requests by argmax (session 13: T=1 τ 1.27
    instead of 1.76); keys the config names stay as named, and a named drafter keeps vLLM's defaults."""
    sc = spec_llm.engine.spec_config
    assert (sc.model, sc.draft_sample_method, sc.rejection_sample_method) == (
        str(shipped_drafter(None)), "probabilistic", "block")

    def spec_of(config):
        return LLM(device="cpu", dtype="float32", max_model_len=256, kv_cache_memory_gb=0.1,
                   speculative_config=config).engine.spec_config

    named = spec_of({"method": "dspark", "rejection_sample_method": "standard"})
    assert (named.draft_sample_method, named.rejection_sample_method) == ("probabilistic", "standard")
    by_path = spec_of({"model": str(shipped_drafter(None))})  # a drafter named: vLLM's defaults
    assert (by_path.draft_sample_method, by_path.rejection_sample_method) == ("greedy", "standard")
