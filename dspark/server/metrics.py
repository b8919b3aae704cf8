"""Prometheus metrics of the server (``GET /metrics``), named like vLLM's with a ``dspark:`` prefix.

Each app gets its own registry, so several servers can live in one process (tests). Latencies are
measured on the server from the moment the HTTP request arrived, i.e. what a client sees minus the
network. Counters of tokens and finished requests are fed from the engine thread (prometheus_client
is thread-safe); gauges are read from the engine thread's last published snapshot at scrape time.

Speculative decoding (an engine started with ``--speculative-config`` has ``spec_stats``), in
dspark's vocabulary (dspark/spec/metrics.py): a verification step checks N drafts, accepts a of them
and emits a + 1 tokens. Counters, since the engine started (in-flight and aborted requests included):

* ``dspark:spec_decode_num_drafts_total``             verification steps (vLLM: drafting rounds)
* ``dspark:spec_decode_num_draft_tokens_total``       draft tokens verified
* ``dspark:spec_decode_num_accepted_tokens_total``    draft tokens accepted
* ``dspark:spec_decode_num_accepted_tokens_per_pos_total{position}``  accepted at draft position k
* ``dspark:spec_decode_num_reached_per_pos_total{position}``  steps that verified position k with all
  earlier drafts accepted
* ``dspark:spec_decode_draft_seconds_total``, ``dspark:spec_decode_verify_seconds_total``

Gauges: ``dspark:spec_decode_mean_acceptance_length`` (τ = (accepted + steps) / steps),
``dspark:spec_decode_acceptance_rate`` (accepted / draft tokens),
``dspark:spec_decode_acceptance_rate_per_pos{position}`` (accepted at k / steps, as vLLM) and
``dspark:spec_decode_conditional_acceptance_per_pos{position}`` (accepted at k / reached k).
Over a window τ = 1 + Δaccepted / Δsteps, which is what ``dspark bench serve`` reports. An engine
without ``spec_stats`` whose finished requests carry ``spec_*`` stats is aggregated from those.
"""

from __future__ import annotations

import threading
from typing import Any, Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                   20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TOKEN_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15,
                         0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
KNOWN_ROUTES = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics",
                          "/debug/kv", "/version"})

disable_created_metrics()  # no *_created series: they only add noise to a scrape


def engine_spec_snapshot(engine: Any) -> dict[str, Any] | None:
    """The engine's aggregate speculative-decoding counters (called on the engine thread), or None."""
    st = getattr(engine, "spec_stats", None)
    if st is None or getattr(engine, "spec_config", None) is None:
        return None
    cs = getattr(getattr(engine, "runner", None), "conf_sched", None)  # confidence scheduling (eager steps)
    return {"num_steps": st.num_steps, "num_drafts": st.num_drafts, "num_accepted": st.num_accepted,
            "accepted_at": list(st.accepted_at), "reached": list(getattr(st, "reached", []) or []),
            "draft_time_s": getattr(st, "draft_time_s", 0.0), "verify_time_s": getattr(st, "verify_time_s", 0.0)} | (
        {"confidence_scheduling": dict(cs.stats)} if cs is not None else {})


class _EngineStateCollector(Collector):
    def __init__(self, metrics: "ServerMetrics") -> None:
        self.m = metrics

    def collect(self) -> Iterable[Any]:
        m = self.m
        snap = m.engine_client.snapshot if m.engine_client is not None else {}

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=["model_name"])
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
        for name, key, doc in (
                ("dspark:triton_compiles_while_serving", "compiles_while_serving",
                 "Triton kernel compiles after start-up (each stalls the step it happens in; kernels/compile_watch.py)."),
                ("dspark:triton_compile_seconds_while_serving", "compile_seconds_while_serving",
                 "Seconds those compiles took.")):
            c = CounterMetricFamily(name, doc, labels=["model_name"])
            c.add_metric([m.model_name], float(snap.get(key, 0)))
            yield c
        spec = m.spec_snapshot()
        if spec is not None:
            yield from _spec_families(m.model_name, spec)


def _spec_families(model: str, spec: dict[str, Any]) -> Iterable[Any]:
    def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
        c = CounterMetricFamily(name, doc, labels=["model_name"])
        c.add_metric([model], float(value))
        return c

    def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
        g = GaugeMetricFamily(name, doc, labels=["model_name"])
        g.add_metric([model], float(value))
        return g

    def per_pos(cls: Any, name: str, doc: str, values: list[float]) -> Any:
        f = cls(name, doc, labels=["model_name", "position"])
        for k, v in enumerate(values):
            f.add_metric([model, str(k)], float(v))
        return f

    steps, drafts, acc = spec["num_steps"], spec["num_drafts"], spec["num_accepted"]
    accepted_at, reached = list(spec.get("accepted_at") or []), list(spec.get("reached") or [])
    yield counter("dspark:spec_decode_num_drafts", "Verification steps (drafting rounds).", steps)
    yield counter("dspark:spec_decode_num_draft_tokens", "Draft tokens verified.", drafts)
    yield counter("dspark:spec_decode_num_accepted_tokens", "Draft tokens accepted.", acc)
    yield per_pos(CounterMetricFamily, "dspark:spec_decode_num_accepted_tokens_per_pos",
                  "Draft tokens accepted at each draft position.", accepted_at)
    if reached:
        yield per_pos(CounterMetricFamily, "dspark:spec_decode_num_reached_per_pos",
                      "Steps that verified this position with all earlier drafts accepted.", reached)
    yield counter("dspark:spec_decode_draft_seconds", "Time spent drafting.", spec.get("draft_time_s") or 0.0)
    yield counter("dspark:spec_decode_verify_seconds", "Time spent verifying.", spec.get("verify_time_s") or 0.0)
    if steps:
        yield gauge("dspark:spec_decode_mean_acceptance_length",
                    "tau: tokens emitted per verification step (accepted drafts + 1).", (acc + steps) / steps)
        yield per_pos(GaugeMetricFamily, "dspark:spec_decode_acceptance_rate_per_pos",
                      "Accepted drafts at this position / verification steps.", [a / steps for a in accepted_at])
    if drafts:
        yield gauge("dspark:spec_decode_acceptance_rate", "Accepted draft tokens / draft tokens.", acc / drafts)
    cs = spec.get("confidence_scheduling")
    if cs:
        yield counter("dspark:spec_decode_scheduled_made_tokens",
                      "Draft tokens made on confidence-scheduled (eager) steps.", cs["drafts_made"])
        yield counter("dspark:spec_decode_scheduled_kept_tokens",
                      "Of those, the ones the confidence scheduler kept for verification.", cs["drafts_kept"])
        yield counter("dspark:spec_decode_paused_steps",
                      "Engine steps that did not draft: plain decoding was measured faster (confidence scheduling).",
                      cs["paused_steps"])
    if reached:
        yield per_pos(GaugeMetricFamily, "dspark:spec_decode_conditional_acceptance_per_pos",
                      "P(draft at this position accepted | all earlier drafts accepted).",
                      [a / r if r else 0.0 for a, r in zip(accepted_at, reached)])


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
        self._lock = threading.Lock()
        self._fallback_spec: dict[str, Any] | None = None  # from finished requests' stats (no engine aggregate)
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
        """Fallback for engines without an aggregate ``spec_stats``: sum finished requests' stats."""
        steps = _num(stats.get("spec_num_steps"))
        if steps is None:
            return
        with self._lock:
            agg = self._fallback_spec
            if agg is None:
                agg = self._fallback_spec = {"num_steps": 0.0, "num_drafts": 0.0, "num_accepted": 0.0,
                                             "accepted_at": [], "reached": []}
            agg["num_steps"] += steps
            agg["num_drafts"] += _num(stats.get("spec_num_drafts")) or 0.0
            agg["num_accepted"] += _num(stats.get("spec_num_accepted")) or 0.0
            for key, src in (("accepted_at", "spec_accepted_per_position"), ("reached", "spec_reached_per_position")):
                vals = stats.get(src)
                if isinstance(vals, (list, tuple)):
                    dst = agg[key]
                    for k, v in enumerate(vals):
                        while len(dst) <= k:
                            dst.append(0.0)
                        dst[k] += _num(v) or 0.0

    def spec_snapshot(self) -> dict[str, Any] | None:
        snap = self.engine_client.snapshot.get("spec") if self.engine_client is not None else None
        if snap is not None:
            return snap
        with self._lock:
            if self._fallback_spec is None:
                return None
            return {k: (list(v) if isinstance(v, list) else v) for k, v in self._fallback_spec.items()}

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
        if path in KNOWN_ROUTES:
            route = path
        elif path.startswith("/v1/models/"):
            route = "/v1/models/{model}"
        else:
            route = "other"
        self.http_requests.labels(route, str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


def _num(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    return float(v)
