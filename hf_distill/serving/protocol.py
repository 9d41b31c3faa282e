"""The wire formats of a served causal-LM teacher: what is asked and what comes back, for three servers.

- `vllm`: vLLM's OpenAI-compatible `POST /v1/completions` with `prompt_logprobs=k` (token ids as the prompt,
  `max_tokens=1`): each choice's `prompt_logprobs` is a list, one entry per prompt token, `null` for the first, else
  `{token_id: {"logprob": float, "rank": int, "decoded_token": str}}` holding the top k and the prompt's own token
  (k + 1 entries when it is not among them). Its log-probabilities are the raw model's (temperature 1).
- `sglang`: SGLang's native `POST /generate` with `input_ids`, `return_logprob`, `top_logprobs_num=k`,
  `logprob_start_len=0`, `max_new_tokens=0`: `meta_info.input_top_logprobs` holds one entry per prompt token, `null`
  for the first, else a list of `[logprob, token_id, text]` (raw model, temperature 1).
- `hf_distill`: this package's server (hf_distill.serving.server), vLLM's request and answer plus, per choice,
  `prompt_logprobs_tail`: the exact log of the mass outside the top k (logsumexp of the other log-probabilities),
  and `GET /hf_distill/metadata` (model, weight fingerprint, vocabulary hash, largest k, temperature).

Entry p of a row's answer (p >= 1) is the teacher's next-token distribution after tokens 0..p-1: what the student's
logits at position p - 1 are compared with. :func:`parse_scores` turns an answer into :class:`RowScores` (float64)
and refuses a malformed or short one with what was wrong; the tail is computed in float64 from the k values unless
the server sent its own.
"""

from __future__ import annotations

import base64
import dataclasses
import math
from typing import Any

import numpy as np

PROTOCOLS = ("vllm", "sglang", "hf_distill")
METADATA_PATH = "/hf_distill/metadata"
PROBE_TEXT = "The quick brown fox jumps over the lazy dog. 0123456789 ,.;:!? Ünïcödé"


class MalformedAnswer(ValueError):
    """The server answered, but not with what was asked (never retried: the same request gets the same answer)."""


@dataclasses.dataclass
class RowScores:
    """One row's teacher signal at every position but the last: `log_probs` (n, k) float64 in descending order,
    `ids` (n, k) int64, `log_tail` (n,) float64 (the log of the mass of every other id), n = len(row) - 1."""

    log_probs: np.ndarray
    ids: np.ndarray
    log_tail: np.ndarray

    @property
    def positions(self) -> int:
        return len(self.log_tail)


def score_request(protocol: str, model: str | None, rows: list[list[int]], k: int) -> tuple[str, dict[str, Any]]:
    """(path, JSON body) asking for the top-k log-probabilities at every position of each row of token ids."""
    rows = [[int(t) for t in r] for r in rows]
    if protocol == "sglang":
        return "/generate", {"input_ids": rows, "return_logprob": True, "top_logprobs_num": k,
                             "logprob_start_len": 0, "sampling_params": {"max_new_tokens": 0, "temperature": 0.0}}
    body = {"prompt": rows, "max_tokens": 1, "temperature": 0.0, "prompt_logprobs": k}
    if protocol == "hf_distill":  # our server: the arrays as base64 (4 + 4 bytes per entry, no JSON per entry)
        body["hf_distill_format"] = "base64"
    if model is not None:
        body["model"] = model
    return "/v1/completions", body


def encode_arrays(log_probs: np.ndarray, ids: np.ndarray, tail: np.ndarray) -> dict[str, Any]:
    """One row's (n, k) float32 log-probabilities, int32 ids and (n,) float32 tail as base64 (our server's compact
    answer, `hf_distill_format="base64"`)."""
    n, k = log_probs.shape
    return {"positions": n, "k": k, "logprobs": base64.b64encode(log_probs.astype("<f4").tobytes()).decode(),
            "ids": base64.b64encode(ids.astype("<i4").tobytes()).decode(),
            "tail": base64.b64encode(tail.astype("<f4").tobytes()).decode()}


def _decode_arrays(item: Any, r: int, n: int, k: int) -> RowScores:
    if not isinstance(item, dict) or item.get("positions") != n or item.get("k") != k:
        got = (item.get("positions"), item.get("k")) if isinstance(item, dict) else None
        raise MalformedAnswer(f"row {r}: arrays for (positions, k) = {got}, ({n}, {k}) asked")
    try:
        lp = np.frombuffer(base64.b64decode(item["logprobs"]), "<f4").astype(np.float64).reshape(n, k)
        ids = np.frombuffer(base64.b64decode(item["ids"]), "<i4").astype(np.int64).reshape(n, k)
        tail = np.frombuffer(base64.b64decode(item["tail"]), "<f4").astype(np.float64).reshape(n)
    except (KeyError, ValueError, TypeError) as err:
        raise MalformedAnswer(f"row {r}: arrays that do not decode ({err})") from None
    if np.isnan(lp).any() or (lp > 1e-6).any() or np.isnan(tail).any() or (tail > 1e-6).any():
        raise MalformedAnswer(f"row {r}: log-probabilities must be <= 0")
    return RowScores(np.minimum(lp, 0.0), ids, np.minimum(tail, 0.0))


def generate_request(protocol: str, model: str | None, rows: list[list[int]], max_new_tokens: int,
                     temperature: float, top_p: float, stop_ids: list[int], seed: int) -> tuple[str, dict[str, Any]]:
    """(path, JSON body) asking for one sampled completion of each prompt (token ids), its token ids returned."""
    rows = [[int(t) for t in r] for r in rows]
    if protocol == "sglang":
        params = {"max_new_tokens": max_new_tokens, "temperature": temperature, "top_p": top_p,
                  "stop_token_ids": stop_ids, "sampling_seed": seed}
        return "/generate", {"input_ids": rows, "sampling_params": params}
    body = {"prompt": rows, "max_tokens": max_new_tokens, "temperature": temperature, "top_p": top_p,
            "stop_token_ids": stop_ids, "seed": seed, "return_token_ids": True, "skip_special_tokens": False}
    if model is not None:
        body["model"] = model
    return "/v1/completions", body


def _entries(answer: Any, protocol: str, n_rows: int) -> list[tuple[list, list | None]]:
    """Per row: (the per-position top-k entries, the server's tails or None)."""
    if protocol == "sglang":
        items = answer if isinstance(answer, list) else [answer]
        if len(items) != n_rows:
            raise MalformedAnswer(f"{len(items)} answers for {n_rows} rows")
        out = []
        for item in items:
            meta = item.get("meta_info") if isinstance(item, dict) else None
            if not isinstance(meta, dict) or not isinstance(meta.get("input_top_logprobs"), list):
                raise MalformedAnswer("no meta_info.input_top_logprobs list (was return_logprob honoured?)")
            out.append((meta["input_top_logprobs"], None))
        return out
    choices = answer.get("choices") if isinstance(answer, dict) else None
    if not isinstance(choices, list) or len(choices) != n_rows:
        got = len(choices) if isinstance(choices, list) else "no"
        raise MalformedAnswer(f"{got} choices for {n_rows} rows")
    choices = sorted(choices, key=lambda c: c.get("index", 0) if isinstance(c, dict) else 0)
    out = []
    for c in choices:
        if not isinstance(c, dict) or not isinstance(c.get("prompt_logprobs"), list):
            raise MalformedAnswer("a choice without a prompt_logprobs list (does the server support prompt_logprobs?)")
        tails = c.get("prompt_logprobs_tail")
        out.append((c["prompt_logprobs"], tails if isinstance(tails, list) else None))
    return out


def _position(entry: Any, protocol: str) -> list[tuple[float, int, int]]:
    """(logprob, token id, rank) of every entry at one position."""
    found = []
    if protocol == "sglang":
        if not isinstance(entry, list):
            raise MalformedAnswer(f"a position's top log-probabilities are {type(entry).__name__}, not a list")
        for e in entry:
            if not isinstance(e, list | tuple) or len(e) < 2:
                raise MalformedAnswer(f"a top log-probability entry {e!r} is not [logprob, token_id, ...]")
            found.append((float(e[0]), int(e[1]), len(found) + 1))
        return found
    if not isinstance(entry, dict):
        raise MalformedAnswer(f"a position's prompt_logprobs are {type(entry).__name__}, not an object")
    for token, e in entry.items():
        value = e.get("logprob") if isinstance(e, dict) else e
        if not isinstance(value, int | float):
            raise MalformedAnswer(f"token {token!r} has no numeric logprob ({e!r})")
        rank = e.get("rank") if isinstance(e, dict) else None
        found.append((float(value), int(token), int(rank) if isinstance(rank, int) else 0))
    return found


def parse_scores(answer: Any, protocol: str, rows: list[list[int]], k: int, vocab_size: int | None = None
                 ) -> list[RowScores]:
    """The answer to `score_request(protocol, ..., rows, k)` as one :class:`RowScores` per row. Refused with what
    was wrong: another number of rows or positions, fewer than k entries at a position, ids outside the vocabulary,
    log-probabilities that are not finite and <= 0, or top-k mass above 1."""
    out = []
    compact = protocol == "hf_distill" and isinstance(answer, dict) and isinstance(answer.get("choices"), list) and \
        all(isinstance(c, dict) and "hf_distill_arrays" in c for c in answer["choices"])
    if compact:
        choices = sorted(answer["choices"], key=lambda c: c.get("index", 0))
        if len(choices) != len(rows):
            raise MalformedAnswer(f"{len(choices)} choices for {len(rows)} rows")
        for r, (row, c) in enumerate(zip(rows, choices, strict=True)):
            scores = _decode_arrays(c["hf_distill_arrays"], r, len(row) - 1, k)
            top = int(scores.ids.max()) if scores.ids.size else 0
            if scores.ids.size and (scores.ids.min() < 0 or (vocab_size is not None and top >= vocab_size)):
                raise MalformedAnswer(f"row {r}: token ids outside the vocabulary")
            out.append(scores)
        return out
    for r, (row, (entries, tails)) in enumerate(zip(rows, _entries(answer, protocol, len(rows)), strict=True)):
        n = len(row) - 1
        if len(entries) != len(row):
            raise MalformedAnswer(f"row {r} has {len(row)} tokens but the answer holds {len(entries)} positions")
        if tails is not None and len(tails) != len(row):
            raise MalformedAnswer(f"row {r}: {len(tails)} tails for {len(row)} positions")
        lp = np.empty((n, k), dtype=np.float64)
        ids = np.empty((n, k), dtype=np.int64)
        tail = np.empty(n, dtype=np.float64)
        for p in range(1, len(row)):
            found = _position(entries[p], protocol)
            if len(found) < k:
                raise MalformedAnswer(f"row {r}, position {p}: {len(found)} log-probabilities, {k} asked (short "
                                      "answer)")
            # vLLM adds the prompt's own token when it is outside the top k: keep the k largest
            found.sort(key=lambda e: (-e[0], e[2]))
            top = found[:k]
            values = np.array([e[0] for e in top], dtype=np.float64)
            index = np.array([e[1] for e in top], dtype=np.int64)
            if np.isnan(values).any() or np.any(values > 1e-6):
                raise MalformedAnswer(f"row {r}, position {p}: log-probabilities must be <= 0, got {values.max()}")
            outside = index.min() < 0 or (vocab_size is not None and index.max() >= vocab_size)
            if len(set(index.tolist())) != k or outside:
                raise MalformedAnswer(f"row {r}, position {p}: token ids repeated or outside the vocabulary")
            lp[p - 1], ids[p - 1] = np.minimum(values, 0.0), index
            tail[p - 1] = _server_tail(tails[p], r, p) if tails is not None else log_tail(lp[p - 1])
        out.append(RowScores(lp, ids, tail))
    return out


def _server_tail(value: Any, r: int, p: int) -> float:
    if value is None or value == "-inf":
        return -math.inf
    if not isinstance(value, int | float) or math.isnan(value) or value > 1e-6:
        raise MalformedAnswer(f"row {r}, position {p}: tail {value!r} is not a log-probability")
    return min(float(value), 0.0)


def log_tail(log_probs: np.ndarray) -> float:
    """log(1 - sum(exp(log_probs))) in float64; -inf when the k values hold all of the mass (up to rounding). Top-k
    mass measurably above 1 is refused (the values are not log-probabilities of one distribution)."""
    top = float(np.logaddexp.reduce(log_probs.astype(np.float64)))
    if top > 1e-4:
        raise MalformedAnswer(f"the top-k probabilities sum to {math.exp(top):.6f} > 1")
    return math.log(-math.expm1(top)) if top < 0 else -math.inf


def parse_generation(answer: Any, protocol: str, n_rows: int) -> list[list[int]]:
    """The generated token ids of each prompt (the completion only), refused when the server did not send them."""
    if protocol == "sglang":
        items = answer if isinstance(answer, list) else [answer]
        ids = [item.get("output_ids") if isinstance(item, dict) else None for item in items]
    else:
        choices = answer.get("choices") if isinstance(answer, dict) else None
        choices = sorted(choices, key=lambda c: c.get("index", 0)) if isinstance(choices, list) else []
        ids = [c.get("token_ids") if isinstance(c, dict) else None for c in choices]
    if len(ids) != n_rows or any(not isinstance(i, list) or not all(isinstance(t, int) for t in i) for i in ids):
        raise MalformedAnswer(f"the generation answer does not hold token ids for each of the {n_rows} prompts "
                              "(vLLM needs return_token_ids, >= 0.10.2; SGLang sends output_ids)")
    return ids


__all__ = ["METADATA_PATH", "PROBE_TEXT", "PROTOCOLS", "MalformedAnswer", "RowScores", "encode_arrays",
           "generate_request", "log_tail", "parse_generation", "parse_scores", "score_request"]
