"""Prometheus metrics of the server (``GET /metrics``), named like vLLM's with a ``dspark:`` prefix.

Each app gets its own registry, so several servers can live in one process (tests). Latencies are
measured on the server from the moment the HTTP request arrived, i.e. what a client sees minus the
network. Counters of tokens and finished requests are fed from the engine thread (prometheus_client
is thread-safe); gauges are read from the engine thread's last published snapshot at scrape time.

Speculative decoding: when a finished request's ``stats`` carry ``spec_*`` keys, they feed

* ``dspark:spec_decode_num_drafts_total``            drafting rounds (``spec_num_drafts``)
* ``dspark:spec_decode_num_accepted_tokens_total``   accepted draft tokens (``spec_num_accepted``)
* ``dspark:spec_decode_num_accepted_tokens_per_pos_total{position}``  (``spec_accepted_per_position``)
* ``dspark:spec_decode_num_emitted_tokens_total`` and ``dspark:spec_decode_num_steps_total``: output
  tokens of speculating requests and their verification steps (tokens / ``spec_tau``), so that
  τ = emitted / steps over any window (``dspark bench serve`` uses the deltas)
* ``dspark:spec_decode_mean_acceptance_length`` (τ, since start) and
  ``dspark:spec_decode_acceptance_rate_per_pos{position}`` (accepted at k / drafting rounds).
"""

from __future__ import annotations

import threading
from typing import Any, Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                   20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TOKEN_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15,
                         0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
KNOWN_ROUTES = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics",
                          "/debug/kv", "/version"})

disable_created_metrics()  # no *_created series: they only add noise to a scrape


class _EngineStateCollector(Collector):
    def __init__(self, metrics: "ServerMetrics") -> None:
        self.m = metrics

    def collect(self) -> Iterable[GaugeMetricFamily]:
        m = self.m
        labels = ["model_name"]
        snap = m.engine_client.snapshot if m.engine_client is not None else {}

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=labels)
            g.add_metric([m.model_name], float(value))
            return g

        yield gauge("dspark:num_requests_running", "Requests in the engine's running batch.", snap.get("running", 0))
        yield gauge("dspark:num_requests_waiting", "Requests waiting to be scheduled.", snap.get("waiting", 0))
        yield gauge("dspark:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (1 = full).",
                    snap.get("kv_usage", 0.0))
        yield gauge("dspark:prefix_cache_hit_rate", "Prompt tokens served from the prefix cache / prompt tokens.",
                    snap.get("prefix_hit_rate", 0.0))
        alive = m.engine_client.alive if m.engine_client is not None else False
        yield gauge("dspark:engine_alive", "1 while the engine thread serves requests.", 1.0 if alive else 0.0)
        with m._lock:
            tau = m.tau()
            rates = m.acceptance_rates()
        if tau is not None:
            yield gauge("dspark:spec_decode_mean_acceptance_length",
                        "tau: mean tokens emitted per verification step of speculating requests.", tau)
        if rates:
            g = GaugeMetricFamily("dspark:spec_decode_acceptance_rate_per_pos",
                                  "Fraction of drafting rounds whose draft at this position was accepted.",
                                  labels=["model_name", "position"])
            for k, r in enumerate(rates):
                g.add_metric([m.model_name, str(k)], r)
            yield g


class ServerMetrics:
    def __init__(self, model_name: str, engine_client: Any = None) -> None:
        self.model_name = model_name
        self.engine_client = engine_client
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        ml = ["model_name"]
        self.http_requests = Counter("dspark:http_requests", "HTTP requests by route and status code.",
                                     ["route", "status"], registry=r)
        self.request_success = Counter("dspark:request_success", "Finished engine requests by finish reason.",
                                       ["model_name", "finished_reason"], registry=r)
        self.prompt_tokens = Counter("dspark:prompt_tokens", "Prompt tokens of admitted requests.", ml, registry=r)
        self.generation_tokens = Counter("dspark:generation_tokens", "Generated tokens.", ml, registry=r)
        self.ttft = Histogram("dspark:time_to_first_token_seconds", "Time to first token (from HTTP arrival).",
                              ml, buckets=LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("dspark:time_per_output_token_seconds",
                              "Mean time per output token after the first, per request.", ml,
                              buckets=TOKEN_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("dspark:inter_token_latency_seconds",
                             "Gap between successive outputs of a request, per token.", ml,
                             buckets=TOKEN_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("dspark:e2e_request_latency_seconds", "End-to-end request latency.", ml,
                             buckets=LATENCY_BUCKETS, registry=r)
        self.spec_drafts = Counter("dspark:spec_decode_num_drafts", "Drafting rounds (speculative decoding).",
                                   ml, registry=r)
        self.spec_accepted = Counter("dspark:spec_decode_num_accepted_tokens", "Accepted draft tokens.", ml,
                                     registry=r)
        self.spec_accepted_pos = Counter("dspark:spec_decode_num_accepted_tokens_per_pos",
                                         "Accepted draft tokens by draft position.", ["model_name", "position"],
                                         registry=r)
        self.spec_emitted = Counter("dspark:spec_decode_num_emitted_tokens",
                                    "Output tokens of requests that speculated.", ml, registry=r)
        self.spec_steps = Counter("dspark:spec_decode_num_steps",
                                  "Verification steps of requests that speculated (output tokens / tau).", ml,
                                  registry=r)
        self._lock = threading.Lock()
        self._tot_emitted = 0.0
        self._tot_steps = 0.0
        self._tot_drafts = 0.0
        self._tot_pos: list[float] = []
        self.registry.register(_EngineStateCollector(self))

    # ---------------------------------------------------------------- engine thread
    def on_prompt(self, num_tokens: int) -> None:
        self.prompt_tokens.labels(self.model_name).inc(num_tokens)

    def on_outputs(self, outputs: list[Any]) -> None:
        n = sum(len(o.delta_token_ids) for o in outputs)
        if n:
            self.generation_tokens.labels(self.model_name).inc(n)
        for o in outputs:
            if o.finished:
                self.request_success.labels(self.model_name, str(o.finish_reason)).inc()
                self._spec(o.stats or {})

    def _spec(self, stats: dict[str, Any]) -> None:
        keys = ("spec_tau", "spec_num_drafts", "spec_num_accepted", "spec_accepted_per_position")
        if not any(stats.get(k) is not None for k in keys):
            return
        ml = self.model_name
        with self._lock:
            drafts = _num(stats.get("spec_num_drafts"))
            if drafts is not None:
                self.spec_drafts.labels(ml).inc(drafts)
                self._tot_drafts += drafts
            acc = _num(stats.get("spec_num_accepted"))
            if acc is not None:
                self.spec_accepted.labels(ml).inc(acc)
            per_pos = stats.get("spec_accepted_per_position")
            if isinstance(per_pos, dict):
                per_pos = [per_pos[k] for k in sorted(per_pos, key=lambda x: int(x))]
            if isinstance(per_pos, (list, tuple)):
                for k, v in enumerate(per_pos):
                    v = _num(v)
                    if v is None:
                        continue
                    self.spec_accepted_pos.labels(ml, str(k)).inc(v)
                    while len(self._tot_pos) <= k:
                        self._tot_pos.append(0.0)
                    self._tot_pos[k] += v
            tau = _num(stats.get("spec_tau"))
            out_toks = _num(stats.get("num_output_tokens"))
            steps = None
            if tau and out_toks:
                steps = out_toks / tau
            elif drafts and acc is not None and out_toks:  # tau = 1 + accepted / rounds
                steps = out_toks / (1.0 + acc / drafts)
            if steps:
                self.spec_emitted.labels(ml).inc(out_toks)
                self.spec_steps.labels(ml).inc(steps)
                self._tot_emitted += out_toks
                self._tot_steps += steps

    def tau(self) -> float | None:
        return self._tot_emitted / self._tot_steps if self._tot_steps else None

    def acceptance_rates(self) -> list[float]:
        if not self._tot_drafts:
            return []
        return [v / self._tot_drafts for v in self._tot_pos]

    # ---------------------------------------------------------------- event loop
    def observe_request(self, ttft: float | None, e2e: float, num_output_tokens: int) -> None:
        ml = self.model_name
        self.e2e.labels(ml).observe(e2e)
        if ttft is not None:
            self.ttft.labels(ml).observe(ttft)
            if num_output_tokens > 1:
                self.tpot.labels(ml).observe((e2e - ttft) / (num_output_tokens - 1))

    def observe_itl(self, gap: float, num_tokens: int) -> None:
        if num_tokens > 0:
            per = gap / num_tokens
            h = self.itl.labels(self.model_name)
            for _ in range(min(num_tokens, 64)):
                h.observe(per)

    def observe_http(self, path: str, status: int) -> None:
        route = path if path in KNOWN_ROUTES or path.startswith("/v1/models/") else "other"
        if route.startswith("/v1/models/"):
            route = "/v1/models/{model}"
        self.http_requests.labels(route, str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


def _num(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    return float(v)
