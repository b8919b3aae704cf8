"""SamplingParams' derived flags are cached (the engine reads them per request per step) and follow
every change of the fields they come from; copies made by dataclasses.replace compute their own."""

from __future__ import annotations

from dataclasses import replace

from dspark.sampling_params import SamplingParams


def test_derived_flags_follow_the_fields():
    p = SamplingParams(temperature=0.0)
    assert (p.greedy, p.penalized, p.device_verifiable, p.greedy_plain) == (True, False, True, True)
    p.temperature = 0.7
    assert not p.greedy and not p.greedy_plain and p.device_verifiable
    p.presence_penalty = 0.5
    assert p.penalized and not p.device_verifiable
    p.presence_penalty = 0.0
    p.logprobs = 2
    assert not p.penalized and not p.device_verifiable
    q = replace(p, temperature=0.0, logprobs=None)
    assert q.greedy and q.greedy_plain and not p.greedy  # the copy computes its own, p keeps its
    assert q == SamplingParams(temperature=0.0) and p != q  # equality compares the fields only
