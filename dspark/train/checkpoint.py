"""Drafter weights out of training: DeepSpec tensor names (the inverse of
``DSparkDrafter.load_state_dict_deepspec``) and safetensors shards of at most 16 MiB each.

Only the drafter's own tensors are written: the embedding and lm_head are the target's. Shards are
``model-0000i-of-0000n.safetensors`` plus ``model.safetensors.index.json`` (HF layout); the engine's
loader reads every ``*.safetensors`` of the directory, so sharded and single-file drafters load alike.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from dspark.models.dspark_drafter import DrafterConfig, DSparkDrafter, random_drafter_state_dict, write_drafter
from dspark.models.llama import LlamaForCausalLM

MAX_SHARD_BYTES = 16 * 2**20


def new_drafter(cfg: DrafterConfig, target: LlamaForCausalLM, max_positions: int, seed: int,
                device: torch.device | str) -> DSparkDrafter:
    """A trainable fp32 drafter (random init, std 0.02) sharing the frozen target's embedding and lm_head."""
    with torch.device(device):
        d = DSparkDrafter(cfg, target.embed_tokens, target.lm_head, max_positions)
    d.load_state_dict_deepspec(random_drafter_state_dict(cfg, seed), target.embed_tokens.weight,
                               target.lm_head.weight_t)
    return d.float().requires_grad_(True)


@torch.no_grad()
def drafter_state_dict(d: DSparkDrafter) -> dict[str, torch.Tensor]:
    """DeepSpec-named tensors (HF [out, in] layout) of the drafter's own weights, on the CPU."""
    c = d.config
    I = c.intermediate_size
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    sd = {"fc.weight": d.fc.weight_t.t(), "hidden_norm.weight": d.hidden_norm.weight, "norm.weight": d.norm.weight}
    for i, layer in enumerate(d.layers):
        p = f"layers.{i}."
        for x, w in zip("qkv", layer.qkv_proj.weight_t.t().split([q, kv, kv])):
            sd[p + f"self_attn.{x}_proj.weight"] = w
        if layer.qkv_proj.bias is not None:
            for x, b in zip("qkv", layer.qkv_proj.bias.split([q, kv, kv])):
                sd[p + f"self_attn.{x}_proj.bias"] = b
        sd[p + "self_attn.o_proj.weight"] = layer.o_proj.weight_t.t()
        if layer.q_norm is not None:
            sd[p + "self_attn.q_norm.weight"] = layer.q_norm.weight
            sd[p + "self_attn.k_norm.weight"] = layer.k_norm.weight
        gate, up = layer.gate_up_proj.weight_t.t().split([I, I])
        sd[p + "mlp.gate_proj.weight"], sd[p + "mlp.up_proj.weight"] = gate, up
        sd[p + "mlp.down_proj.weight"] = layer.down_proj.weight_t.t()
        sd[p + "input_layernorm.weight"] = layer.input_layernorm.weight
        sd[p + "post_attention_layernorm.weight"] = layer.post_attention_layernorm.weight
    if d.markov_w1 is not None:
        sd["markov_head.markov_w1.weight"] = d.markov_w1.weight  # [V, r]
        sd["markov_head.markov_w2.weight"] = d.markov_w2.weight_t.t()  # [V, r]
    if d.confidence is not None:
        sd["confidence_head.proj.weight"] = d.confidence.weight_t.t()  # [1, H + r]
        sd["confidence_head.proj.bias"] = d.confidence.bias
    return {k: v.detach().cpu().contiguous() for k, v in sd.items()}


def save_drafter(path: str | Path, config: dict[str, Any], state_dict: dict[str, torch.Tensor],
                 dtype: torch.dtype = torch.bfloat16, max_shard_bytes: int = MAX_SHARD_BYTES) -> list[Path]:
    """Write config.json and the tensors (cast to dtype) in as few shards of <= max_shard_bytes as the
    tensor order allows; stale *.safetensors in the directory are removed first. Returns the files."""
    from safetensors.torch import save_file

    p = Path(path)
    p.mkdir(parents=True, exist_ok=True)
    for f in [*p.glob("*.safetensors"), p / "model.safetensors.index.json"]:
        f.unlink(missing_ok=True)
    sd = {k: v.to(dtype).contiguous() for k, v in state_dict.items()}
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for k, v in sd.items():
        n = v.numel() * v.element_size()
        if n > max_shard_bytes:
            raise ValueError(f"tensor {k} alone is {n} bytes, over the shard limit of {max_shard_bytes} bytes: "
                             "lower the Markov rank or save in a narrower dtype")
        if shards[-1] and size + n > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][k] = v
        size += n
    if len(shards) == 1:
        write_drafter(p, config, sd)
        return [p / "config.json", p / "model.safetensors"]
    (p / "config.json").write_text(json.dumps(config, indent=2))
    files = [p / "config.json"]
    weight_map: dict[str, str] = {}
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(p / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in shard})
        files.append(p / name)
    total = sum(v.numel() * v.element_size() for v in sd.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (p / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return files + [p / "model.safetensors.index.json"]
