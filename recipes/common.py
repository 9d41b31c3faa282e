"""What the three recipes share: argument parsing with `--config file.yaml`, data loading, metrics, results.

Kept deliberately plain (no registry, no framework): each recipe reads top to bottom and calls these
helpers for the parts that are not about distillation. Data are local files (chosen by extension) or a
Hub dataset name; metrics are computed here because `evaluate.load("accuracy")` needs the Hub.

Recipes import everything from here; the code lives by concern (underscored, so `hf-distill run` does not list
them as recipes): `_common_args.py` (argument dataclasses, YAML parsing, one-line errors, `run_main`),
`_common_data.py` (task data, labels, tokenising, the corpus), `_common_eval.py` (metrics, evaluation, results);
building and loading models stays in this file.
"""

from __future__ import annotations

from pathlib import Path

from _common_args import (  # noqa: F401 - the recipes import these from here
    MODEL_PATH_FIELDS,
    SETUP_ERRORS,
    STUDENT_FIELDS,
    ConfigError,
    DataArguments,
    ModelArguments,
    _one_line,
    check_model_path,
    command_line,
    fail,
    load_config,
    order_seed,
    parse_args,
    raised_while_running,
    refuse_unused,
    run_main,
    set_offline_defaults,
)
from _common_data import TaskLabels, load_corpus, load_task, task_labels, tokenize_task  # noqa: F401
from _common_eval import (  # noqa: F401
    bf16_available,
    cache_task_logits,
    compute_metrics,
    evaluate_model,
    run_length,
    train_and_report,
    write_results,
)

REPO_ROOT = Path(__file__).resolve().parent.parent


# ------------------------------------------------------------------------------------------------ models


def build_student(margs: ModelArguments, teacher, auto_class, seed: int, **load_kwargs):
    """The student, from (in this order of precedence): `student` + `student_layers` (copy those layers of
    that model), `student` alone (load it), `student_layers` (copy the teacher's layers, DistilBERT),
    `student_num_layers`... (random smaller copy of the teacher's family, TinyBERT)."""
    import torch

    from hf_distill import students

    if margs.model_seed is not None:
        seed = margs.model_seed
        torch.manual_seed(seed)  # a new classifier head of a copied or loaded student draws from here
    if margs.student and margs.student_layers:
        source = auto_class.from_pretrained(margs.student, **load_kwargs)
        return students.from_teacher(source, margs.student_layers)
    if margs.student:
        return auto_class.from_pretrained(margs.student, **load_kwargs)
    if margs.student_layers:
        return students.from_teacher(teacher, margs.student_layers)
    sizes = (margs.student_num_layers, margs.student_hidden_size, margs.student_num_heads,
             margs.student_intermediate_size)
    if any(s is None for s in sizes):
        fail("the student is undefined: set student (a folder), student_layers (copy teacher layers) or all of "
             "student_num_layers, student_hidden_size, student_num_heads, student_intermediate_size")
    return students.shrink(teacher, *sizes, seed=seed)


def load_model(auto_class, path: str, what: str, **kwargs):
    """`from_pretrained` with a one-line error for a missing folder (the usual mistake in a config)."""
    try:
        return auto_class.from_pretrained(path, **kwargs)
    except OSError as err:
        fail(f"cannot load the {what} from {path!r}{_as_hub_id(path)}: {_one_line(err)}")


def load_tokenizer(path: str, what: str, **kwargs):
    """`AutoTokenizer.from_pretrained` with a one-line error naming whose tokenizer could not be read. A local
    folder without tokenizer files is refused first: transformers 5 would return an empty tokenizer, no error."""
    from transformers import AutoTokenizer

    from hf_distill.base.tokenizer_files import check_tokenizer_folder

    try:  # a folder without tokenizer files would give transformers 5's empty tokenizer (every word unknown)
        check_tokenizer_folder(path, f"the {what}", f"Save the {what}'s tokenizer in that folder "
                               "(tokenizer.save_pretrained(folder)).")
        return AutoTokenizer.from_pretrained(path, **kwargs)
    except (OSError, ValueError) as err:
        fail(f"cannot load the tokenizer of the {what} from {path!r}{_as_hub_id(path)}: {_one_line(err)}")


def _as_hub_id(path: str) -> str:
    return "" if Path(path).expanduser().is_dir() else " (not a local folder, so read as a Hub id)"


def fit_mlm_head(mlm, missing: list[str], corpus, tokenizer, steps: int, seed: int, bf16: bool,
                 batch_size: int = 32, lr: float = 1e-3) -> float:
    """Train the parameters `from_pretrained` reported missing (an MLM head on an encoder shipped without one)
    on masked corpus blocks, everything else frozen; returns the final masked-token accuracy.

    Why: TinyBERT's augmentation asks a masked LM for word candidates; a random head gives random words.
    Fitting only the head (a probe of the frozen encoder) is cheap and keeps the encoder the teacher's."""
    import torch

    from hf_distill.data.collators import MLMDistillationCollator

    names = set(missing)
    trainable = [p for n, p in mlm.named_parameters() if n in names]
    for n, p in mlm.named_parameters():
        p.requires_grad_(n in names)
    if not trainable:
        return float("nan")
    head = getattr(mlm, "cls", None) or getattr(mlm, "lm_head", None)
    if head is None:
        fail(f"cannot find the MLM head of {type(mlm).__name__} (expected .cls or .lm_head)")
    collate = MLMDistillationCollator(tokenizer, mlm_probability=0.15, seed=seed)
    opt = torch.optim.AdamW(trainable, lr=lr)
    g = torch.Generator().manual_seed(seed)
    mlm.train()
    acc = float("nan")
    for step in range(steps):
        rows = torch.randint(len(corpus), (batch_size,), generator=g).tolist()
        batch = collate([corpus[i] for i in rows])
        with torch.autocast("cpu", torch.bfloat16, enabled=bf16):
            with torch.no_grad():
                hidden = mlm.base_model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])[0]
            targets = batch["labels"] != -100
            logits = head(hidden[targets]).float()
        loss = torch.nn.functional.cross_entropy(logits, batch["labels"][targets])
        loss.backward()
        opt.step()
        opt.zero_grad()
        if step % 50 == 0 or step == steps - 1:
            acc = (logits.argmax(-1) == batch["labels"][targets]).float().mean().item()
            print(f"MLM head step {step}: loss {loss.item():.3f}, masked-token accuracy {acc:.1%}", flush=True)
    mlm.eval()
    for p in mlm.parameters():
        p.requires_grad_(False)
    return acc
