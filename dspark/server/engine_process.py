"""The engine in its own process: what `dspark serve` runs (vLLM's engine-core split).

Why a process and not a thread: the engine's host work per step is hundreds of short calls into
PyTorch, each of which releases and re-takes the GIL. With the engine on a thread of the server's
process, every one of them waits for the event loop thread to give the GIL back, which a busy
thread does only every ``sys.getswitchinterval()`` (5 ms): measured on this machine, a tiny torch op
went from 4 µs to 4.7 ms with a pure-Python thread running beside it. On the H200 (session 23) the
in-process server at 32 concurrent streams reached 3.5 k tok/s where the same engine makes 24 k, with
~0.9 s stalls on eager prefill steps (many torch calls each). In its own process the engine steps at
its own pace whatever the HTTP side does::

    server process (event loop + reader thread)            engine process
    ───────────────────────────────────────────           ──────────────
    submit / abort / debug ──── ("add" | "abort" | "debug" | "stop") ──►  EngineCore loop:
    futures, RequestGroup queues ◄── ("res" | "err" | "out" | "dead") ──     commands, engine.step()

One duplex pipe; messages are pickled tuples. The reader thread of the server blocks in ``recv``
(without the GIL) and hands results and outputs to the event loop with ``call_soon_threadsafe``. The
engine process is started with ``spawn`` (CUDA cannot be forked), builds the engine itself
(``build``, a picklable callable), sends the facts the HTTP side needs (model name, context length,
tokenizer), and ends when told to stop or when the pipe closes (the server died). ``EngineClient``
(engine_client.py) is the same interface around an engine object already built in this process, on a
thread: for embedding and tests that hold the engine.
"""

from __future__ import annotations

import asyncio
import gc
import itertools
import logging
import multiprocessing as mp
import threading
import traceback
from dataclasses import replace
from typing import Any, Callable

from dspark.server.engine_client import (EngineDeadError, GenerationSpec, RequestGroup, _put_all, add_specs,
                                         engine_snapshot, engine_state, step_slice)

logger = logging.getLogger("dspark.server")


# ------------------------------------------------------------------------------ engine process
def _send_error(conn: Any, cid: int, e: BaseException) -> None:
    try:
        conn.send(("err", cid, e))
    except Exception:  # an exception that does not pickle: its text
        conn.send(("err", cid, RuntimeError(f"{type(e).__name__}: {e}")))


def engine_main(conn: Any, build: Callable[[], Any], log_level: int) -> None:
    """The engine process: build the engine, report ready, then serve commands and step while there
    is work. Outputs go back once per step, each request's logprobs sliced to the step."""
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        engine = build()
    except BaseException as e:
        _send_error(conn, -1, e)
        return
    conn.send(("ready", {"model_name": engine.model_name, "max_model_len": engine.config.max_model_len,
                         "tokenizer": engine.tokenizer, "snapshot": engine_snapshot(engine)}))
    gc.collect()
    gc.freeze()  # the engine's objects out of the collector's sight (as run_serve did for the whole process)
    steps = 0
    while True:
        busy = engine.has_unfinished() or bool(engine.requests)
        try:
            if not busy:
                conn.poll(None)  # idle: sleep until a command comes
            while conn.poll(0):
                msg = conn.recv()
                kind = msg[0]
                if kind == "add":
                    try:
                        conn.send(("res", msg[1], add_specs(engine, msg[2])))
                    except Exception as e:
                        _send_error(conn, msg[1], e)
                elif kind == "abort":
                    for rid in msg[1]:
                        engine.abort(rid)
                elif kind == "debug":
                    conn.send(("res", msg[1], dict(engine_state(engine), steps=steps)))
                elif kind == "stop":
                    for rid in list(engine.requests):
                        engine.abort(rid)
                    while engine.requests:  # report the aborts so the engine forgets them
                        engine.step()
                    return
        except (EOFError, OSError):  # the server is gone
            return
        if engine.has_unfinished() or engine.requests:
            try:
                outputs = engine.step()
            except Exception as e:  # an engine bug: report it and serve no more
                logger.error("engine step failed; the server will answer 503 from now on:\n%s", traceback.format_exc())
                try:
                    conn.send(("dead", repr(e)))
                except (EOFError, OSError):
                    pass
                return
            steps += 1
            # prompt ids stay on the server side (RequestGroup.prompt_token_ids): not sent every step
            slim = [replace(step_slice(o), prompt_token_ids=[]) for o in outputs]
            try:
                conn.send(("out", slim, engine_snapshot(engine)))
            except (EOFError, OSError):
                return


# ------------------------------------------------------------------------------- server side
class ProcessEngineClient:
    """EngineClient's interface (start, shutdown, alive, submit, abort_nowait, debug_state, snapshot,
    model_name, max_model_len, tokenizer, observer) with the engine in a child process. Construction
    starts the process and waits until the engine is built (raising the engine's own error if it
    could not be)."""

    def __init__(self, build: Callable[[], Any], log_level: int = logging.INFO, ready_timeout: float = 3600.0) -> None:
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe(duplex=True)
        self._proc = ctx.Process(target=engine_main, args=(child, build, log_level), name="dspark-engine", daemon=True)
        self._proc.start()
        child.close()
        if not self._conn.poll(ready_timeout):
            self._proc.kill()
            raise RuntimeError(f"the engine process was not ready after {ready_timeout:.0f}s")
        try:
            msg = self._conn.recv()
        except EOFError:
            self._proc.join(5)
            raise RuntimeError(f"the engine process exited while starting (exit code {self._proc.exitcode})") from None
        if msg[0] == "err":
            self._proc.join(5)
            raise msg[2]
        info = msg[1]
        self.model_name: str = info["model_name"]
        self.max_model_len: int = info["max_model_len"]
        self.tokenizer = info["tokenizer"]
        self.snapshot: dict[str, Any] = info["snapshot"]
        self.observer: Any = None
        self.dead: BaseException | None = None
        self._send_lock = threading.Lock()
        self._streams: dict[str, RequestGroup] = {}  # request id -> group; the reader thread routes by it
        self._streams_lock = threading.Lock()
        self._pending: dict[int, asyncio.Future] = {}
        self._ids = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._reader: threading.Thread | None = None
        self._closing = False

    # ---------------------------------------------------------------- lifecycle
    async def start(self) -> None:
        if self._reader is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._reader = threading.Thread(target=self._read, name="dspark-engine-reader", daemon=True)
        self._reader.start()

    async def shutdown(self) -> None:
        """Abort everything in flight and stop the engine process."""
        if self._closing:
            return
        self._closing = True
        self._send(("stop",))
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, self._proc.join, 30.0)
        if self._proc.is_alive():
            self._proc.kill()
        self._fail_all(EngineDeadError("the server is shutting down"))

    @property
    def alive(self) -> bool:
        return self.dead is None and not self._closing and self._proc.is_alive()

    # ---------------------------------------------------------------- event-loop side
    def _send(self, msg: tuple) -> None:
        try:
            with self._send_lock:
                self._conn.send(msg)
        except (OSError, ValueError) as e:  # the engine process is gone
            if self.dead is None:
                self.dead = e

    async def _request(self, kind: str, *args: Any) -> Any:
        if not self.alive:
            raise EngineDeadError(f"the engine is not running: {self.dead!r}" if self.dead else "the engine is not running")
        cid = next(self._ids)
        fut = asyncio.get_running_loop().create_future()
        self._pending[cid] = fut
        self._send((kind, cid, *args))
        try:
            return await fut
        finally:
            self._pending.pop(cid, None)

    def abort_nowait(self, request_ids: list[str]) -> None:
        """Abort requests without waiting (safe from a finally block or a cancelled task)."""
        if not self._closing:
            self._send(("abort", list(request_ids)))

    async def submit(self, specs: list[GenerationSpec]) -> RequestGroup:
        """Tokenize, validate and add all ``specs`` atomically (all or none), in the engine process.
        Raises InvalidRequestError (a client mistake) before any of them runs."""
        group = RequestGroup(self, specs)
        with self._streams_lock:  # before the engine can answer: outputs follow the result on the pipe
            for rid in group.request_ids:
                self._streams[rid] = group
        try:
            prompt_ids, num_prompt_tokens = await self._request("add", specs)
        except BaseException as e:
            with self._streams_lock:
                for rid in group.request_ids:
                    self._streams.pop(rid, None)
            if isinstance(e, asyncio.CancelledError):  # the handler went away: nothing may stay running
                self.abort_nowait(group.request_ids)
            raise
        group.prompt_token_ids.update(prompt_ids)
        if self.observer is not None:
            self.observer.on_prompt(num_prompt_tokens)
        return group

    async def debug_state(self) -> dict[str, Any]:
        """KV integrity and queue sizes, read in the engine process between steps."""
        state = await self._request("debug")
        with self._streams_lock:
            state["streams"] = len(self._streams)
        state["engine_pid"] = self._proc.pid
        return state

    # ---------------------------------------------------------------- reader thread
    def _resolve(self, cid: int, result: Any = None, exc: BaseException | None = None) -> None:
        def _set() -> None:
            fut = self._pending.get(cid)
            if fut is None or fut.done():  # the awaiting handler was cancelled
                return
            if exc is not None:
                fut.set_exception(exc)
            else:
                fut.set_result(result)

        self._loop.call_soon_threadsafe(_set)

    def _read(self) -> None:
        while True:
            try:
                msg = self._conn.recv()
            except (EOFError, OSError) as e:
                if not self._closing:
                    logger.error("the engine process exited (exit code %s); the server will answer 503 from now on",
                                 self._proc.exitcode)
                    self.dead = self.dead or EngineDeadError(f"the engine process exited: {e!r}")
                self._fail_pending()
                self._fail_all(EngineDeadError("the engine process exited"))
                return
            kind = msg[0]
            if kind == "out":
                self.snapshot = msg[2]
                self._deliver(msg[1])
            elif kind == "res":
                self._resolve(msg[1], msg[2])
            elif kind == "err":
                self._resolve(msg[1], exc=msg[2])
            elif kind == "dead":
                self.dead = EngineDeadError(f"the engine failed: {msg[1]}")
                self._fail_pending()
                self._fail_all(EngineDeadError(f"the engine failed: {msg[1]}"))

    def _deliver(self, outputs: list[Any]) -> None:
        batch: list[tuple[RequestGroup, Any]] = []
        with self._streams_lock:
            for out in outputs:
                rid = out.request_id
                group = self._streams.pop(rid, None) if out.finished else self._streams.get(rid)
                if group is None:
                    continue  # aborted or abandoned
                out.prompt_token_ids = group.prompt_token_ids.get(rid, [])
                batch.append((group, out))
        if self.observer is not None and outputs:
            try:
                self.observer.on_outputs(outputs)
            except Exception:  # metrics must never take the server down
                logger.exception("metrics observer failed")
        if batch:
            self._loop.call_soon_threadsafe(_put_all, batch)

    def _fail_pending(self) -> None:
        exc = EngineDeadError(f"the engine is not running: {self.dead!r}")
        for cid in list(self._pending):
            self._resolve(cid, exc=exc)

    def _fail_all(self, exc: BaseException) -> None:
        with self._streams_lock:
            groups = set(self._streams.values())
            self._streams.clear()
        if groups and self._loop is not None:
            self._loop.call_soon_threadsafe(_put_all, [(g, exc) for g in groups])
