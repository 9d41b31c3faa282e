"""`hf-distill teacher serve MODEL --port N --k 64 [--device] [--dtype] [--host] [--temperature] [--api-key-env]`:
the package's own teacher server (hf_distill.serving.server) from the command line. Settings are checked before the
model loads; the API key is read from the environment variable named, never from the command line (which `ps`
shows)."""

from __future__ import annotations

import argparse
import os
from typing import Any

from ..base.tokenizer_files import check_tokenizer_folder


def add_parser(sub: argparse._SubParsersAction) -> None:
    teacher = sub.add_parser("teacher", help="serve a causal-LM teacher over HTTP for served-teacher distillation",
                             description="Serve a teacher (docs/guides/served-teacher.md).")
    actions = teacher.add_subparsers(dest="teacher_command", metavar="<action>")
    serve = actions.add_parser(
        "serve", help="serve MODEL on 127.0.0.1:PORT (vLLM-compatible completions with prompt_logprobs)",
        description="Serve a causal LM: POST /v1/completions (vLLM's prompt_logprobs request, plus the exact tail), "
        "GET /hf_distill/metadata, POST /tokenize. Stops cleanly on SIGTERM or Ctrl-C.",
        epilog="Train against it with DistillationTrainer(teacher_model='http://HOST:PORT/v1', "
        "processing_class=<the student's tokenizer, the teacher's vocabulary>, args=DistillationArguments("
        "teacher_top_k=<at most --k>, temperature=<--temperature>, teacher_api_key_env=<--api-key-env>)); "
        "docs/guides/served-teacher.md.")
    serve.add_argument("model", help="teacher folder or Hub id (AutoModelForCausalLM)")
    serve.add_argument("--port", type=int, default=8000, help="TCP port (default: 8000)")
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1, this machine only)")
    serve.add_argument("--k", type=int, default=64,
                       help="the largest k a request may ask: training's teacher_top_k must not exceed it "
                       "(default: 64)")
    serve.add_argument("--temperature", type=float, default=1.0,
                       help="temperature the server applies to every log-probability (default: 1.0); training's "
                       "DistillationArguments.temperature must be the same")
    serve.add_argument("--device", default=None, help="where the teacher runs, e.g. cuda (default: cpu)")
    serve.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default=None,
                       help="load the teacher in this dtype (default: as saved)")
    serve.add_argument("--api-key-env", dest="api_key_env", default=None,
                       help="name of the environment variable holding the API key clients must send (training: "
                       "teacher_api_key_env names the variable that holds it there)")
    serve.add_argument("--max-batch-tokens", dest="max_batch_tokens", type=int, default=8192,
                       help="tokens per batched forward of concurrent requests (default: 8192)")
    serve.add_argument("--name", default=None, help="the model name the server states (default: MODEL)")


def cmd_teacher(args: argparse.Namespace, error: Any, device: Any, load: Any) -> int:
    """Check the settings, load the teacher and its tokenizer, serve until SIGTERM. `error` is the CLI's
    CommandError, `device` and `load` its device check and loader (hf_distill.cli)."""
    if args.teacher_command != "serve":
        raise error("`hf-distill teacher` needs an action: serve (see hf-distill teacher serve --help).", 2)
    if not 0 <= args.port < 65536:
        raise error(f"--port {args.port}: choose a port in 0..65535.", 2)
    if args.k < 1:
        raise error(f"--k {args.k}: must be >= 1.", 2)
    if not args.temperature > 0:
        raise error(f"--temperature {args.temperature}: must be > 0.", 2)
    if args.max_batch_tokens < 1:
        raise error(f"--max-batch-tokens {args.max_batch_tokens}: must be >= 1.", 2)
    key = None
    if args.api_key_env:
        key = os.environ.get(args.api_key_env)
        if not key:
            raise error(f"--api-key-env {args.api_key_env}: that environment variable is not set (or empty).", 2)
    _check_address(args.host, args.port, error)
    run_on = device(args.device)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .server import ServedModel, serve

    dtype = getattr(torch, args.dtype) if args.dtype else None
    kwargs = {"dtype": dtype} if dtype is not None else {}
    check_tokenizer_folder(args.model, "The model", "Save its tokenizer in that folder.")  # before the weights load
    model = load("teacher", args.model, lambda: AutoModelForCausalLM.from_pretrained(args.model, **kwargs))
    tokenizer = load("tokenizer", args.model, lambda: AutoTokenizer.from_pretrained(args.model))
    served = ServedModel(model, tokenizer, args.name or args.model, max_k=args.k, temperature=args.temperature,
                         device=None if run_on is None else str(run_on), dtype=dtype)
    serve(served, host=args.host, port=args.port, api_key=key, max_batch_tokens=args.max_batch_tokens)
    return 0


def _check_address(host: str, port: int, error: Any) -> None:
    """Bind the address once, as the server will (SO_REUSEADDR, as aiohttp sets it), before the model loads: a port
    in use or a host that is not this machine's is one error line, not a traceback after a long load."""
    import errno
    import socket

    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind(address)
    except OSError as err:
        fix = ("choose a free port (--port), or stop what listens on it" if err.errno == errno.EADDRINUSE else
               "give an address of this machine (--host; default 127.0.0.1) and a port you may use (--port)")
        raise error(f"--host {host} --port {port}: cannot listen there ({err.strerror or err}): {fix}.", 2) from None


__all__ = ["add_parser", "cmd_teacher"]
