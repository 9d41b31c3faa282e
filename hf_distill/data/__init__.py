"""What the Trainer feeds: collators that keep teacher columns (`collators`), cached teacher outputs (`cache`) and
data augmentation (`augment`, TinyBERT's; `tang_augment`, Distilled BiLSTM's); speech recognition data
(`asr`: collator, resumable pseudo-labels) and word error rate (`wer`)."""
