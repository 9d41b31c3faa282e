"""What the Trainer feeds: collators that keep teacher columns (`collators`), cached teacher outputs (`cache`) and
data augmentation (`augment`, TinyBERT's; `tang_augment`, Distilled BiLSTM's)."""
