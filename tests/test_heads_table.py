"""The head table (hf_distill.features.heads): one function says what a model's head is for, from its config and
the task mappings (or, where they are silent, its structure and the shape of its logits), never from its class
name; one table says what each kind means to the teacher loader, the trainer, the report and the card."""

from __future__ import annotations

import re
from pathlib import Path

import audio_models
import peft
import pytest
import torch
import transformers
from decoder_models import DECODERS, decoder_config
from helpers import bert_config, llama
from torch import nn
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    BertForMaskedLM,
    BertForMultipleChoice,
    BertForQuestionAnswering,
    BertForSequenceClassification,
    BertForTokenClassification,
    BertModel,
    LlamaConfig,
    LlamaForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
    T5Config,
    T5ForConditionalGeneration,
)
from transformers.modeling_outputs import CausalLMOutput, SequenceClassifierOutput

from hf_distill.features.heads import (
    HEADS,
    Head,
    HeadKind,
    class_kind,
    head_kind,
    kind_for_task,
    num_labels,
    runtime_head,
    static_head,
)
from hf_distill.publish.report import pipeline_tag_for


def _t5():
    return T5ForConditionalGeneration(T5Config(vocab_size=64, d_model=16, d_kv=4, d_ff=32, num_layers=1,
                                               num_decoder_layers=1, num_heads=4, decoder_start_token_id=0))


# kind -> (a tiny real model of it, the loss head, its num_labels)
MODELS = {
    HeadKind.SEQ2SEQ_LM: (_t5, Head.SEQ2SEQ_LM, None),
    HeadKind.QUESTION_ANSWERING: (lambda: BertForQuestionAnswering(bert_config(layers=1)), Head.QUESTION_ANSWERING,
                                  None),
    HeadKind.CAUSAL_LM: (lambda: llama(layers=1), Head.CAUSAL_LM, None),
    HeadKind.SEQUENCE_CLASSIFICATION: (lambda: BertForSequenceClassification(bert_config(layers=1, labels=3)),
                                       Head.SEQUENCE, 3),
    HeadKind.TOKEN_CLASSIFICATION: (lambda: BertForTokenClassification(bert_config(layers=1, labels=5)), Head.TOKEN,
                                    5),
    HeadKind.MASKED_LM: (lambda: BertForMaskedLM(bert_config(layers=1)), Head.TOKEN, None),
    HeadKind.MULTIPLE_CHOICE: (lambda: BertForMultipleChoice(bert_config(layers=1)), None, None),
    HeadKind.IMAGE_CLASSIFICATION: (lambda: transformers.ViTForImageClassification(transformers.ViTConfig(
        hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=16, image_size=8, patch_size=4,
        num_labels=3)), Head.SEQUENCE, 3),  # issue #43
    HeadKind.BASE: (lambda: BertModel(bert_config(layers=1)), None, None),
    HeadKind.AUDIO_CLASSIFICATION: (lambda: audio_models.wav2vec2(layers=1), Head.SEQUENCE, 3),
}


def test_every_kind_has_a_model_and_a_row():
    assert set(MODELS) == set(HeadKind) == set(HEADS)


@pytest.mark.parametrize("kind", list(HeadKind), ids=lambda k: k.value)
def test_each_kind_is_recognised_and_its_row_matches_transformers_and_peft(kind):
    build, head, labels = MODELS[kind]
    model = build()
    facts = kind.facts
    assert head_kind(model) is kind and head_kind(torch.compile(model)) is kind
    assert static_head(model) is head and num_labels(model) == labels
    assert facts.classifier == (labels is not None)
    assert facts.token_level == (head in (Head.TOKEN, Head.CAUSAL_LM, Head.SEQ2SEQ_LM))
    # the Auto class of the row builds this very class from the model's config
    assert type(getattr(transformers, facts.auto_class).from_config(model.config)) is type(model)
    # peft's class for the row wraps that Auto class (the generic AutoPeftModel where peft has no task class)
    peft_class = getattr(peft, facts.peft_class)
    assert peft_class is peft.AutoPeftModel or peft_class._target_class.__name__ == facts.auto_class
    # the pipeline tag is the one transformers' pipelines load with that Auto class, where a pipeline exists
    task = transformers.pipelines.SUPPORTED_TASKS.get(facts.pipeline_tag)
    if task is not None:
        assert facts.auto_class in [c.__name__ for c in task["pt"]]
    # a saved config's class name, a report's and a card's task lead back to the same row
    assert class_kind(type(model).__name__, model.config.to_dict()) is kind
    assert class_kind(type(model).__name__) is kind
    assert pipeline_tag_for(type(model).__name__) == facts.pipeline_tag
    assert kind_for_task(facts.pipeline_tag) is kind


@pytest.mark.parametrize("problem, labels, head", [(None, 1, Head.REGRESSION), ("regression", 1, Head.REGRESSION),
                                                   ("multi_label_classification", 4, Head.MULTI_LABEL),
                                                   ("single_label_classification", 4, Head.SEQUENCE)])
def test_a_sequence_classifier_s_loss_head_follows_its_config(problem, labels, head):
    model = BertForSequenceClassification(bert_config(layers=1, labels=labels, problem_type=problem))
    assert head_kind(model) is HeadKind.SEQUENCE_CLASSIFICATION and static_head(model) is head
    assert num_labels(model) == labels


def test_multi_hot_float_labels_make_an_undeclared_sequence_classifier_multi_label():
    model = BertForSequenceClassification(bert_config(layers=1, labels=3))
    logits = torch.zeros(2, 3)
    assert runtime_head(model, logits, torch.tensor([[1.0, 0.0, 1.0], [0.0, 1.0, 0.0]])) is Head.MULTI_LABEL
    assert runtime_head(model, logits, torch.tensor([0, 2])) is Head.SEQUENCE


@pytest.mark.parametrize("family", DECODERS)
def test_every_registered_decoder_family_is_a_causal_lm(family):
    model = AutoModelForCausalLM.from_config(decoder_config(family, layers=1))
    assert head_kind(model) is HeadKind.CAUSAL_LM and static_head(model) is Head.CAUSAL_LM


# ---------------------------------------------------------------- classes whose names say nothing


class Anything(LlamaForCausalLM):
    """A subclass of a mapped class: recognised through its base, whatever it is called."""


class Scratch(PreTrainedModel):
    """A causal LM written from scratch on a Llama config: no mapping names it, its LM head and the llama family
    (causal) do."""

    config_class = LlamaConfig

    def __init__(self, config):
        super().__init__(config)
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.embed

    def forward(self, input_ids=None, **kwargs):
        return CausalLMOutput(logits=self.lm_head(self.embed(input_ids)))


class _TableTestConfig(PretrainedConfig):
    model_type = "hf_distill_head_table_test"


class Registered(PreTrainedModel):
    """A classifier of a custom model type, registered with AutoModelForSequenceClassification (as transformers
    asks of custom models)."""

    config_class = _TableTestConfig

    def __init__(self, config):
        super().__init__(config)
        self.score = nn.Linear(4, config.num_labels)
        self.post_init()

    def forward(self, inputs_embeds=None, **kwargs):
        return SequenceClassifierOutput(logits=self.score(inputs_embeds))


AutoConfig.register(_TableTestConfig.model_type, _TableTestConfig)
AutoModelForSequenceClassification.register(_TableTestConfig, Registered)


class NamedLikeItIsForCausalLM(PreTrainedModel):
    """Its name ends in ForCausalLM, but nothing else says so: no mapping, no registration, no LM head."""

    config_class = PretrainedConfig

    def __init__(self, config):
        super().__init__(config)
        self.score = nn.Linear(4, 2)
        self.post_init()

    def forward(self, inputs_embeds=None, **kwargs):
        return SequenceClassifierOutput(logits=self.score(inputs_embeds))


def _llama_config():
    return LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                       num_attention_heads=4, num_key_value_heads=4)


def test_a_subclass_of_a_mapped_class_is_its_base_s_kind():
    model = Anything(_llama_config())
    assert head_kind(model) is HeadKind.CAUSAL_LM and static_head(model) is Head.CAUSAL_LM


def test_a_class_from_scratch_with_an_lm_head_on_a_causal_family_is_a_causal_lm():
    model = Scratch(_llama_config())
    assert head_kind(model) is HeadKind.CAUSAL_LM
    logits = model(input_ids=torch.tensor([[1, 2, 3]])).logits
    assert runtime_head(model, logits, None) is Head.CAUSAL_LM  # not token-level logits without the shift


def test_a_registered_custom_class_is_its_auto_class_s_kind():
    model = Registered(_TableTestConfig(num_labels=3))
    assert head_kind(model) is HeadKind.SEQUENCE_CLASSIFICATION and num_labels(model) == 3
    saved = {"model_type": _TableTestConfig.model_type, "architectures": ["Registered"]}
    assert class_kind("Registered", saved) is HeadKind.SEQUENCE_CLASSIFICATION
    assert pipeline_tag_for("Registered", saved) == "text-classification"


def test_the_bilstm_student_s_saved_config_names_its_head():
    saved = {"model_type": "hf_distill_bilstm", "architectures": ["BiLSTMForSequenceClassification"]}
    assert pipeline_tag_for("BiLSTMForSequenceClassification", saved) == "text-classification"


def test_a_name_alone_decides_nothing():
    model = NamedLikeItIsForCausalLM(PretrainedConfig())
    assert head_kind(model) is None and static_head(model) is None and num_labels(model) is None
    assert class_kind("MyOwnThingForCausalLM") is None and pipeline_tag_for("SomethingModel") is None
    logits = model(inputs_embeds=torch.zeros(2, 4)).logits  # judged by its output: a (batch, 2) sequence head
    assert head_kind(model, logits) is HeadKind.SEQUENCE_CLASSIFICATION
    assert runtime_head(model, logits, None) is Head.SEQUENCE


@pytest.mark.parametrize("shape, kind, head", [((2, 5, 7), HeadKind.TOKEN_CLASSIFICATION, Head.TOKEN),
                                               ((2, 3), HeadKind.SEQUENCE_CLASSIFICATION, Head.SEQUENCE),
                                               ((2, 1), HeadKind.SEQUENCE_CLASSIFICATION, Head.REGRESSION)])
def test_a_plain_module_is_judged_by_the_shape_of_its_logits(shape, kind, head):
    model = nn.Linear(4, 4)
    logits = torch.zeros(shape)
    assert head_kind(model) is None and static_head(model) is None
    assert head_kind(model, logits) is kind and runtime_head(model, logits, None) is head


# ---------------------------------------------------------------- no class-name suffix tests come back

_PACKAGE = Path(__file__).resolve().parents[1] / "hf_distill"
# `name.endswith("For...")`, `endswith(("For...", ...))`, and suffix tables of quoted "ForXxx" strings
_SUFFIX = re.compile(r"""endswith\(\s*\(?\s*f?["']For[A-Z]|["']For[A-Z]\w*["']""")


def _sources():
    return sorted(p.relative_to(_PACKAGE).as_posix() for p in _PACKAGE.rglob("*.py"))


def test_the_suffix_scan_sees_a_suffix_test():
    assert _SUFFIX.search('type(m).__name__.endswith("ForSequenceClassification")')
    assert _SUFFIX.search('name.endswith(("ForMaskedLM", "ForCausalLM"))')
    assert _SUFFIX.search('_HEAD_TASKS = (("ForQuestionAnswering", "question-answering"),)')
    assert not _SUFFIX.search('"Load the teacher with AutoModelForCausalLM."')
    assert len(_sources()) > 20


@pytest.mark.parametrize("source", _sources())
def test_no_head_is_decided_by_a_class_name_suffix(source):
    text = (_PACKAGE / source).read_text()
    found = [f"{source}:{text.count(chr(10), 0, m.start()) + 1}: {m.group(0)}" for m in _SUFFIX.finditer(text)]
    assert not found, "decide heads with hf_distill.features.heads.head_kind, not class names: " + "; ".join(found)
