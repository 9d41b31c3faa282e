"""The package's teacher server (hf_distill.serving.server, `hf-distill teacher serve`): the exact top-k + tail of the
offline signal, its metadata, batching of concurrent requests, the API key, and a clean stop on SIGTERM."""

from __future__ import annotations

import gc
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import weakref

import pytest
import torch
from helpers import VOCAB, llama, word_tokenizer

from hf_distill import losses
from hf_distill.data.cache_key import teacher_fingerprint
from hf_distill.data.signal_format import vocabulary_hash
from hf_distill.serving.client import TeacherClient
from hf_distill.serving.server import ServedModel, ServerThread, build_app

K = 8


def _tok():
    return word_tokenizer([f"w{i}" for i in range(VOCAB - 2)])


@pytest.fixture
def served():
    model = ServedModel(llama(1), _tok(), "tiny-teacher", max_k=K, temperature=2.0)
    server = ServerThread(build_app(model))
    yield model, server
    server.stop()


def test_metadata_and_the_exact_tail_of_the_offline_signal(served):
    model, server = served
    client = TeacherClient(server.url, k=K)
    assert client.detect() == "hf_distill"
    meta = client.metadata
    assert meta["teacher_fingerprint"] == teacher_fingerprint(model.model)
    assert meta["vocab_hash"] == vocabulary_hash(_tok()) and meta["max_top_k"] == K and meta["temperature"] == 2.0
    rows = [[5, 9, 30, 7], [8, 3]]
    before = client.bytes_received
    got = client.score(rows)
    compact = client.bytes_received - before
    for row, scores in zip(rows, got, strict=True):
        with torch.no_grad():
            z = model.model(input_ids=torch.tensor([row])).logits[0, :-1]
        values, ids, tail = losses.topk_with_tail(z, K, 2.0)  # the offline signal's computation, float32
        assert scores.ids.tolist() == ids.tolist()
        torch.testing.assert_close(torch.from_numpy(scores.log_probs).float(), values, rtol=0, atol=1e-6)
        torch.testing.assert_close(torch.from_numpy(scores.log_tail).float(), tail, rtol=0, atol=1e-6)
    # a vLLM client gets vLLM's JSON answer (prompt_logprobs objects, plus prompt_logprobs_tail)
    as_vllm = TeacherClient(server.url, k=K, protocol="vllm")
    as_vllm.detect()
    before = as_vllm.bytes_received
    json_scores = as_vllm.score(rows)
    assert [s.ids.tolist() for s in json_scores] == [s.ids.tolist() for s in got]
    assert as_vllm.bytes_received - before > 2 * compact  # the base64 arrays are the compact answer


def test_concurrent_requests_share_one_forward(served):
    model, server = served
    batcher = server.app["batcher"]
    gate, first = threading.Event(), threading.Event()
    real = model.score

    def held(rows, k):  # the first forward waits until the other requests are queued
        if not first.is_set():
            first.set()
            gate.wait(30)
        return real(rows, k)

    model.score = held
    client = TeacherClient(server.url, k=K, protocol="hf_distill")
    client.detect()
    answers = [None] * 6
    threads = [threading.Thread(target=lambda i=i: answers.__setitem__(i, client.score([[5, 6 + i, 7]])))
               for i in range(6)]
    threads[0].start()
    assert first.wait(30)
    for t in threads[1:]:
        t.start()
    for _ in range(3000):  # bounded: the 5 others are queued behind the held forward
        if batcher.queue.qsize() == 5:
            break
        time.sleep(0.01)
    assert batcher.queue.qsize() == 5
    gate.set()
    for t in threads:
        t.join(30)
    assert batcher.forwards == 2 and all(a is not None and a[0].positions == 2 for a in answers)
    assert answers[3][0].ids.tolist() == real([[5, 9, 7]], K)[0][1].tolist()  # each row got its own answer


def test_api_key_is_required_when_set(monkeypatch):
    model = ServedModel(llama(1), _tok(), "tiny", max_k=K)
    server = ServerThread(build_app(model, api_key="s3cret-key"))
    try:
        request = urllib.request.Request(server.url[:-3] + "/hf_distill/metadata")
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(request, timeout=10)
        assert err.value.code == 401
        monkeypatch.setenv("TEACHER_KEY", "s3cret-key")
        client = TeacherClient(server.url, k=K, api_key_env="TEACHER_KEY")
        assert client.detect() == "hf_distill"
    finally:
        server.stop()


@pytest.mark.parametrize("api_key", [None, "s3cret-key"])
def test_nothing_keeps_the_teacher_after_stop(monkeypatch, api_key):
    """After requests and stop(), the teacher is garbage-collected and no server thread remains (before: aiohttp's
    process-wide cache of middleware-wrapped handlers kept every handler, hence the ServedModel, alive)."""
    teacher = llama(1)
    gone = weakref.ref(teacher)
    server = ServerThread(build_app(ServedModel(teacher, _tok(), "tiny", max_k=K), api_key=api_key))
    monkeypatch.setenv("TEACHER_KEY", api_key or "")
    client = TeacherClient(server.url, k=K, api_key_env="TEACHER_KEY" if api_key else None)
    assert client.detect() == "hf_distill" and len(client.score([[5, 9, 7]])) == 1
    thread = server.thread
    server.stop()
    del teacher, server, client
    gc.collect()
    assert gone() is None and not thread.is_alive()


def test_a_k_above_the_largest_is_answered_400(served):
    _, server = served
    client = TeacherClient(server.url, k=K + 1, protocol="hf_distill")
    client.detect()
    with pytest.raises(Exception, match="greater than max allowed: 8"):
        client.score([[5, 6]])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_cli_serves_then_stops_cleanly_on_sigterm(tmp_path):
    """One process: `hf-distill teacher serve` answers the metadata and a scoring request, then exits 0 on SIGTERM."""
    folder = tmp_path / "teacher"
    llama(1).save_pretrained(folder)
    _tok().save_pretrained(folder)
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    proc = subprocess.Popen([sys.executable, "-m", "hf_distill.cli", "teacher", "serve", str(folder), "--port",
                             str(port), "--k", "4"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                            text=True)
    try:
        meta = None
        for _ in range(600):  # bounded: up to 60 s for the imports and the model load
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/hf_distill/metadata", timeout=2) as r:
                    meta = json.loads(r.read())
                break
            except (urllib.error.URLError, ConnectionError, OSError):
                if proc.poll() is not None:
                    break
                time.sleep(0.1)
        assert meta is not None and meta["max_top_k"] == 4, proc.stdout.read() if proc.poll() is not None else ""
        client = TeacherClient(f"http://127.0.0.1:{port}/v1", k=4)
        client.detect()
        assert client.score([[5, 6, 7]])[0].positions == 2
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0 and "stopped" in out


def test_cli_refuses_a_port_in_use_before_loading_the_teacher(tmp_path, capsys, monkeypatch):
    import transformers

    from hf_distill.cli import main

    loaded = []
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", lambda *a, **kw: loaded.append(a))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["teacher", "serve", str(tmp_path / "teacher"), "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --host 127.0.0.1 --port {port}: cannot listen there") and err.count("\n") == 1
    assert "choose a free port" in err and loaded == []


def test_serve_help_says_how_training_points_at_the_server(capsys):
    from hf_distill.cli import main

    assert main(["teacher", "serve", "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "teacher_model='http://HOST:PORT/v1'" in out and "teacher_top_k=<at most --k>" in out
    assert "teacher_top_k must not exceed it" in out and "DistillationArguments.temperature must be the same" in out
