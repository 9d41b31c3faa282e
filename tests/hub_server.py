"""A local stand-in for the Hugging Face Hub: the HTTP endpoints `huggingface_hub` 2.4 calls to publish and download.

`FakeHub` runs a stdlib `ThreadingHTTPServer` on 127.0.0.1 (a free port) in a thread and keeps what it
receives, so tests check on the server side which files arrived and what they contain. Model repos and dataset
repos (`{kind}` below: `models` or `datasets`; `hub.files(repo_id, repo_type="dataset")`) are kept apart.
Implemented:

- `POST /api/repos/create`                          create_repo (409 when it exists: exist_ok handles it)
- `POST /api/validate-yaml`                         README metadata check made before any upload
- `POST /api/{kind}/{ns}/{name}/preupload/{rev}`    upload modes: always "regular", so contents come inline
- `POST /api/{kind}/{ns}/{name}/commit/{rev}`       NDJSON commit: header, base64 "file", "deletedFile"
- `POST /api/{kind}/{ns}/{name}/branch/{branch}`    create_branch
- `GET  /api/{kind}/{ns}/{name}[/revision/{rev}]`   repo_info
- `GET  /api/{kind}/{ns}/{name}/tree/{rev}`         list_repo_tree (one page, every file)
- `HEAD|GET /[datasets/]{ns}/{name}/resolve/{rev}/{path}`   a file's metadata and contents (hf_hub_download)
- `GET  /api/whoami-v2`                             whoami

A revision is a branch name or a commit id (every commit's tree is kept). `fail={"commit": 500}` makes an
endpoint answer that status (with an `error` message), to test failures. `online(monkeypatch, hub.endpoint)` points
huggingface_hub at it. This module also builds the tiny real distillation run that the publishing tests share.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

import yaml

USER = "fake-user"
_REPO = r"/api/(?P<kind>models|datasets)/(?P<repo>[^/]+/[^/]+)"
_FILE = r"/(?:(?P<kind>datasets)/)?(?P<repo>[^/]+/[^/]+)/resolve/(?P<rev>[^/]+)/(?P<path>.+)"
_ROUTES = [
    ("POST", re.compile(r"/api/repos/create"), "create_repo"),
    ("POST", re.compile(r"/api/validate-yaml"), "validate_yaml"),
    ("POST", re.compile(_REPO + r"/preupload/(?P<rev>.+)"), "preupload"),
    ("POST", re.compile(_REPO + r"/commit/(?P<rev>.+)"), "commit"),
    ("POST", re.compile(_REPO + r"/branch/(?P<rev>.+)"), "branch"),
    ("GET", re.compile(_REPO + r"/tree/(?P<rev>[^/]+)"), "tree"),
    ("GET", re.compile(_REPO + r"(?:/revision/(?P<rev>.+))?"), "repo_info"),
    ("GET", re.compile(r"/api/whoami-v2"), "whoami"),
    ("HEAD", re.compile(_FILE), "file"),
    ("GET", re.compile(_FILE), "file"),
]


def online(mp: Any, endpoint: str, xet: bool = True) -> None:
    """Let huggingface_hub talk to `endpoint` (the tests run with HF_HUB_OFFLINE=1 otherwise).

    With hf_xet installed, `upload_folder` takes huggingface_hub's pipelined path (preupload + commit, as the
    fake Hub answers "regular" for every file no Xet transfer happens), which retries a failed commit five
    times over ~23 s; `xet=False` selects the single-commit path, which fails at once.
    """
    import huggingface_hub.constants as hub_constants
    import transformers.utils.hub as transformers_hub

    mp.setattr(hub_constants, "HF_HUB_OFFLINE", False)
    mp.setattr(hub_constants, "ENDPOINT", endpoint)
    # downloads build file URLs from this template, made from HF_ENDPOINT at import
    mp.setattr(hub_constants, "HUGGINGFACE_CO_URL_TEMPLATE", endpoint + "/{repo_id}/resolve/{revision}/{filename}")
    mp.setattr(transformers_hub, "_hf_api", None)  # the Trainer's shared HfApi keeps the endpoint it was made with
    if not xet:
        mp.setattr(hub_constants, "HF_HUB_DISABLE_XET", True)


class FakeHub:
    """In-memory repos: {repo_id: {"private": bool, "revisions": {rev: {path: bytes}}, "commits": [...],
    "trees": {commit id: {path: bytes}}}}; `repos` holds the model repos, `datasets` the dataset repos."""

    def __init__(self, fail: dict[str, int] | None = None) -> None:
        self.repos: dict[str, dict[str, Any]] = {}
        self.datasets: dict[str, dict[str, Any]] = {}
        self.fail = dict(fail or {})
        self.requests: list[tuple[str, str, str | None]] = []  # (method, path, authorization header)
        self._server: ThreadingHTTPServer | None = None
        self.endpoint = ""

    # ------------------------------------------------------------------ lifecycle

    def __enter__(self) -> FakeHub:
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                hub._handle(self, "GET")

            def do_POST(self) -> None:
                hub._handle(self, "POST")

            def do_HEAD(self) -> None:
                hub._handle(self, "HEAD")

            def log_message(self, *args: Any) -> None:  # keep test output clean
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"
        threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        ).start()
        return self

    def __exit__(self, *exc: Any) -> None:
        assert self._server is not None
        self._server.shutdown()
        self._server.server_close()

    def files(self, repo_id: str, revision: str = "main", repo_type: str = "model") -> dict[str, bytes]:
        return self._store(repo_type)[repo_id]["revisions"].get(revision, {})

    def _store(self, kind: str | None) -> dict[str, dict[str, Any]]:
        return self.datasets if kind in ("dataset", "datasets") else self.repos

    # ------------------------------------------------------------------ dispatch

    def _handle(self, request: BaseHTTPRequestHandler, method: str) -> None:
        path = unquote(urlsplit(request.path).path)
        self.requests.append((method, path, request.headers.get("Authorization")))
        length = int(request.headers.get("Content-Length") or 0)
        body = request.rfile.read(length) if length else b""
        for verb, pattern, name in _ROUTES:
            match = pattern.fullmatch(path)
            if verb == method and match:
                if name in self.fail:
                    return self._reply(request, self.fail[name], {"error": f"simulated {name} failure"})
                if name == "file":
                    return self._file(request, method, **match.groupdict())
                status, payload = getattr(self, "_" + name)(body, **match.groupdict())
                return self._reply(request, status, payload)
        self._reply(request, 404, {"error": f"no route for {method} {path}"})

    def _reply(self, request: BaseHTTPRequestHandler, status: int, payload: Any) -> None:
        data = json.dumps(payload).encode()
        request.send_response(status)
        request.send_header("Content-Type", "application/json")
        request.send_header("Content-Length", str(len(data)))
        if status == 404 and "Repository" in (payload.get("error", "") if isinstance(payload, dict) else ""):
            request.send_header("X-Error-Code", "RepoNotFound")
        request.end_headers()
        request.wfile.write(data)

    # ------------------------------------------------------------------ endpoints

    def _create_repo(self, body: bytes) -> tuple[int, dict[str, Any]]:
        spec = json.loads(body)
        repo_id = f"{spec.get('organization') or USER}/{spec['name']}"
        kind = spec.get("type") or "model"
        url = f"{self.endpoint}/{'datasets/' if kind == 'dataset' else ''}{repo_id}"
        store = self._store(kind)
        if repo_id in store:
            return 409, {"error": f"You already created this {kind} repo", "url": url}
        private = spec.get("visibility") == "private" or bool(spec.get("private"))
        store[repo_id] = {"private": private, "revisions": {"main": {}}, "commits": [], "trees": {}}
        return 200, {"url": url, "name": repo_id}

    def _validate_yaml(self, body: bytes) -> tuple[int, dict[str, Any]]:
        content = json.loads(body)["content"]
        if content.startswith("---"):
            try:
                yaml.safe_load(content.split("---", 2)[1])
            except yaml.YAMLError as error:
                return 400, {"errors": [{"message": str(error)}], "warnings": []}
        return 200, {"errors": [], "warnings": []}

    def _missing(self, repo: str, kind: str | None = None) -> tuple[int, dict[str, Any]] | None:
        return None if repo in self._store(kind) else (404, {"error": "Repository not found"})

    def _preupload(self, body: bytes, repo: str, rev: str, kind: str) -> tuple[int, dict[str, Any]]:
        if missing := self._missing(repo, kind):
            return missing
        files = [
            {"path": f["path"], "uploadMode": "regular", "shouldIgnore": False, "oid": None}
            for f in json.loads(body)["files"]
        ]
        return 200, {"files": files, "commitOid": None}

    def _commit(self, body: bytes, repo: str, rev: str, kind: str) -> tuple[int, dict[str, Any]]:
        if missing := self._missing(repo, kind):
            return missing
        lines = [json.loads(line) for line in body.decode().splitlines() if line.strip()]
        header = next(item["value"] for item in lines if item["key"] == "header")
        store = self._store(kind)
        tree = dict(store[repo]["revisions"].get(rev, {}))
        for item in lines:
            key, value = item["key"], item["value"]
            if key == "file":
                tree[value["path"]] = base64.b64decode(value["content"])
            elif key == "deletedFile":
                tree.pop(value["path"], None)
            elif key != "header":
                return 400, {"error": f"FakeHub does not implement {key!r} entries"}
        store[repo]["revisions"][rev] = tree
        oid = hashlib.sha1(body).hexdigest()
        store[repo]["trees"][oid] = tree
        store[repo]["commits"].append({"oid": oid, "summary": header["summary"], "revision": rev})
        prefix = "datasets/" if kind == "datasets" else ""
        return 200, {
            "commitUrl": f"{self.endpoint}/{prefix}{repo}/commit/{oid}",
            "commitOid": oid,
            "pullRequestUrl": None,
        }

    def _branch(self, body: bytes, repo: str, rev: str, kind: str) -> tuple[int, dict[str, Any]]:
        if missing := self._missing(repo, kind):
            return missing
        revisions = self._store(kind)[repo]["revisions"]
        if rev in revisions:
            return 409, {"error": "Reference already exists"}
        revisions[rev] = dict(revisions["main"])
        return 200, {}

    def _repo_info(self, body: bytes, repo: str, kind: str, rev: str | None = None) -> tuple[int, dict[str, Any]]:
        if missing := self._missing(repo, kind):
            return missing
        entry = self._store(kind)[repo]
        on_branch = [c for c in entry["commits"] if c["revision"] == (rev or "main")]
        files = self._tree_of(kind, repo, rev or "main") or {}
        return 200, {
            "id": repo,
            "modelId": repo,
            "private": entry["private"],
            "sha": on_branch[-1]["oid"] if on_branch else "0" * 40,
            "siblings": [{"rfilename": name} for name in sorted(files)],
        }

    def _tree(self, body: bytes, repo: str, kind: str, rev: str) -> tuple[int, Any]:
        if missing := self._missing(repo, kind):
            return missing
        files = self._tree_of(kind, repo, rev)
        if files is None:
            return 404, {"error": f"Invalid rev id: {rev}"}
        return 200, [{"type": "file", "path": name, "size": len(data), "oid": _git_oid(data)}
                     for name, data in sorted(files.items())]

    def _tree_of(self, kind: str | None, repo: str, rev: str) -> dict[str, bytes] | None:
        entry = self._store(kind)[repo]
        return entry["revisions"].get(rev, entry["trees"].get(rev))

    def _file(self, request: BaseHTTPRequestHandler, method: str, kind: str | None, repo: str, rev: str,
              path: str) -> None:
        if repo not in self._store(kind):
            return self._reply(request, 404, {"error": "Repository not found"})
        files = self._tree_of(kind, repo, rev)
        if files is None or path not in files:
            return self._reply(request, 404, {"error": f"Entry not found: {path} at {rev}"})
        entry = self._store(kind)[repo]
        commit = rev if rev in entry["trees"] else [c for c in entry["commits"] if c["revision"] == rev][-1]["oid"]
        data = files[path]
        request.send_response(200)
        request.send_header("Content-Type", "application/octet-stream")
        request.send_header("Content-Length", str(len(data)))
        request.send_header("ETag", f'"{_git_oid(data)}"')
        request.send_header("X-Repo-Commit", commit)
        request.end_headers()
        if method == "GET":
            request.wfile.write(data)

    def _whoami(self, body: bytes) -> tuple[int, dict[str, Any]]:
        return 200, {"type": "user", "name": USER, "orgs": []}


def _git_oid(data: bytes) -> str:
    """The git blob id of a file's contents (what the Hub sends as a regular file's ETag and tree oid)."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


# ---------------------------------------------------------------------- a tiny real distillation run

VOCAB_WORDS = [
    "good",
    "great",
    "fine",
    "love",
    "nice",
    "bad",
    "awful",
    "poor",
    "hate",
    "dull",
    "the",
    "movie",
    "film",
    "plot",
    "was",
    "is",
    "a",
    "very",
    "not",
    "really",
]
POSITIVE = {"good", "great", "fine", "love", "nice"}


def tiny_tokenizer(folder: Path):
    """A real WordPiece `BertTokenizerFast` built from a vocabulary file written to `folder`."""
    from transformers import BertTokenizerFast

    folder.mkdir(parents=True, exist_ok=True)
    vocab = folder / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *VOCAB_WORDS]) + "\n")
    return BertTokenizerFast(vocab_file=str(vocab))


def tiny_dataset(tokenizer, n: int, seed: int):
    """Sentences whose label is whether they hold a positive word: learnable in a few steps."""
    import random

    from datasets import Dataset

    rng = random.Random(seed)
    rows = []
    for i in range(n):
        words = rng.choices(VOCAB_WORDS[10:], k=rng.randint(2, 6))
        word = rng.choice(VOCAB_WORDS[:5] if i % 2 else VOCAB_WORDS[5:10])
        words.insert(rng.randint(0, len(words)), word)
        rows.append({"sentence": " ".join(words), "label": int(word in POSITIVE)})
    ds = Dataset.from_list(rows)
    return ds.map(lambda b: tokenizer(b["sentence"]), batched=True, remove_columns=["sentence"])


def accuracy(eval_pred) -> dict[str, float]:
    predictions, labels = eval_pred
    return {"accuracy": float((predictions.argmax(-1) == labels).mean())}


def tiny_run(root: Path, *, hidden_term: bool = True, max_steps: int = 6, **arg_overrides: Any):
    """Train a 2-layer, 16-wide student from a 4-layer, 32-wide random BERT teacher for a few steps.

    The teacher is saved to `root/teacher` first (so the card can measure its size), and a hidden-state
    term makes the trainer hold projections, saved into the checkpoints it writes. Returns the trainer.
    """
    import torch
    from transformers import BertConfig, BertForSequenceClassification, DataCollatorWithPadding

    from hf_distill import DistillationArguments, DistillationTrainer, students

    tokenizer = tiny_tokenizer(root / "tokenizer")
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=tokenizer.vocab_size,
        hidden_size=32,
        num_hidden_layers=4,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=32,
        num_labels=2,
    )
    BertForSequenceClassification(config).save_pretrained(root / "teacher")
    teacher = BertForSequenceClassification.from_pretrained(root / "teacher")
    student = students.shrink(
        teacher, num_layers=2, hidden_size=16, num_attention_heads=2, intermediate_size=32, seed=0
    )
    settings = dict(
        output_dir=str(root / "out"),
        max_steps=max_steps,
        per_device_train_batch_size=8,
        learning_rate=5e-3,
        logging_steps=2,
        eval_strategy="steps",
        eval_steps=3,
        save_strategy="steps",
        save_steps=3,
        report_to=[],
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
        dataloader_num_workers=0,
        temperature=2.0,
        distill_terms=["loss=hidden_mse,layers=uniform,weight=0.5"] if hidden_term else None,
    )
    settings.update(arg_overrides)
    trainer = DistillationTrainer(
        model=student,
        teacher_model=teacher,
        args=DistillationArguments(**settings),
        train_dataset=tiny_dataset(tokenizer, 48, seed=0),
        eval_dataset=tiny_dataset(tokenizer, 16, seed=1),
        data_collator=DataCollatorWithPadding(tokenizer),
        processing_class=tokenizer,
        compute_metrics=accuracy,
    )
    trainer.train()
    return trainer
