"""The HTTP client of a served teacher: protocol detection, the checks made before training, and requests retried
within limits.

Every request is JSON over HTTP (stdlib `urllib`, one connection per request, safe from several threads). Connection
errors, time-outs and 5xx answers are retried `retries` times with exponential backoff (`backoff`, doubled each try);
4xx answers and malformed bodies are not (the same request would get the same answer). The API key is read from the
environment variable whose *name* the arguments hold and sent as a bearer token; it is never put in an error, a log
line or anything written.
"""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request
from typing import Any
from urllib.parse import urlsplit

from .protocol import (
    METADATA_PATH,
    PROTOCOLS,
    MalformedAnswer,
    RowScores,
    generate_request,
    parse_generation,
    parse_scores,
    score_request,
)


class TeacherUnreachable(ConnectionError):
    """The server did not answer within the limits (every retry spent)."""


class TeacherRefused(ValueError):
    """The server answered with a client error (4xx): the request does not fit it."""


def is_teacher_url(value: Any) -> bool:
    """Whether a `teacher_model` entry names a served teacher (an http(s) URL)."""
    return isinstance(value, str) and value.lower().startswith(("http://", "https://"))


def base_url(url: str) -> str:
    """The server's root: the URL without a trailing `/v1` (vLLM's and SGLang's OpenAI prefix) or slash. A URL that
    holds credentials (user:password@host) is refused: put the key in an environment variable instead."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"teacher_model={url!r} is not an http(s) URL of a server (e.g. http://127.0.0.1:8000/v1).")
    if parts.username or parts.password:
        raise ValueError("teacher_model: the URL holds credentials; give the key through an environment variable "
                         "(DistillationArguments.teacher_api_key_env) instead.")
    root = url.rstrip("/")
    return root[: -len("/v1")] if root.endswith("/v1") else root


class TeacherClient:
    """One served teacher. `protocol` None: detected (:meth:`detect`). Limits: `retries` extra tries after the
    first, `timeout` seconds per request, `backoff` seconds before the first retry (doubled each time)."""

    def __init__(self, url: str, *, k: int, protocol: str | None = None, api_key_env: str | None = None,
                 retries: int = 3, timeout: float = 60.0, backoff: float = 0.5) -> None:
        if protocol is not None and protocol not in PROTOCOLS:
            raise ValueError(f"teacher_protocol={protocol!r}: use one of {', '.join(PROTOCOLS)}, or leave it unset "
                             "to detect it from the server.")
        self.url, self.root, self.k = url, base_url(url), int(k)
        self.protocol, self.retries, self.timeout, self.backoff = protocol, int(retries), float(timeout), backoff
        self.api_key_env = api_key_env
        self._key: str | None = None
        if api_key_env:
            self._key = os.environ.get(api_key_env)
            if not self._key:
                raise ValueError(f"teacher_api_key_env={api_key_env!r}: that environment variable is not set (or "
                                 "empty); export it with the server's API key, or leave teacher_api_key_env unset.")
        self.model: str | None = None  # the served model's name (vLLM's `model` field)
        self.metadata: dict[str, Any] = {}
        self.bytes_received = 0
        self.tokens_received = 0

    # ------------------------------------------------------------------ transport

    def _headers(self) -> dict[str, str]:
        headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if self._key:
            headers["Authorization"] = f"Bearer {self._key}"
        return headers

    def request(self, method: str, path: str, body: Any = None, *, retry: bool = True) -> Any:
        """The decoded JSON answer of one request, retried on connection errors, time-outs and 5xx answers."""
        data = None if body is None else json.dumps(body).encode()
        tries = 1 + (self.retries if retry else 0)
        last = ""
        for attempt in range(tries):
            if attempt:
                time.sleep(self.backoff * 2 ** (attempt - 1))
            req = urllib.request.Request(self.root + path, data=data, method=method, headers=self._headers())
            try:
                with urllib.request.urlopen(req, timeout=self.timeout) as answer:
                    raw = answer.read()
            except urllib.error.HTTPError as err:
                detail = _error_text(err)
                if err.code >= 500:
                    last = f"HTTP {err.code} {detail}"
                    continue
                raise TeacherRefused(f"{method} {path}: HTTP {err.code} {detail}") from None
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError) as err:
                last = f"{type(err).__name__}: {getattr(err, 'reason', err)}"
                continue
            self.bytes_received += len(raw)
            try:
                return json.loads(raw)
            except ValueError:
                raise MalformedAnswer(f"{method} {path}: the answer is not JSON ({raw[:80]!r})") from None
        raise TeacherUnreachable(f"the teacher server at {self.root} did not answer {method} {path} after {tries} "
                                 f"tries within {self.timeout:g} s each ({last})")

    # ------------------------------------------------------------------ what the server is

    def detect(self) -> str:
        """The protocol (unless given) and what the server says of itself: ours has `GET /hf_distill/metadata`,
        SGLang `GET /get_model_info`, vLLM `GET /v1/models`. An unreachable server is refused here."""
        probes = [self.protocol] if self.protocol else ["hf_distill", "sglang", "vllm"]
        for protocol in probes:
            path = {"hf_distill": METADATA_PATH, "sglang": "/get_model_info", "vllm": "/v1/models"}[protocol]
            try:
                info = self.request("GET", path)
            except TeacherRefused as err:
                if self.protocol or " 401 " in f" {err} " or "HTTP 403" in str(err):
                    raise TeacherRefused(f"{err} (an API key the server wants? set teacher_api_key_env to the name "
                                         "of the variable holding it)") from None
                continue
            except MalformedAnswer:
                continue
            self.protocol = protocol
            if protocol == "hf_distill":
                self.metadata = info
                self.model = info.get("model")
            elif protocol == "sglang":
                self.metadata = {"model": info.get("model_path")}
            else:
                data = info.get("data") if isinstance(info, dict) else None
                self.model = data[0].get("id") if isinstance(data, list) and data else None
                self.metadata = {"model": self.model}
            return protocol
        raise ValueError(f"The server at {self.root} answers none of hf_distill's, SGLang's or vLLM's info "
                         "requests: set DistillationArguments.teacher_protocol, or check the URL.")

    def tokenize(self, text: str) -> list[int]:
        """The server's tokenization of `text` without special tokens (vLLM's and ours: `POST /tokenize`; SGLang:
        `POST /tokenize` too, in versions that have it)."""
        body = {"prompt": text, "add_special_tokens": False}
        if self.model is not None:
            body["model"] = self.model
        answer = self.request("POST", "/tokenize", body)
        tokens = answer.get("tokens") if isinstance(answer, dict) else None
        if not isinstance(tokens, list):
            raise MalformedAnswer("POST /tokenize answered without a tokens list")
        return [int(t) for t in tokens]

    # ------------------------------------------------------------------ the work

    def score(self, rows: list[list[int]], vocab_size: int | None = None) -> list[RowScores]:
        """The top-k log-probabilities (and tail) at every position of each row of token ids."""
        path, body = score_request(self.protocol, self.model, rows, self.k)
        answer = self.request("POST", path, body)
        try:
            scores = parse_scores(answer, self.protocol, rows, self.k, vocab_size)
        except MalformedAnswer as err:
            raise MalformedAnswer(f"the teacher server at {self.root} sent a malformed answer: {err}") from None
        self.tokens_received += sum(s.positions for s in scores)
        return scores

    def generate(self, rows: list[list[int]], *, max_new_tokens: int, temperature: float, top_p: float,
                 stop_ids: list[int], seed: int) -> list[list[int]]:
        """One completion (token ids) per prompt, generated by the server (seq_kd)."""
        path, body = generate_request(self.protocol, self.model, rows, max_new_tokens, temperature, top_p, stop_ids,
                                      seed)
        return parse_generation(self.request("POST", path, body), self.protocol, len(rows))

    @property
    def bytes_per_token(self) -> float | None:
        """Answer bytes received per scored position (measured, JSON bodies)."""
        return self.bytes_received / self.tokens_received if self.tokens_received else None


def _error_text(err: urllib.error.HTTPError) -> str:
    try:
        body = err.read()[:300].decode("utf-8", "replace")
    except Exception:  # the body is only a detail of the message
        body = ""
    return body.replace("\n", " ").strip()


__all__ = ["TeacherClient", "TeacherRefused", "TeacherUnreachable", "base_url", "is_teacher_url"]
