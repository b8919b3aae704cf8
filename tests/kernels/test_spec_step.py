"""The one-launch glue kernels of a one-sync DSpark step (dspark/kernels/spec_step.py) against their
PyTorch references, in Triton's interpreter: greedy verification (every acceptance length, strided
rows), the rows of a block launched on top of another (shift, slots across block boundaries, a
gather of the previous step's rows), and the drafter's inputs (commit override, padding rows)."""

from __future__ import annotations

import pytest
import torch

from dspark.kernels.spec_step import (drafter_inputs, drafter_inputs_reference, shift_rows, shift_rows_reference,
                                      verify_greedy_reference, verify_greedy_rows)


@pytest.mark.parametrize("q", [1, 5, 8])
def test_verify_greedy_rows(q: int) -> None:
    g = torch.Generator().manual_seed(q)
    B, N = 24, q - 1
    am = torch.randint(0, 4, (B, q), generator=g)
    # rows of a graph's input ids: [anchor | drafts], drafts a strided view; matches made likely
    ids = torch.randint(0, 4, (B + 2, q), generator=g)
    ids[:B, 1:] = torch.where(torch.rand(B, N, generator=g) < 0.7, am[:, :N], ids[:B, 1:])
    drafts = ids[:B, 1:]
    nd = torch.randint(0, N + 1, (B,), generator=g)
    nd[:3] = N  # some rows verify every draft (all accepted: the bonus token)
    ids[0, 1:] = am[0, :N]
    got = verify_greedy_rows(am, drafts, nd)
    want = verify_greedy_reference(am, drafts, nd)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert int(got[1][0]) == N + 1  # row 0: every draft accepted
    assert len(set(got[1].tolist())) > 1 or q == 1
    # rows at temperature > 0 take the sampled verification's outcome, written into given buffers
    t = torch.where(torch.rand(B, generator=g) < 0.5, 0.0, torch.rand(B, generator=g) + 0.1)
    t[1] = float("nan")  # not > 0: the greedy outcome, as torch.where(t > 0, ..) picks it
    so = torch.randint(0, 9, (B, q + 2), generator=g)[:, :q]  # strided rows
    sn = torch.randint(1, q + 1, (B,), generator=g)
    out, n_out = torch.full((B, q), -7), torch.full((B,), -7)
    got = verify_greedy_rows(am, drafts, nd, sampled=(t, so, sn), out=out, n_out=n_out)
    want = verify_greedy_reference(am, drafts, nd, sampled=(t, so, sn))
    assert got[0] is out and got[1] is n_out
    assert torch.equal(out, want[0]) and torch.equal(n_out, want[1])
    assert 0 < int((t > 0).sum()) < B and not torch.equal(want[0], verify_greedy_reference(am, drafts, nd)[0])
    with pytest.raises(ValueError, match="out / n_out"):
        verify_greedy_rows(am, drafts, nd, out=torch.zeros(B, q, dtype=torch.int32))


def _graph_inputs(B: int, q: int, bs: int, g: torch.Generator):
    width = 6
    starts = torch.randint(q, width * bs - q, (B,), generator=g)
    positions = (starts[:, None] + torch.arange(q)[None, :]).reshape(-1)
    tables = torch.randperm(64, generator=g)[:B * width].view(B, width)
    slots = torch.zeros(B * q, dtype=torch.int64)
    ids = torch.randint(0, 100, (B * q,), generator=g)
    seq = (starts + q).to(torch.int32)
    ntok = starts + 1
    return positions, slots, ids, seq, ntok, tables


@pytest.mark.parametrize("gather", [False, True])
def test_shift_rows(gather: bool) -> None:
    g = torch.Generator().manual_seed(3 + gather)
    B, q, bs, R = 5, 6, 4, 7
    inputs = _graph_inputs(B, q, bs, g)
    n_out = torch.randint(1, q + 1, (R,), generator=g)
    out = torch.randint(0, 100, (R, q + 3), generator=g)[:, :q]  # the previous step's emitted tokens, strided rows
    drafts = torch.randint(0, 100, (R, q + 2), generator=g)[:, :q - 1]  # strided rows
    idx = torch.tensor([6, 0, 3, 2, 5]) if gather else None
    got = [t.clone() for t in inputs]
    want = [t.clone() for t in inputs]
    shift_rows(*got, q, bs, n_out, out, drafts, idx)
    shift_rows_reference(*want, q, bs, n_out, out, drafts, idx)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    rows = idx if gather else torch.arange(B)  # the anchor: the last token each request's previous step emitted
    assert torch.equal(want[2].view(B, q)[:, 0], out[rows, n_out[rows] - 1])
    assert not torch.equal(got[0], inputs[0])  # something moved


@pytest.mark.parametrize("commit", [False, True])
def test_drafter_inputs(commit: bool) -> None:
    g = torch.Generator().manual_seed(7 + commit)
    B, Bg, q = 5, 8, 6
    out = torch.randint(0, 100, (B, q + 3), generator=g)[:, :q]  # strided rows
    n_out = torch.randint(1, q + 1, (B,), generator=g)
    c = None
    if commit:  # prefill rows: commit all real rows, emit one token or none
        n_out[1] = 0
        c = n_out.clone()
        c[1], c[2] = q, 3
    ntok = torch.randint(1, 50, (Bg,), generator=g)
    bufs = [torch.ones(Bg * q, dtype=torch.bool), torch.full((Bg,), 9), torch.full((Bg,), 9)]
    got = [t.clone() for t in bufs]
    want = [t.clone() for t in bufs]
    drafter_inputs(out, n_out, c, ntok, *got, q)
    drafter_inputs_reference(out, n_out, c, ntok, *want, q)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    assert not got[0][B * q:].any() and int(got[1][B:].abs().sum()) == 0
