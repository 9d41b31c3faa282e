"""A BiLSTM sentence classifier as a `transformers` model: the Distilled BiLSTM student.

Tang et al. 2019, "Distilling Task-Specific Knowledge from BERT into Simple Neural Networks" (§3.1, §4.2):
word embeddings, one bidirectional LSTM layer (150 units per direction for SST-2), the last forward and
backward states concatenated, a ReLU layer (200 units for SST-2) and a linear classifier; trained with
`alpha * CE + (1 - alpha) * ||z_teacher - z_student||^2` on the task data plus rule-based augmentation
(`hf_distill.data.tang_augment`).

Why a `PreTrainedModel` and not a bare `nn.Module`: `Trainer`, `save_pretrained` / `from_pretrained`,
`AutoModelForSequenceClassification` and `push_to_hub` then work for the student as for a transformer, with no
special case anywhere. The Auto classes know the model once this module is imported (`import
hf_distill.students.bilstm`; `import hf_distill` alone does not load torch-heavy modules), so whoever loads a pushed
student needs `hf_distill` installed and that import first.

Embeddings: the paper starts from 300-d word2vec vectors, which are not available offline. `from_teacher`
starts from the teacher's own input word embeddings instead: the student then reads the teacher's
WordPiece ids (one tokenizer for both) and begins with pre-trained vectors, as the paper's student did.
`embedding_init="random"` is the other choice, for a student that owes the teacher nothing but its logits.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence
from transformers import AutoConfig, AutoModelForSequenceClassification, PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import SequenceClassifierOutput


class BiLSTMConfig(PretrainedConfig):
    """Sizes of the BiLSTM student; `num_labels`, `id2label` and `problem_type` as for any HF classifier."""

    model_type = "hf_distill_bilstm"

    def __init__(
        self,
        vocab_size: int = 30522,
        embedding_size: int = 300,
        hidden_size: int = 150,
        classifier_size: int = 200,
        dropout: float = 0.0,
        pad_token_id: int = 0,
        **kwargs,
    ):
        self.vocab_size = vocab_size
        self.embedding_size = embedding_size
        self.hidden_size = hidden_size  # per direction
        self.classifier_size = classifier_size
        self.dropout = dropout
        super().__init__(pad_token_id=pad_token_id, **kwargs)


class BiLSTMForSequenceClassification(PreTrainedModel):
    """One sentence in, logits out. Needs right padding (the packed LSTM reads each row up to its length)."""

    config_class = BiLSTMConfig
    base_model_prefix = "bilstm"
    main_input_name = "input_ids"

    def __init__(self, config: BiLSTMConfig):
        super().__init__(config)
        self.embeddings = nn.Embedding(config.vocab_size, config.embedding_size, padding_idx=config.pad_token_id)
        self.lstm = nn.LSTM(config.embedding_size, config.hidden_size, batch_first=True, bidirectional=True)
        self.dropout = nn.Dropout(config.dropout)
        self.dense = nn.Linear(2 * config.hidden_size, config.classifier_size)
        self.classifier = nn.Linear(config.classifier_size, config.num_labels)
        self.post_init()

    def _init_weights(self, module: nn.Module) -> None:
        # Called by post_init and by from_pretrained for weights a checkpoint lacks (a new head): PyTorch's own
        # LSTM and Linear initialisations, which the paper's student used; a small normal embedding table.
        if isinstance(module, nn.Linear | nn.LSTM):
            module.reset_parameters()
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, std=0.1)
            if module.padding_idx is not None:
                with torch.no_grad():
                    module.weight[module.padding_idx].zero_()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embeddings

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.embeddings = value

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        output_hidden_states: bool | None = None,
        output_attentions: bool | None = None,
        return_dict: bool | None = None,
    ) -> SequenceClassifierOutput:
        if output_hidden_states or output_attentions:
            raise ValueError("BiLSTMForSequenceClassification has no transformer hidden states or attentions: "
                             "distil it on logits only (no distill_terms)")
        if token_type_ids is not None and bool((token_type_ids != 0).any()):
            raise ValueError("BiLSTMForSequenceClassification encodes one sentence; this batch holds sentence "
                             "pairs (token_type_ids = 1). The paper's siamese pair model is not implemented.")
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        lengths = attention_mask.sum(-1)
        if bool((lengths == 0).any()):
            raise ValueError("BiLSTMForSequenceClassification: a row has no tokens (attention_mask all 0)")
        if input_ids.shape[1] > 1 and bool((attention_mask[:, 1:] > attention_mask[:, :-1]).any()):
            raise ValueError("BiLSTMForSequenceClassification needs right padding: set "
                             "tokenizer.padding_side = 'right'")
        packed = pack_padded_sequence(self.embeddings(input_ids), lengths.cpu(), batch_first=True,
                                      enforce_sorted=False)
        _, (h_n, _) = self.lstm(packed)  # h_n: (2, batch, hidden), the last state of each direction
        features = self.dropout(torch.cat([h_n[0], h_n[1]], dim=-1))
        logits = self.classifier(self.dropout(torch.relu(self.dense(features))))
        loss = None if labels is None else self._loss(logits, labels)
        if return_dict is False:
            return (logits,) if loss is None else (loss, logits)
        return SequenceClassifierOutput(loss=loss, logits=logits)

    def _loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The loss `BertForSequenceClassification` would take for the same config and labels."""
        kind = self.config.problem_type
        if kind is None:
            kind = ("regression" if self.config.num_labels == 1 else "single_label_classification"
                    if labels.dtype in (torch.long, torch.int) else "multi_label_classification")
            self.config.problem_type = kind
        if kind == "regression":
            return nn.functional.mse_loss(logits.squeeze(-1).float(), labels.float().view(-1))
        if kind == "single_label_classification":
            return nn.functional.cross_entropy(logits.float().view(-1, self.config.num_labels), labels.view(-1))
        return nn.functional.binary_cross_entropy_with_logits(logits.float(), labels.float())


def from_teacher(
    teacher: PreTrainedModel,
    *,
    hidden_size: int = 150,
    classifier_size: int = 200,
    dropout: float = 0.0,
    embedding_init: str = "teacher",
    seed: int = 0,
) -> BiLSTMForSequenceClassification:
    """A BiLSTM student for `teacher`'s task and tokenizer: same vocabulary and labels; word embeddings
    copied from the teacher (`embedding_init="teacher"`, trained further) or random (`"random"`)."""
    if embedding_init not in ("teacher", "random"):
        raise ValueError(f"embedding_init must be 'teacher' or 'random', not {embedding_init!r}")
    table = teacher.get_input_embeddings().weight
    tc = teacher.config
    config = BiLSTMConfig(
        vocab_size=table.shape[0], embedding_size=table.shape[1], hidden_size=hidden_size,
        classifier_size=classifier_size, dropout=dropout,
        pad_token_id=tc.pad_token_id if tc.pad_token_id is not None else 0,
        num_labels=tc.num_labels, id2label=dict(tc.id2label), label2id=dict(tc.label2id),
        problem_type=tc.problem_type,
    )
    with torch.random.fork_rng(devices=[]):  # the caller's random stream is left as it was
        torch.manual_seed(seed)
        student = BiLSTMForSequenceClassification(config)
    if embedding_init == "teacher":
        with torch.no_grad():
            student.embeddings.weight.copy_(table.detach().float())
    return student


AutoConfig.register(BiLSTMConfig.model_type, BiLSTMConfig)
AutoModelForSequenceClassification.register(BiLSTMConfig, BiLSTMForSequenceClassification)
