"""Intermediate-layer distillation terms: what to compare, with which loss, between which layers.

A term is declared as a mapping (YAML/JSON) or as `key=value,key=value` text (command line) and parsed
into a `DistillTerm`. Layer numbers follow `hidden_states` of transformers: 0 is the embedding output
and `i` the output of transformer block `i` (1-based); attention scores and Q/K/V of block `i` use the
same `i`. So TinyBERT's uniform map "student layer m <- teacher layer m*k" reads the same for every
feature.

Encoder-decoder models (T5, BART, Marian, ...) have two stacks, each numbered that way: a term names one with
`stack=encoder` or `stack=decoder` (required for them, refused for other models), and its layer map, features
and masks are that stack's (the decoder's real tokens are its label positions). Its default name is prefixed by
the stack (`encoder_hidden`, `decoder_attention`), so the same loss on both stacks logs under two names.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from ..features.families import STACKS

# Which captured feature each loss compares. The loss decides the feature, so a term names its loss only.
LOSS_FEATURE = {
    "hidden_mse": "hidden",
    "cosine_loss": "hidden",
    "attention_score_mse": "attention",
    "relation_kl": "qkv",
    "pkd_loss": "cls",
    "incremental_mse": "hidden",
}
RELATIONS = ("qq", "kk", "vv", "qk")
_DEFAULT_NAMES = {
    "hidden_mse": "hidden",
    "cosine_loss": "cosine",
    "attention_score_mse": "attention",
    "relation_kl": "relation",
    "pkd_loss": "pkd",
    "incremental_mse": "incremental",
}
_KEYS = ("loss", "layers", "weight", "name", "relations", "relation_heads", "stack")


@dataclass
class DistillTerm:
    """One intermediate-layer term of the total loss.

    `layers` is `"uniform"`, `"last"` or a list of `(student_layer, teacher_layer)` pairs.
    `incremental_mse` needs two pairs at least (so not `"last"`), each teacher layer once.
    `relations` and `relation_heads` are for `relation_kl` only: `qk` is MiniLM's attention relation,
    `vv` its value relation, `qq`/`kk`/`vv` MiniLMv2's; `relation_heads=None` uses each model's own heads.
    `stack` (`encoder` or `decoder`) is for encoder-decoder models only, where it is required.
    """

    loss: str
    layers: str | list[tuple[int, int]] = "uniform"
    weight: float = 1.0
    name: str | None = None
    relations: list[str] = field(default_factory=list)
    relation_heads: int | None = None
    stack: str | None = None

    def __post_init__(self) -> None:
        if self.loss not in LOSS_FEATURE:
            raise ValueError(
                f"distill_terms: unknown loss {self.loss!r}. Known: {', '.join(LOSS_FEATURE)}."
            )
        if isinstance(self.layers, str):
            if self.layers not in ("uniform", "last"):
                self.layers = _parse_pairs(self.layers)
        else:
            self.layers = [_pair(p) for p in self.layers]
        if self.loss == "incremental_mse":
            if self.layers == "last":
                raise ValueError(
                    "distill_terms: incremental_mse cannot use layers=last: its targets are differences between "
                    "consecutive mapped teacher layers, so it needs at least two layer pairs. Use `uniform` or "
                    "student:teacher pairs such as `0:0;1:2;2:4`."
                )
            if not isinstance(self.layers, str):
                check_incremental_pairs(self.layers)
        self.weight = float(self.weight)
        if self.weight < 0:
            raise ValueError(f"distill_terms: weight of the {self.loss} term must be >= 0, got {self.weight}.")
        if self.loss == "relation_kl":
            if isinstance(self.relations, str):
                self.relations = [r for r in self.relations.replace(";", " ").split() if r]
            self.relations = [r.lower() for r in self.relations] or ["qk", "vv"]
            bad = [r for r in self.relations if r not in RELATIONS]
            if bad:
                raise ValueError(
                    f"distill_terms: unknown relation(s) {bad} for relation_kl. Known: {', '.join(RELATIONS)}."
                )
            if self.relation_heads is not None:
                self.relation_heads = int(self.relation_heads)
                if self.relation_heads <= 0:
                    raise ValueError("distill_terms: relation_heads must be a positive integer.")
        elif self.relations or self.relation_heads is not None:
            raise ValueError(f"distill_terms: relations/relation_heads apply to relation_kl only, not {self.loss}.")
        if self.stack is not None and self.stack not in STACKS:
            raise ValueError(
                f"distill_terms: stack={self.stack!r} is unknown. Known: {', '.join(STACKS)} (the stacks of an "
                "encoder-decoder model)."
            )
        if self.name is None:
            self.name = _DEFAULT_NAMES[self.loss] if self.stack is None else f"{self.stack}_{_DEFAULT_NAMES[self.loss]}"

    @property
    def feature(self) -> str:
        return LOSS_FEATURE[self.loss]

    def component_names(self) -> list[str]:
        """The names under which this term's values are logged (`loss_<name>`)."""
        if self.loss == "relation_kl":
            return [f"{self.name}_{r}" for r in self.relations]
        return [self.name]

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        if not isinstance(self.layers, str):
            d["layers"] = [list(p) for p in self.layers]
        if self.loss != "relation_kl":
            d.pop("relations")
            d.pop("relation_heads")
        if self.stack is None:
            d.pop("stack")
        return d


def check_incremental_pairs(pairs: list[tuple[int, int]], what: str = "distill_terms: incremental_mse") -> None:
    """incremental_mse's targets are differences between consecutive mapped teacher layers: a map needs two
    pairs at least, and each teacher layer once (a repeated layer would make its own difference zero)."""
    if len(pairs) < 2:
        raise ValueError(
            f"{what}: the layer map {pairs} holds {len(pairs)} pair(s); incremental_mse needs at least two "
            "(its targets are differences between consecutive mapped teacher layers). Map more layers, "
            "e.g. `uniform` or `0:0;1:2;2:4`, or use hidden_mse for a single pair."
        )
    teacher = [t for _, t in pairs]
    repeated = sorted({t for t in teacher if teacher.count(t) > 1})
    if repeated:
        raise ValueError(
            f"{what}: teacher layer(s) {repeated} appear in more than one pair of {pairs}; incremental_mse "
            "compares each student layer with the difference to the next mapped teacher layer, so each teacher "
            "layer may be mapped once."
        )


def _pair(p: Any) -> tuple[int, int]:
    try:
        s, t = p
        return int(s), int(t)
    except (TypeError, ValueError):
        raise ValueError(
            f"distill_terms: a layer pair must be (student_layer, teacher_layer), got {p!r}."
        ) from None


def _parse_pairs(text: str) -> list[tuple[int, int]]:
    pairs = []
    for chunk in text.replace(" ", "").split(";"):
        if not chunk:
            continue
        if ":" not in chunk:
            raise ValueError(
                f"distill_terms: layers={text!r} is not understood. Use `uniform`, `last`, or "
                "student:teacher pairs separated by `;` such as `1:2;2:4`."
            )
        s, t = chunk.split(":", 1)
        pairs.append(_pair((s, t)))
    return pairs


def parse_term(spec: DistillTerm | dict[str, Any] | str) -> DistillTerm:
    """Build a term from a mapping or from `key=value,...` command-line text."""
    if isinstance(spec, DistillTerm):
        return spec
    if isinstance(spec, str):
        items = {}
        for part in spec.split(","):
            if not part.strip():
                continue
            if "=" not in part:
                raise ValueError(f"distill_terms: {spec!r}: expected key=value pairs separated by commas.")
            k, v = part.split("=", 1)
            items[k.strip()] = v.strip()
        spec = items
    if not isinstance(spec, dict):
        raise ValueError(f"distill_terms: each term must be a mapping or key=value text, got {spec!r}.")
    unknown = sorted(set(spec) - set(_KEYS))
    if unknown:
        raise ValueError(f"distill_terms: unknown key(s) {unknown}. Known: {', '.join(_KEYS)}.")
    if "loss" not in spec:
        raise ValueError(f"distill_terms: {spec!r} has no `loss`. Known losses: {', '.join(LOSS_FEATURE)}.")
    return DistillTerm(**spec)


def parse_terms(specs: list[Any]) -> list[DistillTerm]:
    terms = [parse_term(s) for s in specs]
    names = [n for t in terms for n in t.component_names()]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ValueError(f"distill_terms: two terms log under the same name(s) {dupes}; give them distinct `name`s.")
    return terms
