"""Teacher servers on 127.0.0.1 for the served-teacher tests: small aiohttp apps built to vLLM's and SGLang's
documented answer schemas, computing real log-probabilities from a tiny model (no temperature: both servers return
the raw model's), plus faulty behaviours (slow, garbage, 5xx, short answers) and a request log."""

from __future__ import annotations

import asyncio
import time

import torch
import torch.nn.functional as F
from aiohttp import web

from hf_distill.serving.server import ServerThread


def _log_probs(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        z = model(input_ids=torch.tensor([ids])).logits[0]
    return F.log_softmax(z.double(), -1)  # (len, vocab): row p predicts token p + 1


def fake_vllm(model, tokenizer, name: str = "fake/teacher", max_logprobs: int = 20, log: list | None = None,
              fault: dict | None = None) -> web.Application:
    """vLLM's OpenAI server: GET /v1/models, POST /tokenize, POST /v1/completions with prompt_logprobs (top k plus
    the prompt token when it is outside them, each {logprob, rank, decoded_token}). `fault`: {"slow": seconds,
    "status": code, "garbage": True, "short": True, "fail_first": n}."""
    fault = fault if fault is not None else {}
    log = log if log is not None else []

    async def models(request):
        return web.json_response({"object": "list", "data": [{"id": name, "object": "model"}]})

    async def tokenize(request):
        body = await request.json()
        tokens = tokenizer(body["prompt"], add_special_tokens=body.get("add_special_tokens", True))["input_ids"]
        return web.json_response({"tokens": tokens, "count": len(tokens), "max_model_len": 64})

    async def completions(request):
        body = await request.json()
        log.append(("completions", time.monotonic(), body))
        if fault.get("slow"):
            await asyncio.sleep(fault["slow"])
        if fault.get("fail_first", 0) > 0:
            fault["fail_first"] -= 1
            return web.json_response({"message": "overloaded"}, status=503)
        if fault.get("status"):
            return web.json_response({"message": "down"}, status=fault["status"])
        if fault.get("garbage"):
            return web.Response(text="<html>502 gateway</html>", content_type="text/html")
        k = body.get("prompt_logprobs")
        if k is not None and k > max_logprobs:
            return web.json_response({"object": "error", "message": f"Requested prompt logprobs of {k}, which is "
                                      f"greater than max allowed: {max_logprobs}", "code": 400}, status=400)
        prompts = body["prompt"] if isinstance(body["prompt"][0], list) else [body["prompt"]]
        if k is None:  # a vLLM before return_token_ids: text only
            return web.json_response({"id": "cmpl-1", "object": "text_completion", "model": name, "choices": [
                {"index": i, "text": "w5", "logprobs": None, "finish_reason": "length"} for i in range(len(prompts))]})
        choices = []
        for i, ids in enumerate(prompts):
            lp = _log_probs(model, ids)
            positions = [None]
            for p in range(1, len(ids)):
                values, top = lp[p - 1].topk(k)
                entry = {str(int(t)): {"logprob": float(v), "rank": r + 1, "decoded_token": f"w{int(t)}"}
                         for r, (v, t) in enumerate(zip(values, top, strict=True))}
                own = ids[p]
                if str(own) not in entry:  # vLLM adds the prompt's own token with its rank
                    rank = int((lp[p - 1] > lp[p - 1, own]).sum()) + 1
                    entry[str(own)] = {"logprob": float(lp[p - 1, own]), "rank": rank, "decoded_token": f"w{own}"}
                if fault.get("short") and p == len(ids) - 1:
                    entry = dict(list(entry.items())[: k - 1])
                positions.append(entry)
            choices.append({"index": i, "text": "w5", "logprobs": None, "finish_reason": "length",
                            "prompt_logprobs": positions})
        return web.json_response({"id": "cmpl-1", "object": "text_completion", "model": name, "choices": choices})

    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/v1/completions", completions)
    return app


def fake_sglang(model, tokenizer, log: list | None = None) -> web.Application:
    """SGLang's native server: GET /get_model_info, POST /tokenize, POST /generate with return_logprob,
    top_logprobs_num and logprob_start_len=0 (meta_info.input_top_logprobs: null, then [[logprob, id, text], ...])."""
    log = log if log is not None else []

    async def info(request):
        return web.json_response({"model_path": "fake/sglang-teacher", "tokenizer_path": "fake",
                                  "is_generation": True})

    async def tokenize(request):
        body = await request.json()
        tokens = tokenizer(body["prompt"], add_special_tokens=body.get("add_special_tokens", True))["input_ids"]
        return web.json_response({"tokens": tokens, "count": len(tokens), "max_model_len": 64})

    async def generate(request):
        body = await request.json()
        log.append(("generate", time.monotonic(), body))
        assert body["return_logprob"] and body["logprob_start_len"] == 0
        k = body["top_logprobs_num"]
        rows = body["input_ids"] if isinstance(body["input_ids"][0], list) else [body["input_ids"]]
        out = []
        for ids in rows:
            lp = _log_probs(model, ids)
            top = [None]
            for p in range(1, len(ids)):
                values, index = lp[p - 1].topk(k)
                top.append([[float(v), int(t), None] for v, t in zip(values, index, strict=True)])
            out.append({"text": "", "meta_info": {"input_top_logprobs": top, "prompt_tokens": len(ids)}})
        return web.json_response(out if isinstance(body["input_ids"][0], list) else out[0])

    app = web.Application()
    app.router.add_get("/get_model_info", info)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/generate", generate)
    return app


__all__ = ["ServerThread", "fake_sglang", "fake_vllm"]
