"""The engine in its own process: what `dspark serve` runs (vLLM's engine-core split).

Why a process and not a thread: the engine's host work per step is hundreds of short calls into
PyTorch, each of which releases and re-takes the GIL. With the engine on a thread of the server's
process, every one of them waits for the event loop thread to give the GIL back, which a busy
thread does only every ``sys.getswitchinterval()`` (5 ms): measured on this machine, a tiny torch op
went from 4 µs to 4.7 ms with a pure-Python thread running beside it. On the H200 (session 23) the
in-process server at 32 concurrent streams reached 3.5 k tok/s where the same engine makes 24 k, with
~0.9 s stalls on eager prefill steps (many torch calls each). In its own process the engine steps at
its own pace whatever the HTTP side does::

    server process (one event loop)                        engine process
    ───────────────────────────────────────────           ──────────────
    submit / abort / debug ──── ("add" | "abort" | "debug" | "stop") ──►  engine_main's loop:
    futures, RequestGroup queues ◄── ("res" | "err" | "out" | "dead") ──     commands, engine.step()

One duplex pipe; messages are pickled tuples, outputs as deltas (``to_wire``). The server's event loop
reads the pipe when it is readable (``add_reader``): no second thread in the server process either, so
no GIL hand-offs there; when the loop was busy it finds several steps' messages at once, and their
outputs coalesce in the requests' queues (``RequestGroup.outputs``). A thread of the engine process
reads the commands, so the server never blocks sending one. The engine process is started with
``spawn`` (CUDA cannot be forked), builds the engine itself (``build``, a picklable callable), sends the facts the HTTP side needs (model name, context length,
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
import queue
import signal
import threading
import traceback
from typing import Any, Callable

from dspark.engine.llm_engine import RequestOutput
from dspark.server.engine_client import (EngineDeadError, GenerationSpec, RequestGroup, add_specs, engine_snapshot,
                                         engine_state, step_slice)

logger = logging.getLogger("dspark.server")


# ------------------------------------------------------------------------------ engine process
def to_wire(o: RequestOutput) -> tuple:
    """What one step's output of a request sends over the pipe: the deltas only (the text so far is the
    concatenation of the delta texts: the engine holds back what a stop string could still cut), the
    whole text once finished, the stats once finished. Pickling a dataclass with the cumulative text
    and token ids of every running request at every step cost the engine process time per step."""
    o = step_slice(o)
    fin = o.finished
    return (o.request_id, o.delta_token_ids, o.delta_text, fin, o.finish_reason, o.stop_reason,
            o.stats if fin else None, o.logprobs, o.text if fin else None)


def _send_error(conn: Any, cid: int, e: BaseException) -> None:
    try:
        conn.send(("err", cid, e))
    except Exception:  # an exception that does not pickle: its text
        conn.send(("err", cid, RuntimeError(f"{type(e).__name__}: {e}")))


def engine_main(conn: Any, build: Callable[[], Any], log_level: int) -> None:
    """The engine process: build the engine, report ready, then serve commands and step while there
    is work. Outputs go back once per step, each request's logprobs sliced to the step."""
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # Ctrl-C reaches the whole process group: the server shuts down and tells this process to stop
    # (aborting what runs); were it interrupted itself, it would die mid-step with a traceback.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        engine = build()
    except BaseException as e:
        _send_error(conn, -1, e)
        return
    conn.send(("ready", {"model_name": engine.model_name, "max_model_len": engine.config.max_model_len,
                         "tokenizer": engine.tokenizer, "snapshot": engine_snapshot(engine)}))
    gc.collect()
    gc.freeze()  # the engine's objects out of the collector's sight (as run_serve did for the whole process)
    # Commands are read by a thread of their own, so the server can always send (it never blocks on a
    # full pipe while this process is blocked sending it outputs: no deadlock under load). The thread
    # holds the GIL only to unpickle a command, so it does not slow the engine's steps.
    commands: queue.SimpleQueue = queue.SimpleQueue()

    def read_commands() -> None:
        try:
            while True:
                commands.put(conn.recv())
        except (EOFError, OSError):
            commands.put(("eof",))

    threading.Thread(target=read_commands, name="dspark-engine-commands", daemon=True).start()
    steps = 0
    while True:
        busy = engine.has_unfinished() or bool(engine.requests)
        try:
            msgs = [] if busy else [commands.get()]  # idle: sleep until a command comes
            while not commands.empty():
                msgs.append(commands.get_nowait())
            for msg in msgs:
                kind = msg[0]
                if kind == "add":
                    try:
                        conn.send(("res", msg[1], add_specs(engine, msg[2])))
                    except (EOFError, OSError):
                        raise
                    except Exception as e:
                        _send_error(conn, msg[1], e)
                elif kind == "abort":
                    for rid in msg[1]:
                        engine.abort(rid)
                elif kind == "debug":
                    conn.send(("res", msg[1], dict(engine_state(engine), steps=steps)))
                elif kind in ("stop", "eof"):  # told to stop, or the server is gone
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
            try:
                conn.send(("out", [to_wire(o) for o in outputs], engine_snapshot(engine)))
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
        self._streams: dict[str, RequestGroup] = {}  # request id -> group: where outputs go
        self._acc: dict[str, tuple[str, list[int]]] = {}  # request id -> (text, token ids) so far
        self._pending: dict[int, asyncio.Future] = {}
        self._ids = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closing = False

    # ---------------------------------------------------------------- lifecycle
    async def start(self) -> None:
        """Read the engine's messages on the event loop whenever the pipe is readable: no reader
        thread, so no thread of this process waits on another for the GIL."""
        if self._loop is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self._conn.fileno(), self._on_readable)

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
        self._stop_reading()
        self._fail_all(EngineDeadError("the server is shutting down"))

    @property
    def alive(self) -> bool:
        return self.dead is None and not self._closing and self._proc.is_alive()

    # ---------------------------------------------------------------- event-loop side
    def _send(self, msg: tuple) -> None:
        try:
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
        if self.dead is not None and not fut.done():  # the send failed: nobody will answer
            fut.set_exception(EngineDeadError(f"the engine is not running: {self.dead!r}"))
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
        for rid in group.request_ids:  # before the engine can answer: outputs follow the result on the pipe
            self._streams[rid] = group
            self._acc[rid] = ("", [])
        try:
            prompt_ids, num_prompt_tokens = await self._request("add", specs)
        except BaseException as e:
            for rid in group.request_ids:
                self._streams.pop(rid, None)
                self._acc.pop(rid, None)
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
        state["streams"] = len(self._streams)
        state["engine_pid"] = self._proc.pid
        return state

    # ---------------------------------------------------------------- messages from the engine
    def _on_readable(self) -> None:
        """Handle every message waiting on the pipe (several when the loop was busy: their outputs
        then coalesce in the groups' queues)."""
        try:
            while self._conn.poll(0):
                self._handle(self._conn.recv())
        except (EOFError, OSError) as e:
            self._stop_reading()
            if not self._closing:
                logger.error("the engine process exited (exit code %s); the server will answer 503 from now on",
                             self._proc.exitcode)
                self.dead = self.dead or EngineDeadError(f"the engine process exited: {e!r}")
            self._fail_pending()
            self._fail_all(EngineDeadError("the engine process exited"))

    def _stop_reading(self) -> None:
        if self._loop is not None:
            try:
                self._loop.remove_reader(self._conn.fileno())
            except (OSError, ValueError):
                pass

    def _handle(self, msg: tuple) -> None:
        kind = msg[0]
        if kind == "out":
            self.snapshot = msg[2]
            self._deliver(msg[1])
        elif kind in ("res", "err"):
            fut = self._pending.get(msg[1])
            if fut is not None and not fut.done():  # else the awaiting handler was cancelled
                if kind == "res":
                    fut.set_result(msg[2])
                else:
                    fut.set_exception(msg[2])
        elif kind == "dead":
            self.dead = EngineDeadError(f"the engine failed: {msg[1]}")
            self._fail_pending()
            self._fail_all(EngineDeadError(f"the engine failed: {msg[1]}"))

    def _deliver(self, wire: list[tuple]) -> None:
        outputs = []
        for rid, delta_ids, delta_text, fin, reason, stop_reason, stats, lps, final_text in wire:
            acc = self._acc.pop(rid, None) if fin else self._acc.get(rid)
            text, ids = acc if acc is not None else ("", [])  # None: not a stream of ours (aborted)
            ids.extend(delta_ids)  # one list per request, grown in place
            text = final_text if fin else text + delta_text
            if not fin:
                self._acc[rid] = (text, ids)
            group = self._streams.pop(rid, None) if fin else self._streams.get(rid)
            out = RequestOutput(request_id=rid, prompt=None,
                                prompt_token_ids=group.prompt_token_ids.get(rid, []) if group is not None else [],
                                text=text, token_ids=ids, delta_text=delta_text, delta_token_ids=delta_ids,
                                finished=fin, finish_reason=reason, stop_reason=stop_reason, stats=stats or {},
                                logprobs=lps)
            outputs.append(out)
            if group is not None:  # else aborted or abandoned
                group.queue.put_nowait(out)
        if self.observer is not None and outputs:
            try:
                self.observer.on_outputs(outputs)
            except Exception:  # metrics must never take the server down
                logger.exception("metrics observer failed")

    def _fail_pending(self) -> None:
        exc = EngineDeadError(f"the engine is not running: {self.dead!r}")
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(exc)

    def _fail_all(self, exc: BaseException) -> None:
        groups = set(self._streams.values())
        self._streams.clear()
        self._acc.clear()
        for g in groups:
            g.queue.put_nowait(exc)
