"""Linear layer with its weight stored input-major: ``y = x @ W_t (+ b)``, ``W_t: [in, out]``.

Why not nn.Linear: on the CPU, MKL's matrix-vector path reads an ``[in, out]`` weight much faster at
one query row (batch-1 decode) than nn.Linear's ``[out, in]``: measured on the 2-core CI machine,
SmolLM2's 120 layer matrices took 29 ms instead of 41 ms per token, and its 49152x576 lm_head
5.9 ms instead of 10.8 ms. On the GPU cuBLAS reads either layout at the same speed.

Split-K on the CPU (``use_cpu_split_k``): MKL multiplies one or a few query rows by a weight on ONE
core (measured on the 2-core CI machine: the same 32 ms per token with 1 or 2 threads), so half the
memory bandwidth sits idle, and at 6 rows (a verification step) it is 2x slower still. Viewing the
input-major weight as ``[c, in/c, out]`` (a view: no copy, no extra memory) and the input as
``[c, rows, in/c]`` turns the product into a ``bmm`` of c partial products, which MKL spreads over the
threads, summed afterwards. SmolLM2's 121 matrices: 32.0 -> 20.6 ms at one row. From two rows on
(batch-2 decode, verification, prefill) oneDNN's inner product over the same weight's ``[out, in]`` view
is faster still (6 rows: 67.7 ms MKL, 45.6 split-K, 30.4 oneDNN; a whole SmolLM2 step of 2 rows with
torch 2.13: 24.5 ms split-K, 19.8 oneDNN, against 17.4 / 19.3 at one row). Both sum in a different order
than one MKL GEMV, so results differ in the last bits (fp32 logits ~1e-6 relative), as any change of kernel
does.

Which of the two is faster at two rows depends on the machine: on another VM of the same 2-core class (session
42, 2026-12-05) a whole 2-row SmolLM2 step took 49.2 ms on oneDNN and 42.4-44.1 ms split-K (three rounds), the
reverse of the figures above. So the limit is per layer (``Linear.split_k_max_rows``, set with
``use_cpu_split_k``) and the CPU runner measures both at start-up (``ModelRunner._choose_split_k_rows``).

Half precision on the CPU is the other way round: torch 2.13's bf16 product reads an input-major weight about
10x slower than the same weight output-major (2 threads, this 2-core VM, a 576x1536 matrix: 1,315 against 123 µs
at one row, 6,800 against 612 at 5, 44,790 against 3,800 at 32; fp16 1,638 against 125 at one row, 7,593 against
517 at 5; fp32 108-620 µs either way), so the CPU runner re-lays bf16/fp16 weights ``[out, in]``
(``use_output_major``) and splits nothing: ``dspark bench --device cpu --dtype bfloat16`` (SmolLM2, ShareGPT,
greedy) went from 2.4 to 20.7 tok/s at batch 1 (HF eager: 19.8-20.6) and from 2.0 to 18.6 at batch 4
(docs/benchmarks.md, session 48). fp32 stays the CPU's default dtype.
"""

from __future__ import annotations

import os

import torch
from torch import nn


SPLIT_K_MAX_ROWS = 1  # the default limit: more rows than this go to oneDNN's inner product (below)
# oneDNN's inner product (the op inductor's CPU fusion uses), reading the [out, in] view of W_t: at 2+ rows
# it beats both MKL's GEMM and split-K (SmolLM2, 6 rows: 45.6 ms split-K, 30.4 ms oneDNN; 2,048 rows: 44.4 ms
# MKL, 36.5 ms oneDNN, one 576x3072 matrix). It was 3+ rows until 2026-12-05, when 2 rows measured faster too
# (batch-2 greedy decoding on the 2-core CI machine: 72.4 -> 89.0 tok/s).
_onednn_linear = getattr(getattr(torch.ops, "mkldnn", None), "_linear_pointwise", None)
if not torch.backends.mkldnn.is_available():
    _onednn_linear = None


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.weight_t = nn.Parameter(torch.empty(in_features, out_features), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out_features), requires_grad=False) if bias else None
        self.split_k = 1  # > 1: CPU split-K bmm over this many input slices (see the module docstring)
        self.split_k_max_rows = SPLIT_K_MAX_ROWS  # products of more rows than this: oneDNN (the CPU, split_k > 1)
        self.batch_invariant = False  # True: dspark/kernels/matmul.py (row results independent of the row count)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, out]
        if self.batch_invariant:
            from dspark.kernels.matmul import matmul_invariant

            return matmul_invariant(x, self.weight_t, self.bias)
        c = self.split_k
        if c > 1 and x.device.type == "cpu":
            k, n = self.weight_t.shape
            rows = x.reshape(-1, k)
            if rows.shape[0] <= self.split_k_max_rows:
                part = torch.bmm(rows.view(rows.shape[0], c, k // c).transpose(0, 1), self.weight_t.view(c, k // c, n))
                y = part.sum(0)
                if self.bias is not None:
                    y = y + self.bias
            elif _onednn_linear is not None and x.dtype == torch.float32:
                y = _onednn_linear(rows, self.weight_t.t(), self.bias, "none", [], "")
            else:
                y = torch.matmul(rows, self.weight_t) if self.bias is None else torch.addmm(self.bias, rows, self.weight_t)
            return y.view(*x.shape[:-1], n)
        if self.bias is None:
            return torch.matmul(x, self.weight_t)
        return torch.addmm(self.bias, x, self.weight_t)

    @torch.no_grad()
    def load(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        """Copy an HF-layout ``[out, in]`` weight (and bias)."""
        if tuple(weight.shape) != tuple(self.weight_t.shape[::-1]):
            from dspark.models.errors import ModelLoadError

            raise ModelLoadError(f"weight has shape {tuple(weight.shape)}, expected {tuple(self.weight_t.shape[::-1])}")
        self.weight_t.copy_(weight.t())
        if bias is not None:
            self.bias.copy_(bias)


def use_cpu_split_k(module: nn.Module, chunks: int | None = None, max_rows: int = SPLIT_K_MAX_ROWS) -> int:
    """Switch every Linear in ``module`` whose input size divides evenly to the CPU split-K path with
    ``chunks`` slices (default: torch's intra-op thread count, at most 8; 1 turns it off) for products of
    up to ``max_rows`` rows (more: oneDNN). Returns how many layers were switched."""
    c = min(torch.get_num_threads(), 8) if chunks is None else chunks
    n = 0
    for m in module.modules():
        if isinstance(m, Linear):
            m.split_k = c if c > 1 and m.weight_t.shape[0] % c == 0 and m.weight_t.is_contiguous() else 1
            m.split_k_max_rows = max_rows
            n += m.split_k > 1
    return n


# On CUDA, store the decoder's weights output-major (``[out, in]`` contiguous, ``weight_t`` a transposed
# view of it), which changes the cuBLAS kernel cuBLAS picks for few-row products. Off until measured
# faster on the GPU (benchmarks/gpu_fastpath_check.py, part gemm/engine); see docs/benchmarks.md.
# DSPARK_CUDA_OUTPUT_MAJOR=1 turns it on (for benchmarks).
CUDA_OUTPUT_MAJOR = os.environ.get("DSPARK_CUDA_OUTPUT_MAJOR") == "1"


def use_output_major(module: nn.Module, dtypes: tuple[torch.dtype, ...] | None = None) -> int:
    """Re-lay every Linear weight in ``module`` (of one of ``dtypes``, if given) as ``[out, in]`` contiguous,
    keeping ``weight_t`` as its ``[in, out]`` transposed view (so every product reads the same values; cuBLAS
    gets the "T" operand). Returns how many layers were re-laid."""
    n = 0
    for m in module.modules():
        if isinstance(m, Linear) and m.weight_t.is_contiguous() and (dtypes is None or m.weight_t.dtype in dtypes):
            m.weight_t.data = m.weight_t.data.t().contiguous().t()
            n += 1
    return n


def use_batch_invariant(module: nn.Module) -> int:
    """Route every Linear in ``module`` through the batch-invariant Triton matmul
    (EngineConfig.batch_invariant). Returns how many layers were switched."""
    n = 0
    for m in module.modules():
        if isinstance(m, Linear):
            m.batch_invariant = True
            n += 1
    return n
