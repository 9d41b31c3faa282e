"""The trainer's side of a served teacher: a teacher source whose logits are the server's top-k + tail, in the
offline signal's form (`topk_tail`), so the KD paths train from it exactly as from an offline teacher signal (the
sparse loss head, every divergence).

Rows are sent as token ids (each row's real tokens, padding dropped) and scored at every position; the positions the
KD term counts are taken from the answer when the batch is trained (`kd_positions`, as the signal stores them), so
on-policy completions are scored like any row. Requests run in a small thread pool: :meth:`ServedTeacher.submit`
sends a step's rows ahead of time (the trainer's prefetch of the next optimizer step), :meth:`ServedTeacher.wait`
makes sure a step's rows are all scored before any of its micro-batches trains: when the server stays down past the
retry limits, training stops there with one error naming the last intact checkpoint, and no step is ever trained
without its teacher signal.
"""

from __future__ import annotations

import concurrent.futures
import os
import threading
from typing import Any

import numpy as np
import torch

from ..base.batch_keys import ROUTE_COLUMN
from ..base.positions import kd_positions
from .client import TeacherClient, TeacherRefused, TeacherUnreachable
from .protocol import PROBE_TEXT, MalformedAnswer, RowScores

SERVED_DEFAULTS = {"teacher_top_k": 64, "teacher_protocol": None, "teacher_api_key_env": None, "teacher_retries": 3,
                   "teacher_timeout": 60.0, "teacher_backoff": 0.5, "teacher_requests": 4, "teacher_prefetch": True}
"""The served-teacher fields and their defaults (hf_distill.arguments): another value without a URL is refused."""
_MAX_KEPT = 4096  # rows' answers kept by a loop that never calls wait() (Distiller.start_step)


class TeacherServerDown(RuntimeError):
    """The served teacher did not answer within the limits: training stopped before the step that needed it."""


def _row_key(ids: list[int]) -> bytes:
    return np.asarray(ids, dtype=np.int64).tobytes()


def _sequences(batch: dict[str, Any]) -> list[list[tuple[int, list[int]]]]:
    """Each row's sequences as `(first column, real tokens)`: its real tokens (where attention_mask is not 0) as one
    sequence, or, in a row that packs several (2-D `position_ids`: TRL's packing and padding-free rows,
    DataCollatorWithFlattening), one per run of consecutive positions, each scored alone as the model reads it."""
    ids = torch.as_tensor(batch["input_ids"]).cpu()
    mask = batch.get("attention_mask")
    real = torch.ones_like(ids, dtype=torch.bool) if mask is None else torch.as_tensor(mask).cpu() != 0
    pos = batch.get("position_ids")
    packed = isinstance(pos, torch.Tensor) and pos.dim() == 2
    out = []
    for i, row in enumerate(ids):
        cols = real[i].nonzero().flatten()
        if not packed or len(cols) < 2:
            out.append([(int(cols[0]) if len(cols) else 0, row[cols].tolist())])
            continue
        p = pos[i if pos.shape[0] > 1 else 0].cpu()[cols]  # (1, T) position_ids broadcast over the rows
        cuts = [0, *((p[1:] != p[:-1] + 1).nonzero().flatten() + 1).tolist(), len(cols)]
        out.append([(int(cols[a]), row[cols[a:b]].tolist()) for a, b in zip(cuts, cuts[1:], strict=False)])
    return out


def _real_rows(batch: dict[str, Any]) -> list[list[int]]:
    """The sequences the server scores for a batch, in order (`_sequences`)."""
    return [tokens for row in _sequences(batch) for _, tokens in row]


class ServedTeacher:
    """One teacher behind a URL (hf_distill.serving.client), read like the offline signal.

    Args:
        url: the server (`http://host:port/v1`).
        args: DistillationArguments (teacher_top_k, teacher_protocol, teacher_api_key_env, teacher_retries,
            teacher_timeout, teacher_backoff, teacher_requests, output_dir).
        settings: the run's loss settings (kd_token_mask is read at each call).
        label_name: the token labels' key.
    """

    form = "topk_tail"

    def __init__(self, url: str, args: Any, settings: Any, label_name: str) -> None:
        self.url, self.args, self.settings, self.label_name = url, args, settings, label_name
        self.client = TeacherClient(url, k=args.teacher_top_k, protocol=args.teacher_protocol,
                                    api_key_env=args.teacher_api_key_env, retries=args.teacher_retries,
                                    timeout=args.teacher_timeout, backoff=args.teacher_backoff)
        self.vocab_size: int | None = None
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._pending: dict[bytes, tuple] = {}  # row key -> (future of its micro-batch's request, index in it)
        self._ahead: set[bytes] = set()  # the rows of the next step, prefetched
        self._waited: set[bytes] = set()  # the rows of the step being trained
        self._lock = threading.Lock()
        self.step: int | None = None  # the optimizer step being trained (for the error message)

    @property
    def name(self) -> str:
        """The served model's name (the card's teacher), else the server's root URL."""
        return self.client.model or self.client.metadata.get("model") or self.client.root

    # ------------------------------------------------------------------ before training

    def check(self, tokenizer: Any, temperature: float, vocab_size: int) -> None:
        """Refuse, before training, a server that does not fit the run (each one line naming the fix): unreachable,
        another vocabulary, a largest k below `teacher_top_k`, another temperature; then one probe request checks
        the answer's form."""
        from ..data.signal_format import vocabulary_hash

        k, where = self.client.k, f"teacher_model={self.url!r}"
        try:
            protocol = self.client.detect()
        except TeacherUnreachable as err:
            raise ValueError(f"{where} is unreachable ({err}): start the server, or fix the URL.") from None
        except TeacherRefused as err:
            raise ValueError(f"{where} refused the info request ({err}): check teacher_api_key_env and "
                             "teacher_protocol.") from None
        except ValueError as err:  # no protocol answered: an API key the server wants is the usual cause
            raise ValueError(f"{where}: {err}") from None
        self.vocab_size = vocab_size
        if tokenizer is None:
            raise ValueError(f"{where}: a served teacher needs the student's tokenizer (processing_class=...) to "
                             "check that the server's vocabulary is the student's.")
        meta = self.client.metadata
        if protocol == "hf_distill":
            if meta.get("vocab_hash") != vocabulary_hash(tokenizer):
                raise ValueError(f"{where} serves {meta.get('model')!r}, whose vocabulary differs from the student's "
                                 "tokenizer (vocabulary hash): its ids would mean other tokens. Serve a teacher that "
                                 "shares the student's tokenizer.")
            if int(meta.get("max_top_k", 0)) < k:
                raise ValueError(f"{where} answers at most k={meta.get('max_top_k')} log-probabilities per position, "
                                 f"teacher_top_k={k} asked: set teacher_top_k <= {meta.get('max_top_k')} or restart "
                                 f"the server with --k {k}.")
            server_t = float(meta.get("temperature", 1.0))
            if float(temperature) != server_t:
                raise ValueError(f"{where} applies temperature {server_t} to its log-probabilities (the server "
                                 f"applies it, the client none), the run's temperature is {temperature}: set "
                                 f"DistillationArguments(temperature={server_t}) or restart the server with "
                                 f"--temperature {temperature}.")
        else:
            if float(temperature) != 1.0:
                raise ValueError(f"{where} ({protocol}) returns the raw model's log-probabilities (temperature 1; "
                                 "the server applies no KD temperature and the client cannot rescale a top-k + tail "
                                 f"exactly), the run's temperature is {temperature}: set temperature=1.0, or serve the "
                                 f"teacher with `hf-distill teacher serve ... --temperature {temperature}`.")
            self._check_tokenizer(tokenizer, where)
        probe = [int(t) for t in tokenizer(PROBE_TEXT, add_special_tokens=False)["input_ids"][:8]]
        if len(probe) < 2:
            probe = [0, 0]
        try:
            self.client.score([probe], vocab_size)
        except TeacherRefused as err:
            raise ValueError(f"{where} refused a request for k={k} log-probabilities per position ({err}): lower "
                             f"teacher_top_k, or let the server return more (vLLM: --max-logprobs {k}).") from None
        except TeacherUnreachable as err:
            raise ValueError(f"{where} is unreachable ({err}): start the server, or fix the URL.") from None
        except MalformedAnswer as err:
            raise ValueError(f"{where}: {err}. Check teacher_protocol (the server's kind).") from None

    def _check_tokenizer(self, tokenizer: Any, where: str) -> None:
        """The server's tokenization of probe texts against the student's: a fixed text, and one decoded from ids
        spread over the student's vocabulary (so that tokenizers agreeing on common words still differ)."""
        size = len(tokenizer)
        spread = list(range(0, size, max(1, size // 64)))[:64]
        for text in (PROBE_TEXT, tokenizer.decode(spread, skip_special_tokens=True)):
            self._compare(tokenizer, text, where)

    def _compare(self, tokenizer: Any, text: str, where: str) -> None:
        try:
            theirs = self.client.tokenize(text)
        except (TeacherRefused, MalformedAnswer) as err:
            raise ValueError(f"{where}: the server's tokenize endpoint did not answer ({err}), so its vocabulary "
                             "cannot be compared with the student's: enable it (vLLM serves POST /tokenize; SGLang "
                             "from versions that have it) or serve the teacher with `hf-distill teacher serve`.") \
                from None
        ours = [int(t) for t in tokenizer(text, add_special_tokens=False)["input_ids"]]
        if theirs != ours:
            raise ValueError(f"{where} tokenizes a probe text into other ids than the student's tokenizer (server "
                             f"{theirs[:6]}..., student {ours[:6]}...): another vocabulary. Serve a teacher that "
                             "shares the student's tokenizer.")

    # ------------------------------------------------------------------ requests

    def _executor(self) -> concurrent.futures.ThreadPoolExecutor:
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(max(1, int(self.args.teacher_requests)),
                                                               thread_name_prefix="served-teacher")
        return self._pool

    def submit(self, batch: dict[str, Any]) -> set[bytes]:
        """Send the rows of one micro-batch that are not asked for yet (one request), without waiting; returns the
        rows' keys."""
        rows = _real_rows(batch)
        keys = [_row_key(r) for r in rows]
        with self._lock:
            todo, seen = [], set()
            for row, key in zip(rows, keys, strict=True):
                if key not in self._pending and key not in seen:
                    todo.append(row)
                    seen.add(key)
            if todo:
                future = self._executor().submit(self.client.score, todo, self.vocab_size)
                for i, row in enumerate(todo):
                    self._pending[_row_key(row)] = (future, i)
        return set(keys)

    def prefetch(self, batches: list[dict[str, Any]]) -> None:
        """Send the next optimizer step's rows now (they are kept until that step is trained)."""
        self._ahead = set().union(*(self.submit(b) for b in batches)) if batches else set()

    def wait(self, batches: list[dict[str, Any]], step: int | None = None) -> None:
        """Every row of this optimizer step's micro-batches asked for and answered: raises (TeacherServerDown, or the
        malformed answer's error) before any of them trains. Answers of rows no longer needed are dropped."""
        self.step = step
        keys = set().union(*(self.submit(b) for b in batches)) if batches else set()
        with self._lock:
            keep = keys | getattr(self, "_ahead", set())
            for key in [k for k in self._pending if k not in keep]:
                del self._pending[key]
        for key in keys:
            self._result(key)
        self._waited = keys

    def _result(self, key: bytes) -> RowScores:
        with self._lock:
            future, index = self._pending[key]
        try:
            return future.result()[index]
        except TeacherUnreachable as err:
            self.cancel()
            raise TeacherServerDown(self._down_message(err)) from None

    def _down_message(self, err: Exception) -> str:
        from transformers.trainer_utils import get_last_checkpoint

        out = self.args.output_dir
        last = get_last_checkpoint(out) if out and os.path.isdir(out) else None
        step = f"before optimizer step {self.step + 1}" if self.step is not None else "before the next step"
        keep = (f"the last intact checkpoint is {last}: restart the server and train again with "
                f"resume_from_checkpoint={last!r}" if last else
                "no checkpoint was saved yet (set save_strategy='steps' to keep one), so nothing was lost but the "
                "training so far")
        return f"Training stopped {step}, which was not trained: {err}; {keep}."

    def cancel(self) -> None:
        """Forget every pending request (training stopped)."""
        with self._lock:
            for future, _ in self._pending.values():
                future.cancel()
            self._pending.clear()

    def close(self) -> None:
        self.cancel()
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

    # ------------------------------------------------------------------ seq_kd: completions from the server

    def check_generation(self, tokenizer: Any) -> None:
        """seq_kd asks the server for completions: refused before training when a one-token probe does not come
        back as token ids (a server that cannot generate, or vLLM before return_token_ids)."""
        probe = [int(t) for t in tokenizer(PROBE_TEXT, add_special_tokens=False)["input_ids"][:4]] or [0]
        try:
            self.client.generate([probe], max_new_tokens=1, temperature=0.0, top_p=1.0, stop_ids=[], seed=0)
        except (TeacherRefused, MalformedAnswer, TeacherUnreachable) as err:
            raise ValueError(f"seq_kd=True asks the teacher server at {self.client.root} to generate completions, "
                             f"which it cannot ({err}): set seq_kd=False, or serve the teacher with vLLM (>= 0.10.2), "
                             "SGLang or `hf-distill teacher serve`.") from None

    def completion_rows(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, on_policy: Any, label_name: str,
                        seed: int) -> tuple[dict[str, torch.Tensor], int]:
        """The training rows of one micro-batch's prompts completed by the server, as hf_distill.on_policy makes
        them from `generate` (its sampling settings, stop and pad ids), and the number of completion tokens."""
        from ..on_policy import completion_rows

        kwargs = on_policy.generation_kwargs()
        prompts = [row[m != 0].tolist() for row, m in zip(prompt_ids.cpu(), prompt_mask.cpu(), strict=True)]
        sampled = bool(kwargs["do_sample"])
        outs = self.client.generate(prompts, max_new_tokens=kwargs["max_new_tokens"],
                                    temperature=float(kwargs.get("temperature", 0.0)) if sampled else 0.0,
                                    top_p=float(kwargs.get("top_p", 1.0)), stop_ids=list(on_policy.stop_ids),
                                    seed=seed)
        made, total = [], 0
        for prompt, out in zip(prompts, outs, strict=True):
            out = out[: kwargs["max_new_tokens"]]
            one = torch.tensor([prompt], dtype=prompt_ids.dtype)
            sequences = torch.tensor([prompt + out], dtype=prompt_ids.dtype)
            rows, n = completion_rows(one, torch.ones_like(one), sequences, on_policy.stop_ids, on_policy.pad_id,
                                      label_name)
            made.append(rows)
            total += n
        width = max(r["input_ids"].shape[1] for r in made)
        fill = {"input_ids": on_policy.pad_id, "attention_mask": 0, label_name: -100}
        batch = {key: torch.cat([torch.nn.functional.pad(r[key], (0, width - r[key].shape[1]), value=value)
                                 for r in made]).to(prompt_ids.device) for key, value in fill.items()}
        return batch, total

    # ------------------------------------------------------------------ the teacher of a batch

    def logits(self, inputs: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The batch's `(log_probs, indices, log_tail)` teacher, (B, T, k), (B, T, k), (B, T), aligned with the
        student's unshifted logits as the offline signal's (hf_distill.data.teacher_signal.signal_teacher): the
        counted positions hold the server's top-k and tail (the k + 1 outcomes renormalised in float64), the rest
        zeros, which the KD mask leaves out."""
        ids = inputs["input_ids"]
        b, t = ids.shape
        mask = inputs.get("attention_mask")
        counted = kd_positions(mask, inputs.get(self.label_name), self.settings.kd_token_mask, causal=True,
                               position_ids=inputs.get("position_ids"))  # packed: never across two sequences
        if counted is None:
            counted = torch.ones(b, t - 1, dtype=torch.bool, device=ids.device)
        keys = self.submit(inputs)
        if len(self._pending) > _MAX_KEPT and not keys & getattr(self, "_waited", set()):  # a loop without wait()
            with self._lock:
                for key in [key for key in self._pending if key not in keys]:
                    del self._pending[key]
        k = self.client.k
        log_probs = np.zeros((b, t, k), dtype=np.float64)
        index = np.zeros((b, t, k), dtype=np.int64)
        log_tail = np.zeros((b, t), dtype=np.float64)
        counted = counted.cpu().numpy()
        for i, sequences in enumerate(_sequences(inputs)):
            where = np.flatnonzero(counted[i])
            if not len(where):
                continue
            if where.min() < sequences[0][0]:  # a padding position's logits predict the first real token
                raise ValueError(f"Row {i} of this batch is left-padded and its labels count its first real token, "
                                 "which only a padding position predicts: a served teacher scores the row's real "
                                 "tokens alone, so it has no distribution there. Pad on the right (tokenizer."
                                 "padding_side='right'), or set the first real token's label to -100.")
            placed = 0
            for first, row in sequences:
                at = where[(where >= first) & (where < first + len(row) - 1)]  # its positions that predict its tokens
                if not len(at):
                    continue
                scores, local = self._result(_row_key(row)), at - first
                outcomes = np.concatenate([scores.log_probs[local], scores.log_tail[local, None]], axis=1)
                outcomes = outcomes - np.logaddexp.reduce(outcomes, axis=1, keepdims=True)
                log_probs[i, at], index[i, at], log_tail[i, at] = outcomes[:, :k], scores.ids[local], outcomes[:, k]
                placed += len(at)
            if placed != len(where):
                raise ValueError(f"Row {i} of this batch counts KD positions outside its real tokens (labels on "
                                 "padding, or real tokens that are not contiguous): a served teacher scores each "
                                 "row's real tokens.")
        dev = ids.device
        return (torch.from_numpy(log_probs).to(dev, torch.float32), torch.from_numpy(index).to(dev),
                torch.from_numpy(log_tail).to(dev, torch.float32))


__all__ = ["ServedTeacher", "TeacherServerDown"]


def served_teachers(places: dict[int, str], args: Any, settings: Any, *, causal: bool, n_teachers: int,
                    tokenizer: Any, vocab_size: int, train_dataset: Any) -> dict[int, ServedTeacher]:
    """The served teachers of a run by their place among all teachers, after refusing (before any model loads or
    trains) what a served teacher cannot give, and checking each server (ServedTeacher.check)."""
    if not places:
        given = [f"{name}={getattr(args, name)!r}" for name, default in SERVED_DEFAULTS.items()
                 if getattr(args, name, default) != default]
        if given:
            raise ValueError(f"{', '.join(given)} do nothing without a teacher behind a URL (teacher_model="
                             "'http://host:port/v1'): remove them.")
        return {}
    if not causal:
        raise ValueError("teacher_model is a URL: a served teacher gives next-token log-probabilities, so the student "
                         "must be a causal LM (AutoModelForCausalLM).")
    if args.kd_weight <= 0:
        raise ValueError("teacher_model is a URL but kd_weight=0: nothing would ask the server. Set kd_weight > 0.")
    if args.kd_loss == "mse":
        raise ValueError("kd_loss='mse' compares whole logits, which a served teacher does not send (its top-k + "
                         "tail): choose a divergence (kd_loss='kl', 'jsd', ...).")
    if args.cross_tokenizer:
        raise ValueError("cross_tokenizer with a served teacher: the server scores the student's token ids, so it "
                         "must share the student's tokenizer. Remove cross_tokenizer.")
    if n_teachers > 1 and (args.multi_teacher or "probs") == "probs":
        raise ValueError("multi_teacher='probs' mixes whole distributions, which a served teacher does not send: set "
                         "multi_teacher='losses' (one KD term per teacher, weighted).")
    if 0 in places and args.distill_terms:
        raise ValueError("distill_terms compare the first teacher's hidden states, which a served teacher does not "
                         "send: put a local teacher first in teacher_model, or remove distill_terms.")
    columns = [c for c in (getattr(train_dataset, "column_names", None) or [])
               if c.startswith("teacher_") and c != ROUTE_COLUMN]  # teacher_id routes rows (hf_distill.routing)
    if columns:
        raise ValueError(f"The train dataset carries cached teacher outputs ({', '.join(columns)}) and teacher_model "
                         "names a server: give one or the other.")
    served = {}
    for place, url in places.items():
        teacher = ServedTeacher(url, args, settings, "labels")
        teacher.check(tokenizer, settings.temperature, vocab_size)
        served[place] = teacher
    if args.seq_kd and 0 in served:
        served[0].check_generation(tokenizer)
    return served


__all__ += ["served_teachers"]
