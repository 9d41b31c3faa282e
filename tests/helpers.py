"""Tiny real models and datasets shared by the trainer tests."""

from __future__ import annotations

import contextlib
import io
import os
import runpy
import sys
import traceback
from subprocess import CompletedProcess
from typing import Any

import torch
from datasets import Dataset
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    DistilBertConfig,
    DistilBertForSequenceClassification,
    LlamaConfig,
    LlamaForCausalLM,
    MobileBertConfig,
    MobileBertForSequenceClassification,
)

from hf_distill import DistillationArguments

VOCAB = 120


def bert_config(layers=4, hidden=32, heads=4, labels=2, **kw) -> BertConfig:
    base = dict(
        vocab_size=VOCAB,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        intermediate_size=2 * hidden,
        max_position_embeddings=64,
        num_labels=labels,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    base.update(kw)
    return BertConfig(**base)


def bert(layers=4, hidden=32, heads=4, labels=2, seed=0, **kw) -> BertForSequenceClassification:
    torch.manual_seed(seed)
    return BertForSequenceClassification(bert_config(layers, hidden, heads, labels, **kw))


def teacher(layers=4, hidden=32, heads=4, labels=2, seed=1, **kw) -> BertForSequenceClassification:
    """A random BERT whose logits are far from uniform, so the KD term carries real gradient."""
    model = bert(layers, hidden, heads, labels, seed, **kw)
    with torch.no_grad():
        model.classifier.weight.mul_(40.0)
    return model


def distilbert(layers=2, dim=32, heads=4, labels=2, seed=0, **kw) -> DistilBertForSequenceClassification:
    torch.manual_seed(seed)
    cfg = DistilBertConfig(
        vocab_size=VOCAB,
        dim=dim,
        n_layers=layers,
        n_heads=heads,
        hidden_dim=2 * dim,
        max_position_embeddings=64,
        num_labels=labels,
        dropout=0.0,
        attention_dropout=0.0,
        seq_classif_dropout=0.0,
        **kw,
    )
    return DistilBertForSequenceClassification(cfg)


def mobilebert(layers=2, hidden=32, heads=4, labels=2, seed=0, bottleneck=16,
               **kw) -> MobileBertForSequenceClassification:
    """MobileBERT: blocks at width `hidden`, attention at the bottleneck width (`true_hidden_size`)."""
    torch.manual_seed(seed)
    cfg = MobileBertConfig(
        vocab_size=VOCAB,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        intermediate_size=hidden,
        intra_bottleneck_size=bottleneck,
        embedding_size=16,
        num_feedforward_networks=2,
        max_position_embeddings=64,
        num_labels=labels,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        **kw,
    )
    return MobileBertForSequenceClassification(cfg)


def token_dataset(n=32, seed=0, min_len=3, max_len=12, labels=2) -> Dataset:
    """Variable-length rows of random ids (so batches really are padded), with labels."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len + 1, (n,), generator=g)
    rows = []
    for i, n_tok in enumerate(lengths.tolist()):
        ids = [101] + torch.randint(5, VOCAB, (n_tok - 1,), generator=g).tolist()
        rows.append({"input_ids": ids, "label": i % labels})
    return Dataset.from_list(rows)


def collate(features: list[dict]) -> dict:
    """Right-padding collator for the random-id rows (no tokenizer needed)."""
    length = max(len(f["input_ids"]) for f in features)
    ids = torch.zeros(len(features), length, dtype=torch.long)
    mask = torch.zeros(len(features), length, dtype=torch.long)
    for i, f in enumerate(features):
        ids[i, : len(f["input_ids"])] = torch.tensor(f["input_ids"])
        mask[i, : len(f["input_ids"])] = 1
    batch = {"input_ids": ids, "attention_mask": mask}
    if "label" in features[0]:
        batch["labels"] = torch.tensor([f["label"] for f in features])
    return batch


def qa_collate(features: list[dict]) -> dict:
    """`collate` for extractive-QA rows: input ids padded, start and end positions stacked."""
    batch = collate([{"input_ids": f["input_ids"]} for f in features])
    for key in ("start_positions", "end_positions"):
        batch[key] = torch.tensor([f[key] for f in features])
    return batch


def llama(seed=0, layers=2, vocab=VOCAB, **kw) -> LlamaForCausalLM:
    """A tiny Llama (grouped-query attention: 4 heads, 2 key/value heads)."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, **kw)
    return LlamaForCausalLM(cfg)


def padded_llama(seed=1, real=VOCAB, extra=16, **kw) -> LlamaForCausalLM:
    """A tiny Llama of `real + extra` ids whose last `extra` are padding rows, as in a family padded to a round size:
    every hidden state has a large constant first coordinate (from the embeddings) and the padding rows of the LM
    head point against it, so they get ~1e-11 of the probability, as a trained model's never-seen rows do."""
    model = llama(seed, vocab=real + extra, **kw)
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = 4.0
        model.lm_head.weight[real:] = 0.0
        model.lm_head.weight[real:, 0] = -4.0
    return model


def word_tokenizer(words: list[str]):
    """A real fast tokenizer whose ids are `<unk>`, `<pad>`, then `words` in order (two lists of the same length
    give two tokenizers of the same size whose ids mean different tokens)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["<unk>", "<pad>", *words])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>")


def sft_rows(n=8, seed=3) -> Dataset:
    """Prompt + completion rows whose prompt is masked with -100 in `labels`: only the completion is learnt."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        prompt, completion = int(torch.randint(2, 6, (1,), generator=g)), int(torch.randint(2, 7, (1,), generator=g))
        ids = torch.randint(5, VOCAB, (prompt + completion,), generator=g).tolist()
        rows.append({"input_ids": ids, "labels": [-100] * prompt + ids[prompt:]})
    return Dataset.from_list(rows)


def labelled_collate(features: list[dict]) -> dict:
    """Right padding of rows with token-level `labels` (padded with -100)."""
    batch = collate([{"input_ids": f["input_ids"]} for f in features])
    labels = torch.full_like(batch["input_ids"], -100)
    for i, f in enumerate(features):
        labels[i, : len(f["labels"])] = torch.tensor(f["labels"])
    batch["labels"] = labels
    return batch


def args(tmp_path, **kw) -> DistillationArguments:
    base = dict(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=8,
        max_steps=3,
        learning_rate=1e-3,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        seed=0,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    base.update(kw)
    return DistillationArguments(**base)


def flat_params(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).float() for p in model.parameters()])


def leave_distributed_run() -> None:
    """End a torchrun/accelerate test script whose result is written: every rank passes a barrier, then skips the
    interpreter's teardown, where a gloo rank or DeepSpeed's CPU comm threads aborted under load ("terminate
    called without an active exception") after a correct run."""
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_script(script: str | os.PathLike, *argv: Any, cwd: str | os.PathLike | None = None) -> CompletedProcess:
    """`python script argv` run in this process, as the interpreter runs a script (its `__main__` through runpy, its
    folder first on sys.path, sys.argv set; `hf-distill run` runs recipes the same way): for tests where a
    subprocess would add nothing but seconds of imports. Returns the exit code (SystemExit's, 1 for an uncaught
    exception, whose traceback goes to stderr) and what the script printed to sys.stdout and sys.stderr."""
    script, argv = str(script), [str(a) for a in argv]
    out, err, code = io.StringIO(), io.StringIO(), 0
    saved_argv, saved_path, saved_cwd = sys.argv[:], sys.path[:], os.getcwd()
    sys.argv = [script, *argv]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    try:
        if cwd is not None:
            os.chdir(cwd)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                runpy.run_path(script, run_name="__main__")
            except SystemExit as done:
                code = done.code if isinstance(done.code, int) else int(done.code is not None)
                if done.code is not None and not isinstance(done.code, int):
                    print(done.code, file=sys.stderr)
            except Exception:
                traceback.print_exc()
                code = 1
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path
        os.chdir(saved_cwd)
    return CompletedProcess([sys.executable, script, *argv], code, out.getvalue(), err.getvalue())



class OpTrace(torch.overrides.TorchFunctionMode):
    """Records every torch function called inside it (`torch.zeros`, `Tensor.mul_`, `Tensor.__setitem__`, ...) as
    `(name, (shape, dtype) of its tensor arguments, of its outputs)`: counts what a loss head moves (a zero-fill, a
    copy, an in-place scale of a `(V, H)` tensor, a boolean gather) without timing anything."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, list, list]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))  # (a backward's ops are not seen: trace its Python function itself)
        flat = [*args, *(kwargs or {}).values()]
        outs = out if isinstance(out, tuple | list) else (out,)
        self.ops.append((getattr(func, "__name__", str(func)),
                         [(tuple(t.shape), t.dtype) for t in flat if isinstance(t, torch.Tensor)],
                         [(tuple(t.shape), t.dtype) for t in outs if isinstance(t, torch.Tensor)]))
        return out

    def count(self, name: str, shape: tuple | None = None, dtype: torch.dtype | None = None,
              where: str = "any") -> int:
        """How many calls of `name` had a tensor (among the arguments: "args", the outputs: "outs", or either) of
        `shape` (None: any) and `dtype` (None: any)."""
        def hit(ts):
            return any((shape is None or s == shape) and (dtype is None or d == dtype) for s, d in ts)

        return sum(1 for op, a, o in self.ops if op == name
                   and ((where != "outs" and hit(a)) or (where != "args" and hit(o))))


def loss_components(trainer, batch: dict, train: bool) -> dict[str, float]:
    """The KD and task terms of one batch (no step scaling: outside the training loop). In training the tracker
    holds them; in evaluation (with the teacher) the loss is taken once with each weight alone."""
    trainer.model.train(train)
    trainer.distiller.tracker.reset()
    if train:
        with torch.no_grad():
            trainer.compute_loss(trainer.model, dict(batch))
        return trainer.distiller.tracker.pop_means()
    settings, out = trainer.settings, {}
    weights = (settings.kd_weight, settings.task_weight)
    for name, kd_weight, task_weight in (("kd", 1.0, 0.0), ("task", 0.0, 1.0)):
        settings.set("kd_weight", kd_weight), settings.set("task_weight", task_weight)
        with torch.no_grad():
            out[name] = float(trainer.compute_loss(trainer.model, dict(batch)))
    settings.set("kd_weight", weights[0]), settings.set("task_weight", weights[1])
    return out
