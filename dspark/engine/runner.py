"""Model runner: owns the model, the KV tensors and the sampler; turns a SchedulerOutput into tokens.

Per step it builds the flattened inputs (input ids, positions, slot mapping, block tables, query
start locations), lets the attention backend prepare its metadata once, runs the model, computes
logits only for rows that sample, and samples them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dspark.config import EngineConfig
from dspark.engine.kv_cache import KVCacheManager
from dspark.engine.scheduler import SchedulerOutput
from dspark.layers.attention import BatchLayout, TorchAttentionBackend
from dspark.models.llama import LlamaForCausalLM
from dspark.models.loader import LoadedModel
from dspark.sample.sampler import Sampler, SamplingBatch


@dataclass
class StepResult:
    new_tokens: dict[str, list[int]]  # request id -> emitted tokens (requests that sampled)
    logprobs: dict[str, list[dict]]  # request id -> per emitted token {"token", "logprob", "top"}


class ModelRunner:
    def __init__(self, loaded: LoadedModel, config: EngineConfig, tap_layers: tuple[int, ...] = ()) -> None:
        self.config = config
        self.device = torch.device(config.device)
        self.model_config = mc = loaded.config
        with torch.device(self.device):
            # RoPE table covers every position a request can reach, drafts included.
            self.model = LlamaForCausalLM(mc, config.max_model_len + 64, tap_layers).to(config.dtype)
        self.model.load_hf_state_dict(loaded.state_dict)
        self.model.eval()
        self.vocab_size = mc.vocab_size
        self.block_size = config.block_size
        bytes_per_block = 2 * mc.num_hidden_layers * config.block_size * mc.num_key_value_heads * mc.head_dim
        bytes_per_block *= torch.empty((), dtype=config.dtype).element_size()
        self.num_kv_blocks = config.num_kv_blocks or max(2, int(config.kv_cache_memory_gb * 2**30 // bytes_per_block))
        # [L, 2 (K, V), num_blocks, block_size, Hkv, D]
        self.kv_caches = torch.zeros(
            mc.num_hidden_layers, 2, self.num_kv_blocks, config.block_size, mc.num_key_value_heads, mc.head_dim,
            dtype=config.dtype, device=self.device,
        )
        self.backend = TorchAttentionBackend()
        self.sampler = Sampler()

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput, kv: KVCacheManager) -> StepResult:
        scheduled = sched.scheduled
        ids: list[int] = []
        starts: list[int] = []
        qsl = [0]
        seq_lens: list[int] = []
        tables: list[list[int]] = []
        for s in scheduled:
            r = s.request
            a = r.num_computed_tokens
            b = a + s.num_tokens
            toks = r.token_ids[a:b] if b <= r.num_tokens else (r.token_ids + r.spec_token_ids)[a:b]
            ids.extend(toks)
            starts.append(a)
            qsl.append(qsl[-1] + s.num_tokens)
            seq_lens.append(b)
            tables.append(kv.block_ids(r.request_id))
        dev = self.device
        q_lens = torch.tensor([s.num_tokens for s in scheduled])
        req_of_row = torch.repeat_interleave(torch.arange(len(scheduled)), q_lens)  # [T]
        positions = torch.tensor(starts)[req_of_row] + torch.arange(qsl[-1]) - torch.tensor(qsl[:-1])[req_of_row]
        width = max(len(t) for t in tables)
        block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int64)
        bs = self.block_size
        slot_mapping = block_tables[req_of_row, positions // bs] * bs + positions % bs
        layout = BatchLayout(
            positions=positions.to(dev),
            slot_mapping=slot_mapping.to(dev),
            query_start_loc=qsl,
            seq_lens=seq_lens,
            block_tables=block_tables.to(dev),
            block_size=bs,
        )
        meta = self.backend.prepare(layout)
        hidden, _ = self.model(torch.tensor(ids, device=dev), layout.positions, self.backend, meta, self.kv_caches)

        sampling = [(b, s) for b, s in enumerate(scheduled) if s.samples]
        if not sampling:
            return StepResult({}, {})
        rows = torch.tensor([qsl[b + 1] - 1 for b, _ in sampling], device=dev)
        logits = self.model.compute_logits(hidden[rows])  # [S, V] fp32
        reqs = [s.request for _, s in sampling]
        batch = SamplingBatch.build(
            [r.params for r in reqs],
            [r.seed for r in reqs],
            [r.num_tokens for r in reqs],  # the position the new token will take
            [r.prompt_token_ids for r in reqs],
            [r.output_token_ids for r in reqs],
            self.vocab_size,
            dev,
        )
        tokens = self.sampler(logits, batch)
        new = tokens.tolist()
        result = StepResult({r.request_id: [t] for r, t in zip(reqs, new)}, {})
        want = [i for i, r in enumerate(reqs) if r.params.logprobs is not None]
        if want:
            k = max(reqs[i].params.logprobs for i in want)
            idx = torch.tensor(want, device=dev)
            lp, top_ids, top_lp = self.sampler.logprobs(logits[idx], tokens[idx], k)
            for j, i in enumerate(want):
                n = reqs[i].params.logprobs
                result.logprobs[reqs[i].request_id] = [{
                    "token": new[i],
                    "logprob": float(lp[j]),
                    "top": list(zip(top_ids[j, :n].tolist(), top_lp[j, :n].tolist())),
                }]
        return result
