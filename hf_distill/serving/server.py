"""`hf-distill teacher serve`: a causal-LM teacher behind HTTP (aiohttp), speaking vLLM's completions request.

`POST /v1/completions` with token-id prompts and `prompt_logprobs=k` answers as vLLM does (`prompt_logprobs`: per
prompt token, `null` for the first, else `{id: {"logprob", "rank"}}` for the top k) and adds `prompt_logprobs_tail`,
the exact log of the mass outside the top k (the logsumexp of the other log-probabilities, as the offline teacher
signal stores it). The log-probabilities are at the server's `--temperature` (the server applies it; metadata says
which). With `max_tokens` > 1 and no `prompt_logprobs` it samples completions and returns their `token_ids`
(`seq_kd`). `GET /hf_distill/metadata` states the model name, weight fingerprint, vocabulary hash, vocabulary size,
largest k and temperature; `POST /tokenize` and `GET /v1/models` answer as vLLM's do.

Concurrent requests are batched: rows waiting in the queue are padded into one forward (up to `max_batch_tokens`),
run in one worker thread so the event loop keeps accepting. It binds 127.0.0.1 unless told otherwise, checks an
optional bearer key (read from an environment variable) and stops cleanly on SIGTERM/SIGINT (aiohttp's
`run_app`: in-flight requests finish, the worker stops).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import hmac
import threading
from collections.abc import Awaitable, Callable
from typing import Any

import torch
import torch.nn.functional as F
from aiohttp import web

from .protocol import METADATA_PATH, encode_arrays


@dataclasses.dataclass
class ServedModel:
    """The model a server runs: `max_k` the largest k it answers, `temperature` applied to every log-probability."""

    model: Any
    tokenizer: Any
    name: str
    max_k: int = 64
    temperature: float = 1.0
    device: str | None = None
    dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        from ..data.cache_key import teacher_fingerprint
        from ..data.signal_format import vocabulary_hash

        self.model.eval().requires_grad_(False)
        if self.device is not None:
            self.model.to(self.device)
        self.run_on = next(self.model.parameters()).device
        self.vocab_size = int(self.model.config.vocab_size)
        if not 1 <= self.max_k <= self.vocab_size:
            raise ValueError(f"--k {self.max_k}: choose 1 <= k <= the vocabulary ({self.vocab_size}).")
        if not self.temperature > 0:
            raise ValueError(f"--temperature {self.temperature}: must be > 0.")
        pad = getattr(self.tokenizer, "pad_token_id", None)
        self.pad_id = int(pad) if pad is not None else 0
        self.metadata = {"model": self.name, "teacher_fingerprint": teacher_fingerprint(self.model),
                         "vocab_hash": vocabulary_hash(self.tokenizer), "vocab_size": self.vocab_size,
                         "max_top_k": self.max_k, "temperature": self.temperature, "temperature_applied_by": "server",
                         "tail": "exact", "generate": True, "protocol": "hf_distill"}

    def score(self, rows: list[list[int]], k: int) -> list[tuple[list, list, list]]:
        """Per row (right-padded into one forward): the top-k log-probabilities at T, their ids and the log tail at
        every position but the last, as the offline signal computes them (float32 log-softmax, logsumexp tail)."""
        length = max(len(r) for r in rows)
        ids = torch.full((len(rows), length), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), length), dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, : len(r)] = torch.as_tensor(r, dtype=torch.long)
            mask[i, : len(r)] = 1
        autocast = (torch.autocast(self.run_on.type, dtype=self.dtype) if self.dtype not in (None, torch.float32)
                    else torch.autocast(self.run_on.type, enabled=False))
        with torch.no_grad(), autocast:
            logits = self.model(input_ids=ids.to(self.run_on), attention_mask=mask.to(self.run_on)).logits
        out = []
        for i, r in enumerate(rows):
            log_p = F.log_softmax(logits[i, : len(r) - 1].float() / self.temperature, dim=-1)
            values, top = log_p.topk(k, dim=-1)
            tail = log_p.scatter(-1, top, float("-inf")).logsumexp(-1)
            out.append((values.cpu().numpy(), top.cpu().numpy(), tail.cpu().numpy()))
        return out

    def generate(self, rows: list[list[int]], max_new_tokens: int, temperature: float, top_p: float,
                 stop_ids: list[int], seed: int) -> list[list[int]]:
        """One completion per prompt (left-padded together), up to and including its first stop id."""
        length = max(len(r) for r in rows)
        ids = torch.full((len(rows), length), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), length), dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, length - len(r):] = torch.as_tensor(r, dtype=torch.long)
            mask[i, length - len(r):] = 1
        torch.manual_seed(int(seed))
        sample = temperature > 0
        kwargs = dict(max_new_tokens=max_new_tokens, do_sample=sample, pad_token_id=self.pad_id,
                      eos_token_id=stop_ids or None)
        if sample:
            kwargs.update(temperature=temperature, top_p=top_p, top_k=0)
        with torch.no_grad():
            out = self.model.generate(input_ids=ids.to(self.run_on), attention_mask=mask.to(self.run_on), **kwargs)
        completions = []
        for row in out[:, length:].cpu().tolist():
            kept = []
            for t in row:
                kept.append(t)
                if t in stop_ids:
                    break
            completions.append(kept)
        return completions


class Batcher:
    """Rows of concurrent score requests gathered into one forward, run in a single worker thread."""

    def __init__(self, served: ServedModel, max_batch_tokens: int = 8192, wait_s: float = 0.002) -> None:
        self.served, self.max_tokens, self.wait_s = served, max_batch_tokens, wait_s
        self.queue: asyncio.Queue | None = None
        self.worker: concurrent.futures.ThreadPoolExecutor | None = None
        self.task: asyncio.Task | None = None
        self.forwards = 0

    async def start(self, app: web.Application) -> None:
        self.queue = asyncio.Queue()
        self.worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="teacher-forward")
        self.task = asyncio.get_running_loop().create_task(self._loop())

    async def stop(self, app: web.Application) -> None:
        if self.task is not None:
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)
        if self.worker is not None:
            self.worker.shutdown(wait=True)

    async def score(self, rows: list[list[int]], k: int) -> list:
        future = asyncio.get_running_loop().create_future()
        await self.queue.put((rows, k, future))
        return await future

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            items = [await self.queue.get()]
            await asyncio.sleep(self.wait_s)  # let concurrent requests join this forward
            tokens = sum(len(r) for r in items[0][0])
            while not self.queue.empty() and tokens < self.max_tokens:
                item = self.queue.get_nowait()
                items.append(item)
                tokens += sum(len(r) for r in item[0])
            for k in sorted({item[1] for item in items}):  # one forward per k asked (a run asks one k)
                group = [item for item in items if item[1] == k]
                rows = [r for item in group for r in item[0]]
                try:
                    scored = await loop.run_in_executor(self.worker, self.served.score, rows, k)
                    self.forwards += 1
                except Exception as err:  # every waiting request gets the error, the loop goes on
                    for *_, future in group:
                        if not future.done():
                            future.set_exception(err)
                    continue
                start = 0
                for row_list, _, future in group:
                    if not future.done():
                        future.set_result(scored[start : start + len(row_list)])
                    start += len(row_list)


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"object": "error", "message": message, "type": "BadRequestError", "code": status},
                             status=status)


def build_app(served: ServedModel, api_key: str | None = None, max_batch_tokens: int = 8192) -> web.Application:
    """The aiohttp application serving `served` (the key, when given, is required as a bearer token)."""
    batcher = Batcher(served, max_batch_tokens)

    def auth(handler: Callable[[web.Request], Awaitable[web.StreamResponse]]):
        """The key checked per route, not in a middleware: aiohttp keeps every middleware-wrapped handler (a
        closure over `served`, hence the teacher) in a process-wide cache that outlives the app and its stop()."""

        @functools.wraps(handler)
        async def checked(request: web.Request) -> web.StreamResponse:
            if api_key is not None:
                given = request.headers.get("Authorization", "")
                if not hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
                    return _error(401, "missing or wrong API key (Authorization: Bearer ...)")
            return await handler(request)

        return checked

    async def metadata(request: web.Request) -> web.Response:
        return web.json_response(served.metadata)

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": served.name, "object": "model", "owned_by": "hf_distill", "max_model_len": _max_len(served)}]})

    async def tokenize(request: web.Request) -> web.Response:
        body = await _json(request)
        if isinstance(body, web.Response):
            return body
        text = body.get("prompt")
        if not isinstance(text, str):
            return _error(400, "tokenize: `prompt` must be a string")
        tokens = served.tokenizer(text, add_special_tokens=bool(body.get("add_special_tokens", True)))["input_ids"]
        return web.json_response({"tokens": tokens, "count": len(tokens), "max_model_len": _max_len(served)})

    async def completions(request: web.Request) -> web.Response:
        body = await _json(request)
        if isinstance(body, web.Response):
            return body
        rows = _prompts(body.get("prompt"), served)
        if isinstance(rows, str):
            return _error(400, rows)
        bad = next((t for r in rows for t in r if not 0 <= t < served.vocab_size), None)
        if bad is not None:
            return _error(400, f"token id {bad} is outside the vocabulary (0..{served.vocab_size - 1})")
        k = body.get("prompt_logprobs")
        max_tokens = body.get("max_tokens", 16)
        if k is not None:
            if not isinstance(k, int) or k < 0 or k > served.max_k:
                return _error(400, f"Requested prompt logprobs of {k}, which is greater than max allowed: "
                                   f"{served.max_k}")
            scored = await batcher.score(rows, max(k, 1))
            if body.get("hf_distill_format") == "base64":  # hf_distill's client: the arrays, compact
                choices = [{"index": i, "text": "", "finish_reason": "length", "prompt_logprobs": None,
                            "hf_distill_arrays": encode_arrays(*row)} for i, row in enumerate(scored)]
            else:
                choices = [_scored_choice(i, lp.tolist(), ids.tolist(), tail.tolist(), k)
                           for i, (lp, ids, tail) in enumerate(scored)]
        else:
            if not isinstance(max_tokens, int) or max_tokens < 1:
                return _error(400, "max_tokens must be an integer >= 1")
            temperature = float(body.get("temperature", 1.0))
            top_p = float(body.get("top_p", 1.0))
            stops = [int(t) for t in body.get("stop_token_ids") or []]
            generated = await asyncio.get_running_loop().run_in_executor(
                batcher.worker, served.generate, rows, max_tokens, temperature, top_p, stops,
                int(body.get("seed") or 0))
            choices = [{"index": i, "text": served.tokenizer.decode(g), "token_ids": g, "logprobs": None,
                        "finish_reason": "stop" if g and g[-1] in stops else "length"} for i, g in enumerate(generated)]
        tokens = sum(len(r) for r in rows)
        return web.json_response({"id": "cmpl-hf-distill", "object": "text_completion", "model": served.name,
                                  "choices": choices, "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})

    app = web.Application(client_max_size=64 * 2**20)  # no middleware: see auth
    app["batcher"] = batcher
    app.on_startup.append(batcher.start)
    app.on_cleanup.append(batcher.stop)
    app.router.add_get(METADATA_PATH, auth(metadata))
    app.router.add_get("/v1/models", auth(models))
    app.router.add_get("/health", auth(_ok))
    app.router.add_post("/tokenize", auth(tokenize))
    app.router.add_post("/v1/completions", auth(completions))
    return app


async def _ok(request: web.Request) -> web.Response:
    return web.Response(text="ok")


async def _json(request: web.Request):
    try:
        body = await request.json()
    except ValueError:
        return _error(400, "the request body is not JSON")
    return body if isinstance(body, dict) else _error(400, "the request body must be a JSON object")


def _max_len(served: ServedModel) -> int | None:
    return getattr(served.model.config, "max_position_embeddings", None)


def _prompts(prompt: Any, served: ServedModel) -> list[list[int]] | str:
    """Token-id rows from a prompt: ids, a list of id lists, a string or a list of strings."""
    if isinstance(prompt, str):
        prompt = [prompt]
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        prompt = [prompt]
    if not isinstance(prompt, list) or not prompt:
        return "`prompt` must be token ids, a list of token-id lists, or text"
    rows = []
    for p in prompt:
        if isinstance(p, str):
            p = served.tokenizer(p)["input_ids"]
        if not isinstance(p, list) or not p or not all(isinstance(t, int) and not isinstance(t, bool) for t in p):
            return "each prompt must be a non-empty list of integer token ids (or text)"
        rows.append(p)
    return rows


def _scored_choice(index: int, lp: list, ids: list, tail: list, k: int) -> dict[str, Any]:
    positions: list[Any] = [None]
    for values, top in zip(lp, ids, strict=True):
        positions.append({str(t): {"logprob": v, "rank": r + 1} for r, (v, t) in enumerate(zip(values[:k], top[:k],
                                                                                              strict=True))})
    return {"index": index, "text": "", "logprobs": None, "finish_reason": "length", "prompt_logprobs": positions,
            "prompt_logprobs_tail": [None, *tail]}


class ServerThread:
    """An app served on 127.0.0.1 from a background thread (tests, benchmarks): `url`, then `stop()`."""

    def __init__(self, app: web.Application, host: str = "127.0.0.1", port: int = 0) -> None:
        self.app, self.host, self.port = app, host, port
        self.loop = asyncio.new_event_loop()
        self.runner = web.AppRunner(app)
        ready = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(ready,), daemon=True)
        self.thread.start()
        ready.wait(30)

    def _run(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(self.runner.setup())
        site = web.TCPSite(self.runner, self.host, self.port)
        self.loop.run_until_complete(site.start())
        self.port = self.runner.addresses[0][1]
        ready.set()
        self.loop.run_forever()
        self.loop.close()  # stop() ended it: nothing of the server outlives the thread

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    def stop(self) -> None:
        """Close the listening socket and every connection, then the loop (a server "killed" mid-run)."""
        if self.loop.is_running():
            asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(30)
            self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)


def serve(served: ServedModel, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
          max_batch_tokens: int = 8192) -> None:
    """Serve until SIGTERM/SIGINT (aiohttp's run_app: graceful shutdown, the worker stopped in on_cleanup)."""
    app = build_app(served, api_key, max_batch_tokens)
    web.run_app(app, host=host, port=port, print=lambda line: print(
        f"hf-distill teacher serve: {served.name} on http://{host}:{port}/v1 (k <= {served.max_k}, "
        f"T = {served.temperature})", flush=True), handle_signals=True)
    print("hf-distill teacher serve: stopped", flush=True)


__all__ = ["Batcher", "ServedModel", "ServerThread", "build_app", "serve"]
