"""Where the fused sampler's time goes on independent rows (``processed_probs``), per kernel, at R rows of
SmolLM2's 49,152 logits: torch.profiler over repeated calls, CUDA time per kernel name.

    python benchmarks/kernel_topp_profile.py [--rows 256] [--calls 20]
"""

from __future__ import annotations

import argparse

import torch

import dspark.kernels  # noqa: F401
import dspark.kernels.markov_sampler as ms
from dspark.kernels.markov_sampler import processed_probs
from dspark.sample.sampler import SamplingBatch
from dspark.sampling_params import SamplingParams

V = 49152
CASES = {  # name -> (top_p, logit scale, hot tokens)
    "peaked": (0.9, 2.0, 24),
    "flat": (0.9, 1.0, 0),
    "mixed (1 in 8 flat)": (0.9, None, 24),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--radix", default="1,2", help="TOPP_RADIX values to compare (1: overflow rows only, 2: all)")
    ap.add_argument("--radix-block", default="256,1024", help="RADIX_BLOCK values to compare")
    a = ap.parse_args()
    for mode in map(int, a.radix.split(",")):
        for block in map(int, a.radix_block.split(",")):
            ms.TOPP_RADIX, ms.RADIX_BLOCK = mode, block
            print(f"##### TOPP_RADIX {mode}, RADIX_BLOCK {block}")
            profile(a)


def profile(a) -> None:
    R = a.rows
    for name, (top_p, scale, hot) in CASES.items():
        g = torch.Generator(device="cuda").manual_seed(0)
        logits = torch.randn(R, V, device="cuda", generator=g) * (scale or 2.0)
        if hot:
            idx = torch.randint(0, V, (R, hot), device="cuda", generator=g)
            logits.scatter_add_(1, idx, 6.0 + 8.0 * torch.rand(R, hot, device="cuda", generator=g))
        if scale is None:  # every 8th row flat
            logits[::8] = torch.randn(len(range(0, R, 8)), V, device="cuda", generator=g)
        batch = SamplingBatch.build([SamplingParams(temperature=1.0, top_p=top_p)] * R, list(range(R)), [0] * R,
                                    [[]] * R, [[]] * R, V, "cuda")
        out = torch.empty(R, V, device="cuda")
        paths = torch.empty(R, dtype=torch.int32, device="cuda")
        processed_probs(logits, batch, probs_out=out, _paths=paths)
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(a.calls):
                processed_probs(logits, batch, probs_out=out)
            torch.cuda.synchronize()
        print(f"== {name}: {R} rows, paths {torch.bincount(paths.cpu().clamp(min=0), minlength=5).tolist()} "
              f"(0 none, 1 sorted, 2 bisection, 4 radix)")
        total = sum(e.device_time_total for e in prof.key_averages()) / a.calls / 1000
        print(f"  all kernels {total:.3f} ms/call")
        for e in sorted(prof.key_averages(), key=lambda e: -e.device_time_total)[:3]:
            print(f"  {e.key[:60]:<60} {e.count // a.calls:>3}/call {e.device_time_total / a.calls / 1000:8.3f} ms/call")


if __name__ == "__main__":
    main()
