"""On-policy (GKD) and sequence-level (Kim & Rush) distillation of causal LMs: completions generated each step.

GKD (Agarwal et al. 2024) trains the student on its own samples, where its mistakes are; sequence-level KD (Kim &
Rush 2016) on the teacher's. `OnPolicy` decides, per micro-batch, who completes its prompts: the student with
probability `lmbda`, else the teacher when `seq_kd`, else nobody (the dataset's completion is kept), as TRL's GKD
does. The coin of micro-batch i of optimizer step s is a function of (`seed`, s, i) alone (:func:`coin`), so it
falls the same way on every process (under ZeRO-3 every process must take part in the gathered generation) and a
run resumed from a checkpoint draws what the uninterrupted run drew.

Completions are generated when an optimizer step's micro-batches are fetched (`Distiller.start_step(batches,
model=...)`, which the trainer's `get_batch_samples` calls), with that step's weights, and before the step's
positions are counted: generated tokens enter the normalisation over gradient accumulation and processes
(hf_distill.losses.normalise) like dataset tokens. A generated row is the prompt followed by the completion up to
and including its first stop token, right-padded; its labels are the completion (-100 on the prompt and padding),
so KD over the labelled positions (`kd_token_mask="labels"`) covers exactly the generated tokens.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import torch
from accelerate.utils import DistributedType, extract_model_from_parallel
from torch import nn

from .base.batch_keys import PROMPT_IDS, PROMPT_KEYS, PROMPT_MASK, TEACHER_PREFIX, require_tensors
from .base.generation_checks import GENERATION_FIELDS, validate_generation_arguments  # noqa: F401 - in __all__
from .base.position_limits import check_room, new_tokens, position_limit, teacher_roles
from .compat import zero3_gathered_without_hooks
from .placement import ZERO3_SHARDED, teacher_input_device, teacher_mode
from .teacher import shared_base_teacher


def check_on_policy(args: Any, *, causal: bool, n_teachers: int, accelerator: Any, train_dataset: Any) -> None:
    """Refuse generation where the student, teachers, engine or data cannot honour it (Distiller set-up)."""
    if not args.generates:
        return
    what = f"lmbda={args.lmbda}" if args.lmbda > 0 else "seq_kd=True"
    if not causal:
        raise ValueError(
            f"{what} generates completions, which needs a causal-LM student (AutoModelForCausalLM); this student is "
            "not one. Remove lmbda / seq_kd."
        )
    if n_teachers == 0:
        raise ValueError(
            f"{what} generates new completions each step, so the teacher must run on them: give teacher_model "
            "(cached teacher outputs describe the dataset's completions only)."
        )
    if getattr(accelerator, "distributed_type", None) == DistributedType.FSDP:
        raise ValueError(
            f"{what}: generating completions under FSDP is not supported (generate would run on sharded "
            "parameters). Use DeepSpeed ZeRO-3 (parameters are gathered for generation) or DDP, or set lmbda=0 and "
            "seq_kd=False."
        )
    if args.given("kd_token_mask") and args.kd_token_mask != "labels":
        raise ValueError(
            f"kd_token_mask={args.kd_token_mask!r} with {what} would distil the prompt tokens too: KD covers the "
            "generated completion, which the labels mark. Leave kd_token_mask unset (or 'labels')."
        )
    columns = getattr(train_dataset, "column_names", None) or []
    cached = [c for c in columns if c.startswith(TEACHER_PREFIX)]
    if cached:
        raise ValueError(
            f"The train dataset carries cached teacher outputs ({', '.join(cached)}), but {what} replaces the "
            "completions they were computed on. Drop those columns and let the teacher run."
        )


def check_step(on_policy: OnPolicy | None, args: Any, model: nn.Module | None) -> None:
    """Refuse a step that would quietly keep the dataset's completions although `lmbda` / `seq_kd` ask for generated
    ones (Distiller.start_step): no student to generate with, or generation switched on after set-up (a callback)."""
    if on_policy is None:
        what = f"lmbda={args.lmbda}" if args.lmbda > 0 else "seq_kd=True"
        raise ValueError(
            f"DistillationArguments.{what} was set after the trainer (Distiller) was built, with lmbda=0 and "
            "seq_kd=False (by a callback?): generation is checked and set up when it is built. Build it with lmbda > 0 "
            "or seq_kd=True; a callback may then change lmbda within [0, 1]."
        )
    if model is None:
        raise ValueError(
            "lmbda / seq_kd generate each micro-batch's completions with the student: call "
            "distiller.start_step(batches, model=student), or the dataset's completions would be trained on."
        )


class OnPolicy:
    """Who completes each micro-batch's prompts, the generation itself, and what it produced since the last log.

    Args:
        args: the run's DistillationArguments (read at every step, so a callback may change `lmbda`).
        student: the student as built (its generation_config's eos/pad ids are the fallbacks).
        tokenizer: the student's tokenizer (its eos/pad ids come first), or None.
    """

    def __init__(self, args: Any, student: nn.Module, tokenizer: Any = None) -> None:
        self.args = args
        gen_config = getattr(student, "generation_config", None)
        config = getattr(student, "config", None)
        stops = args.stop_token_ids
        if stops is None:  # the tokenizer's eos, then every id the student's own generate stops at (its
            # generation_config, set aside while it generates, may list several: an end of turn and an end of text)
            stops = [i for eos in (getattr(tokenizer, "eos_token_id", None), getattr(gen_config, "eos_token_id", None))
                     for i in ([] if eos is None else [eos] if isinstance(eos, int) else eos)]
        self.stop_ids = list(dict.fromkeys(int(i) for i in stops))
        pads = (getattr(tokenizer, "pad_token_id", None), getattr(gen_config, "pad_token_id", None),
                getattr(config, "pad_token_id", None))
        self.pad_id = next((int(p) for p in pads if p is not None), None)
        if self.pad_id is None:
            raise ValueError(
                "Generating completions (lmbda / seq_kd) needs a padding id for the rows of unequal length, but "
                "neither the tokenizer (processing_class) nor the student's config has one. Set "
                "tokenizer.pad_token (e.g. to its eos_token) and pass it as processing_class."
            )
        # no prompt is shorter than one token: a max_new_tokens the student cannot hold is refused now
        check_room(new_tokens(args), 1, position_limit([("student", student)]), "DistillationArguments.max_new_tokens")
        self._limit: tuple[int, str] | None = None  # the fewest positions of the student and teachers (`prepare`)
        self._limit_read = False
        self._seed, self._steps = int(args.seed), 0
        self.tokens = 0
        self.seconds = 0.0

    def source(self, step: int, micro: int) -> str | None:
        """Who completes micro-batch `micro` of optimizer step `step`: "student" (probability lmbda), else "teacher"
        with seq_kd, else None (the dataset's completion)."""
        lmbda = float(self.args.lmbda)
        if lmbda >= 1 or (lmbda > 0 and coin(self._seed, step, micro) < lmbda):
            return "student"
        return "teacher" if self.args.seq_kd else None

    def generation_kwargs(self) -> dict[str, Any]:
        """`generate`'s settings: max_new_tokens, sampling (or greedy at temperature 0), stop and pad ids."""
        args = self.args
        temperature = 1.0 if args.generation_temperature is None else float(args.generation_temperature)
        kwargs: dict[str, Any] = {
            "max_new_tokens": new_tokens(args),
            "do_sample": temperature > 0,
            "pad_token_id": self.pad_id,
            "eos_token_id": self.stop_ids or None,
            "use_cache": True,
        }
        if temperature > 0:  # top_k 0: no top-k cut, the distribution is the model's (top_p aside)
            kwargs.update(temperature=temperature, top_p=1.0 if args.top_p is None else float(args.top_p), top_k=0)
        return kwargs

    def prepare(self, batches: list[dict[str, Any]], student: nn.Module, step: int | None = None, *,
                teachers: list[nn.Module], shared_base: bool, accelerator: Any, label_name: str,
                served: Any = None) -> None:
        """Complete, in place, the prompts of the micro-batches the coin gives to the student or the teacher.
        `step`: the optimizer step these batches make (the Trainer's `global_step`, restored on resume); None counts
        the calls (a plain loop). `teachers` (the first completes for seq_kd; all bound the positions), `shared_base`
        (the first is the student's PEFT base, adapters off), `accelerator` and `label_name` (the labels key of the
        rows made) are the Distiller's. `served`: a first teacher behind a URL (hf_distill.serving.source), which
        generates the seq_kd completions on its server."""
        step = self._steps if step is None else int(step)
        self._steps = step + 1
        for micro, batch in enumerate(batches):
            who = self.source(step, micro)
            if who is None:
                continue
            _check_batch(batch)
            if not self._limit_read:  # before the first generation: every model that generates or reads the rows
                self._limit, self._limit_read = position_limit(
                    [("student", student), *teacher_roles(teachers)]), True
            check_room(new_tokens(self.args), int(batch[PROMPT_IDS].shape[1]), self._limit,
                       f"Step {step}, micro-batch {micro}")
            if who == "teacher" and served is not None:  # generated by the teacher's server
                start = time.perf_counter()
                rows, generated = served.completion_rows(batch[PROMPT_IDS], batch[PROMPT_MASK], self, label_name,
                                                         seed=int(coin(self._seed, step, micro) * 2**31))
                self.seconds += time.perf_counter() - start
                batch.update(rows)
                self.tokens += generated
                continue
            model = student if who == "student" else (teachers[0] if teachers else None)
            shared = who == "teacher" and shared_base
            seed = sampling_seed(self._seed, step, micro, int(getattr(accelerator, "process_index", 0) or 0))
            sequences = self._generate(model, batch, accelerator, shared, seed)
            rows, generated = completion_rows(batch[PROMPT_IDS], batch[PROMPT_MASK], sequences, self.stop_ids,
                                              self.pad_id, label_name)
            batch.update(rows)
            self.tokens += generated

    def _generate(self, model: nn.Module, batch: dict[str, Any], accelerator: Any, shared: bool,
                  seed: int) -> torch.Tensor:
        ids, mask = batch[PROMPT_IDS], batch[PROMPT_MASK]
        autocast = accelerator.autocast() if accelerator is not None else contextlib.nullcontext()
        with generation_module(model, accelerator, shared) as (module, extra), torch.no_grad(), autocast, \
                default_generation_config(module):
            device = teacher_input_device(module)
            with seeded_sampling(seed, module):
                start = time.perf_counter()
                out = module.generate(input_ids=ids if device is None else ids.to(device),
                                      attention_mask=mask if device is None else mask.to(device),
                                      **self.generation_kwargs(), **extra)
                self.seconds += time.perf_counter() - start
        return out.to(ids.device)

    def log_values(self, accelerator: Any = None) -> dict[str, float]:
        """Generated tokens since the last call (over every process), 0 in a window where nothing was generated (the
        coin kept the dataset's completions), so that a missing value never reads as "not measured"; their rate
        only where there was generation time to divide by. Every process reduces (a collective), generating or
        not."""
        values = torch.tensor([float(self.tokens), self.seconds], dtype=torch.float64)
        processes = accelerator.num_processes if accelerator is not None else 1
        if processes > 1:
            values = accelerator.reduce(values.to(accelerator.device), "sum").cpu()
        tokens, seconds = values.tolist()
        self.tokens, self.seconds = 0, 0.0
        if seconds <= 0:
            return {"generated_tokens": tokens}
        return {"generated_tokens": tokens, "generated_tokens_per_second": tokens / (seconds / processes)}


def _mix(seed: int, step: int, micro: int) -> int:
    return ((int(seed) * 1_000_003 + int(step)) * 1_009 + int(micro)) % (2**63 - 1)


def coin(seed: int, step: int, micro: int) -> float:
    """A uniform draw in [0, 1) for micro-batch `micro` of optimizer step `step`, from a generator seeded with the
    three: no state to carry across processes or checkpoints."""
    return float(torch.rand((), generator=torch.Generator().manual_seed(_mix(seed, step, micro))))


def sampling_seed(seed: int, step: int, micro: int, process: int = 0) -> int:
    """The seed micro-batch `micro` of optimizer step `step` samples its completions with on process `process`: a
    function of the four, so a resumed run samples what the uninterrupted run sampled (the Trainer restores the
    global RNG only after it has fetched, and so generated, the first resumed step) and processes sample
    independently. Not the coin's stream (a salt), so the coin and the first sampled token are not correlated."""
    return (_mix(seed, step, micro) * 7_919 + 104_729 * (int(process) + 1)) % (2**63 - 1)


@contextlib.contextmanager
def seeded_sampling(seed: int, module: nn.Module) -> Iterator[None]:
    """Sample with the CPU generator and those of the accelerators `module`'s parameters are on (a model split over
    devices samples on its last) seeded with `seed`, then give them back their state: generation neither depends on
    nor moves the global RNG that dropout and the data order read."""
    devices = {p.device for p in module.parameters() if p.device.type not in ("cpu", "meta")}
    kind = next(iter(devices)).type if devices else None
    indices = sorted({d.index if d.index is not None else 0 for d in devices if d.type == kind})
    with torch.random.fork_rng(devices=indices, device_type=kind):
        torch.random.default_generator.manual_seed(seed)
        if kind is not None:  # these devices' generators alone (manual_seed_all would move every other device's)
            backend = torch.get_device_module(kind)
            generators = getattr(backend, "default_generators", None)
            for index in indices:
                (generators[index] if generators else backend).manual_seed(seed)  # no list: one device (mps)
        yield


@contextlib.contextmanager
def generation_module(model: nn.Module, accelerator: Any = None, shared_base: bool = False) -> Iterator[tuple]:
    """The model to call `generate` on, and extra generate arguments: outside DDP / DeepSpeed / torch.compile
    wrappers but still a PeftModel (its adapters generate; with `shared_base`, the teacher: adapters off), in
    eval mode, its parameters gathered under ZeRO-3 with its engine's hooks set aside (`zero3_gathered_without_hooks`;
    `synced_gpus` so that processes finishing early keep stepping). Every module's train/eval mode is restored on
    exit."""
    module = extract_model_from_parallel(model, keep_torch_compile=False)
    modes = [(m, m.training) for m in module.modules()]
    zero3 = accelerator is not None and teacher_mode(accelerator) == ZERO3_SHARDED
    extra = {"synced_gpus": True} if zero3 and accelerator.num_processes > 1 else {}
    try:
        with contextlib.ExitStack() as stack:
            if zero3:
                stack.enter_context(zero3_gathered_without_hooks(zero3_engine(model, module, accelerator)))
            if shared_base:
                module = stack.enter_context(shared_base_teacher(module))
            module.eval()
            yield module, extra
    finally:
        for m, mode in modes:
            m.training = mode


def zero3_engine(model: nn.Module, module: nn.Module, accelerator: Any) -> Any:
    """The DeepSpeed engine that runs `module` under ZeRO-3: `model` itself (the teacher's inference engine, or a
    student passed wrapped), else the engine accelerate prepared for the student (the Trainer passes `self.model`)."""
    from deepspeed import DeepSpeedEngine

    if isinstance(model, DeepSpeedEngine):
        return model
    wrapped = getattr(accelerator, "deepspeed_engine_wrapped", None)
    if wrapped is not None and wrapped.engine.module is module:
        return wrapped.engine
    raise ValueError(
        "Generating completions (lmbda / seq_kd) under DeepSpeed ZeRO-3 needs the model's DeepSpeed engine (its "
        "parameter hooks are set aside while it generates), but this model is neither an engine nor the one the "
        "accelerator prepared. Pass the engine (e.g. trainer.model_wrapped) as `model` to Distiller.start_step."
    )


@contextlib.contextmanager
def default_generation_config(module: nn.Module) -> Iterator[None]:
    """`generate` fills every setting it is not given from the model's `generation_config` (a checkpoint's
    repetition_penalty, no_repeat_ngram_size, min_new_tokens, suppress_tokens, num_beams, ...), which would change
    what is generated: for the duration, every model inside `module` holds transformers' defaults instead, so the
    completions follow the model's own distribution and `OnPolicy.generation_kwargs` alone. Restored on exit."""
    from transformers import GenerationConfig

    own = [(m, m.generation_config) for m in module.modules()
           if isinstance(vars(m).get("generation_config"), GenerationConfig)]
    try:
        for m, _ in own:
            m.generation_config = GenerationConfig()
        yield
    finally:
        for m, config in own:
            m.generation_config = config


def completion_rows(
    prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, sequences: torch.Tensor, stop_ids: list[int], pad_id: int,
    label_name: str = "labels",
) -> tuple[dict[str, torch.Tensor], int]:
    """The training rows of generated `sequences` (left-padded prompts of width `prompt_ids.shape[1]`, then the
    completions): each prompt's real tokens, then its completion up to and including the first stop id,
    right-padded with `pad_id`; labels are the completion (-100 elsewhere). Returns the rows and the number of
    completion tokens kept."""
    completions = sequences[:, prompt_ids.shape[1]:]
    b, n = completions.shape
    stops = torch.isin(completions, torch.tensor(stop_ids, dtype=completions.dtype, device=completions.device))
    ends = torch.where(stops.any(1), stops.int().argmax(1) + 1, torch.full((b,), n, device=completions.device))
    prompts = [prompt_ids[i][prompt_mask[i] != 0] for i in range(b)]
    kept = [completions[i, : int(ends[i])] for i in range(b)]
    length = max(len(p) + len(c) for p, c in zip(prompts, kept, strict=True))
    ids = torch.full((b, length), pad_id, dtype=prompt_ids.dtype, device=prompt_ids.device)
    mask = torch.zeros((b, length), dtype=prompt_mask.dtype, device=prompt_ids.device)
    labels = torch.full((b, length), -100, dtype=prompt_ids.dtype, device=prompt_ids.device)
    for i, (p, c) in enumerate(zip(prompts, kept, strict=True)):
        ids[i, : len(p)], ids[i, len(p): len(p) + len(c)] = p, c
        mask[i, : len(p) + len(c)] = 1
        labels[i, len(p): len(p) + len(c)] = c
    return {"input_ids": ids, "attention_mask": mask, label_name: labels}, int(ends.sum())


def _check_batch(batch: dict[str, Any]) -> None:
    require_tensors(batch, PROMPT_KEYS, "Generating completions (lmbda / seq_kd) needs the prompts",
                    "Collate prompt + completion or messages rows with "
                    "hf_distill.data.prompts.PromptCompletionCollator.")
    if bool((batch[PROMPT_MASK][:, -1] == 0).any()):
        raise ValueError(f"{PROMPT_IDS} must be left-padded (generation continues each row from its last column).")
    cached = [k for k in batch if k.startswith(TEACHER_PREFIX)]
    others = [k for k, v in batch.items() if k not in (*PROMPT_KEYS, "input_ids", "attention_mask", "labels")
              and isinstance(v, torch.Tensor) and v.dim() >= 2]
    if cached or others:
        raise ValueError(
            f"The batch has {', '.join(cached + others)}, which describe the dataset's completion, not a generated "
            "one. Drop them from the rows (generation replaces input_ids, attention_mask and labels)."
        )


__all__ = ["PROMPT_KEYS", "OnPolicy", "check_on_policy", "check_step", "completion_rows", "default_generation_config",
           "generation_module", "new_tokens", "teacher_roles", "validate_generation_arguments"]
