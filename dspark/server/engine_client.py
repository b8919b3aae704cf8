"""The engine's own thread, and the asyncio-side client that talks to it; the request groups and the
engine-side helpers that the engine process (engine_process.py, what `dspark serve` runs) shares.

This client is for an engine object built in the caller's process (embedding, in-process tests). Under
load it is slower than the process client: the engine thread's PyTorch calls wait for the event loop
thread's GIL (engine_process.py has the figures).

The engine is not thread-safe, so exactly one thread (started here) ever touches it::

    event loop (HTTP handlers)                    engine thread
    ─────────────────────────                     ─────────────
    submit()/abort_nowait()/call() ──commands──►  run commands (tokenize, add_request, abort, debug)
                                                  engine.step()  (only while there is work)
    RequestGroup.queue  ◄──call_soon_threadsafe── outputs of the step, per request

The thread sleeps on a condition variable while the engine is idle and no command is pending. Each
HTTP request owns one ``RequestGroup`` (one engine request per prompt x choice) whose outputs arrive
on one asyncio queue. A group that is abandoned (client disconnect, cancelled handler) is aborted,
which frees its KV blocks in the engine at once.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import threading
import traceback
from dataclasses import dataclass, replace
from typing import Any, Callable

from dspark.engine.llm_engine import LLMEngine, RequestOutput
from dspark.sampling_params import InvalidRequestError, SamplingParams
from dspark.server.metrics import engine_spec_snapshot

logger = logging.getLogger("dspark.server")


class EngineDeadError(RuntimeError):
    """The engine thread failed (a bug, not a client mistake) and serves no more requests."""


class PromptTooLongError(InvalidRequestError):
    """The prompt (plus the requested completion) does not fit in max_model_len."""


@dataclass
class GenerationSpec:
    """One engine request: a prompt (text, token ids, or chat messages) and its sampling params."""

    request_id: str
    params: SamplingParams
    prompt: str | list[int] | None = None
    messages: list[dict[str, str]] | None = None
    fill_max_tokens: bool = False  # max_tokens not given: allow up to max_model_len - prompt length
    prompt_key: int = 0  # specs with the same key share one prompt (tokenized once)


class RequestGroup:
    """The engine requests of one HTTP request; outputs of all of them arrive on ``queue``."""

    def __init__(self, client: "EngineClient", specs: list[GenerationSpec]) -> None:
        self.client = client
        self.request_ids = [s.request_id for s in specs]
        self.index = {rid: i for i, rid in enumerate(self.request_ids)}
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.prompt_token_ids: dict[str, list[int]] = {}  # request id -> prompt ids (set by submit)
        self.unfinished = set(self.request_ids)
        self.aborted = False

    async def outputs(self):
        """Yield RequestOutputs (any request of the group, in engine order) until all have finished.
        When the engine runs ahead of the consumer, the outputs of one request waiting in the queue are
        merged into one (as vLLM's output collector does): a busy server sends fewer, larger chunks
        instead of falling ever further behind."""
        while self.unfinished:
            items = [await self.queue.get()]
            while not self.queue.empty():
                items.append(self.queue.get_nowait())
            for item in coalesce(items):
                if isinstance(item, BaseException):
                    raise item
                if item.finished:
                    self.unfinished.discard(item.request_id)
                yield item

    def abort(self) -> None:
        """Abort the requests that have not finished (idempotent, never blocks)."""
        if self.unfinished and not self.aborted:
            self.aborted = True
            self.client.abort_nowait(list(self.unfinished))

    @property
    def finished(self) -> bool:
        return not self.unfinished


class EngineClient:
    """Owns the engine thread. Create it, then ``await start()`` inside the server's event loop."""

    def __init__(self, engine: LLMEngine, observer: Any = None) -> None:
        self.engine = engine
        self.observer = observer  # optional: .on_outputs(outputs) and .on_prompt(num_tokens), thread-safe
        self.model_name = engine.model_name
        self.max_model_len = engine.config.max_model_len
        self.tokenizer = engine.tokenizer
        self.dead: BaseException | None = None
        self.snapshot: dict[str, Any] = {"running": 0, "waiting": 0, "kv_usage": 0.0, "prefix_hit_rate": 0.0}
        self._cv = threading.Condition()
        self._cmds: list[tuple[Callable[[LLMEngine], Any], asyncio.Future | None]] = []
        self._stop = False
        self._streams: dict[str, RequestGroup] = {}  # owned by the engine thread
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.num_steps = 0

    # ---------------------------------------------------------------- lifecycle
    async def start(self) -> None:
        if self._thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="dspark-engine", daemon=True)
        self._thread.start()

    async def shutdown(self) -> None:
        """Abort everything in flight and stop the thread (after the step in progress)."""
        t = self._thread
        if t is None:
            return
        with self._cv:
            self._stop = True
            self._cv.notify()
        await asyncio.get_running_loop().run_in_executor(None, t.join, 30.0)
        self._thread = None

    @property
    def alive(self) -> bool:
        return self.dead is None and self._thread is not None and self._thread.is_alive()

    # ---------------------------------------------------------------- asyncio side
    def _post(self, fn: Callable[[LLMEngine], Any], fut: asyncio.Future | None) -> None:
        with self._cv:
            self._cmds.append((fn, fut))
            self._cv.notify()

    async def call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """Run ``fn(engine)`` on the engine thread (between steps) and return its result."""
        if not self.alive:
            raise EngineDeadError(f"the engine is not running: {self.dead!r}" if self.dead else "the engine is not running")
        fut = asyncio.get_running_loop().create_future()
        self._post(fn, fut)
        return await fut

    def abort_nowait(self, request_ids: list[str]) -> None:
        """Abort requests without waiting (safe from a finally block or a cancelled task)."""
        if self._thread is None:
            return
        ids = list(request_ids)

        def _abort(engine: LLMEngine) -> None:
            for rid in ids:  # the engine reports each abort once; _deliver hands it to its group
                engine.abort(rid)

        self._post(_abort, None)

    async def submit(self, specs: list[GenerationSpec]) -> RequestGroup:
        """Tokenize, validate and add all ``specs`` atomically (all or none). Raises
        InvalidRequestError (a client mistake) before any of them runs."""
        group = RequestGroup(self, specs)
        try:
            await self.call(lambda engine: self._add_in_engine(engine, specs, group))
        except asyncio.CancelledError:
            # The handler went away while the command was queued: make sure nothing is left running.
            self.abort_nowait(group.request_ids)
            raise
        return group

    # ---------------------------------------------------------------- engine thread
    def _add_in_engine(self, engine: LLMEngine, specs: list[GenerationSpec], group: RequestGroup) -> None:
        prompt_ids, num_prompt_tokens = add_specs(engine, specs)
        for rid, ids in prompt_ids.items():
            self._streams[rid] = group
            group.prompt_token_ids[rid] = ids
        if self.observer is not None:
            self.observer.on_prompt(num_prompt_tokens)

    def _resolve(self, fut: asyncio.Future | None, result: Any = None, exc: BaseException | None = None) -> None:
        if fut is None or self._loop is None:
            return

        def _set() -> None:
            if fut.done():  # the awaiting handler was cancelled
                return
            if exc is not None:
                fut.set_exception(exc)
            else:
                fut.set_result(result)

        self._loop.call_soon_threadsafe(_set)

    def _run(self) -> None:
        engine = self.engine
        self._publish(engine)
        while True:
            with self._cv:
                while not self._cmds and not self._stop and (self.dead is not None or not self._has_work()):
                    self._cv.wait()
                cmds, self._cmds = self._cmds, []
                stopping = self._stop
            for fn, fut in cmds:
                if self.dead is not None and fut is not None:
                    self._resolve(fut, exc=EngineDeadError(f"the engine failed: {self.dead!r}"))
                    continue
                try:
                    res = fn(engine)
                except Exception as e:
                    self._resolve(fut, exc=e)
                else:
                    self._resolve(fut, res)
            if stopping:
                self._abort_all(engine)
                return
            if self.dead is None and self._has_work():
                try:
                    outputs = engine.step()
                    self.num_steps += 1
                except Exception as e:  # an engine bug: fail every request, report, serve no more
                    logger.error("engine step failed; the server will answer 503 from now on:\n%s",
                                 traceback.format_exc())
                    self.dead = e
                    self._fail_all(EngineDeadError(f"the engine failed: {e!r}"))
                    self._publish(engine)
                    continue
                self._deliver(outputs)
            self._publish(engine)

    def _has_work(self) -> bool:
        return self.engine.has_unfinished() or bool(self.engine.requests)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        batch: list[tuple[RequestGroup, RequestOutput]] = []
        for out in outputs:
            group = self._streams.pop(out.request_id, None) if out.finished else self._streams.get(out.request_id)
            if group is None:
                continue  # aborted or abandoned
            batch.append((group, step_slice(out)))
        if self.observer is not None and outputs:
            try:
                self.observer.on_outputs(outputs)
            except Exception:  # metrics must never take the engine down
                logger.exception("metrics observer failed")
        if batch and self._loop is not None:
            self._loop.call_soon_threadsafe(_put_all, batch)

    def _fail_all(self, exc: BaseException) -> None:
        groups = set(self._streams.values())
        self._streams.clear()
        if self._loop is not None:
            self._loop.call_soon_threadsafe(_put_all, [(g, exc) for g in groups])

    def _abort_all(self, engine: LLMEngine) -> None:
        try:
            for rid in list(engine.requests):
                engine.abort(rid)
            while engine.requests:  # report the aborts so the engine forgets them
                self._deliver(engine.step())
        except Exception:
            logger.exception("aborting requests at shutdown failed")
        self._fail_all(EngineDeadError("the server is shutting down"))

    def _publish(self, engine: LLMEngine) -> None:
        """Numbers /metrics reads at scrape time (one dict swap: safe to read from the event loop)."""
        self.snapshot = engine_snapshot(engine)

    # ---------------------------------------------------------------- debugging
    async def debug_state(self) -> dict[str, Any]:
        """KV integrity and queue sizes, read on the engine thread between steps."""

        def _state(engine: LLMEngine) -> dict[str, Any]:
            return dict(engine_state(engine), streams=len(self._streams), steps=self.num_steps, engine_pid=os.getpid())

        return await self.call(_state)


def coalesce(items: list[Any]) -> list[Any]:
    """Merge the queued outputs of each request into its latest one (delta text, delta token ids and
    logprobs concatenated in order), keeping engine order; items after an exception are left out (the
    exception ends the group)."""
    merged: list[Any] = []
    at: dict[str, int] = {}  # request id -> index of its pending output in merged
    for it in items:
        if isinstance(it, BaseException):
            merged.append(it)
            break
        i = at.get(it.request_id)
        if i is not None:
            prev = merged[i]
            merged[i] = None
            lps = None if prev.logprobs is None and it.logprobs is None else (prev.logprobs or []) + (it.logprobs or [])
            it = replace(it, delta_text=prev.delta_text + it.delta_text,
                         delta_token_ids=prev.delta_token_ids + it.delta_token_ids, logprobs=lps)
        at[it.request_id] = len(merged)
        merged.append(it)
    return [m for m in merged if m is not None]


def _put_all(batch: list[tuple[RequestGroup, Any]]) -> None:
    for group, item in batch:
        group.queue.put_nowait(item)


# ------------------------------------------------------------------- engine-side helpers
# Used on the engine's own thread (EngineClient) and in the engine process (engine_process.py).
def tokenize_spec(engine: LLMEngine, spec: GenerationSpec) -> list[int]:
    if spec.messages is not None:
        try:
            return engine.tokenize_chat(spec.messages)
        except InvalidRequestError:
            raise
        except Exception as e:  # e.g. a template that rejects a role order: the client's conversation
            raise InvalidRequestError(f"the chat template could not render these messages: {e}") from None
    if isinstance(spec.prompt, str):
        if engine.tokenizer is None:
            raise InvalidRequestError(f"model {engine.model_name!r} has no tokenizer: send token ids")
        return list(engine.tokenizer(spec.prompt, add_special_tokens=True)["input_ids"])
    if isinstance(spec.prompt, list):
        return list(spec.prompt)
    raise InvalidRequestError("prompt must be a string or a list of token ids")


def add_specs(engine: LLMEngine, specs: list[GenerationSpec]) -> tuple[dict[str, list[int]], int]:
    """Tokenize, validate and add all ``specs`` to the engine, or none of them (InvalidRequestError, a
    client mistake, before any runs). Returns the prompt ids per request id and the number of prompt
    tokens (each distinct prompt once)."""
    max_len = engine.config.max_model_len
    token_cache: dict[int, list[int]] = {}
    added: dict[str, list[int]] = {}
    try:
        for spec in specs:
            ids = token_cache.get(spec.prompt_key)
            if ids is None:
                ids = token_cache[spec.prompt_key] = tokenize_spec(engine, spec)
                if not ids:
                    raise InvalidRequestError("the prompt is empty")
                if len(ids) >= max_len:
                    raise PromptTooLongError(
                        f"This model's maximum context length is {max_len} tokens. However, your prompt has "
                        f"{len(ids)} tokens, which leaves no room for a completion. Please shorten the prompt."
                    )
            params = spec.params
            if spec.fill_max_tokens:
                params = replace(params, max_tokens=max_len - len(ids))
            elif len(ids) + params.max_tokens > max_len:
                raise PromptTooLongError(
                    f"This model's maximum context length is {max_len} tokens. However, you requested "
                    f"{len(ids) + params.max_tokens} tokens ({len(ids)} in the prompt, {params.max_tokens} for "
                    f"the completion). Please reduce the length of the prompt or of max_tokens."
                )
            engine.add_request(ids, params, spec.request_id)
            added[spec.request_id] = ids
    except BaseException:
        for rid in added:
            engine.abort(rid)
        raise
    return added, sum(len(v) for v in token_cache.values())


def step_slice(out: RequestOutput) -> RequestOutput:
    """The output as a client gets it: the engine's logprobs list keeps growing, so hand over only this
    step's slice."""
    if out.logprobs is not None:
        n_prev = len(out.token_ids) - len(out.delta_token_ids)
        out.logprobs = out.logprobs[n_prev:n_prev + len(out.delta_token_ids)]
    return out


def engine_snapshot(engine: LLMEngine) -> dict[str, Any]:
    """The numbers /metrics reads at scrape time."""
    s = engine.scheduler
    snap: dict[str, Any] = {
        "running": len(s.running),
        "waiting": len(s.waiting),
        "kv_usage": engine.kv.usage,
        "prefix_hit_rate": engine.kv.prefix_hit_rate,
    }
    spec = engine_spec_snapshot(engine)
    if spec is not None:
        snap["spec"] = spec
    watch = sys.modules.get("dspark.kernels.compile_watch")  # loaded by a CUDA engine
    if watch is not None:
        snap["compiles_while_serving"], snap["compile_seconds_while_serving"] = watch.serving_compiles()
    return snap


def engine_state(engine: LLMEngine) -> dict[str, Any]:
    """/debug/kv's view of the engine: KV integrity and queue sizes (between steps)."""
    out: dict[str, Any] = {
        "running": len(engine.scheduler.running),
        "waiting": len(engine.scheduler.waiting),
        "engine_requests": len(engine.requests),
        "kv_usage": engine.kv.usage,
        "prefix_hit_rate": engine.kv.prefix_hit_rate,
        "num_kv_blocks": engine.kv.num_usable_blocks,
        "block_size": engine.kv.block_size,
        "kv_requests": len(engine.kv.reqs),
    }
    try:
        out["integrity"] = engine.kv.check_integrity()
        out["integrity_ok"] = True
    except AssertionError as e:
        out["integrity"] = None
        out["integrity_ok"] = False
        out["integrity_error"] = str(e) or "assertion failed"
    return out
