"""Train a small byte-level BPE tokenizer on a config's corpus, with no download.

A cross-tokenizer run needs a student tokenizer other than the teacher's; for the quick
start (a byte-level teacher) this makes one from the same documents the run reads
(``data.source``, ``data.include``, ``data.max_bytes``): GPT-2-style byte-level BPE
(every byte is a token, so any text encodes), ``<pad>``, ``<s>`` and ``</s>`` as its specials,
offsets untrimmed (each token's span is exactly its bytes, whitespace included). The
trainer is deterministic: the same corpus and vocabulary size give the same file.

    python -m distill.data.bpe pipelines/quickstart.yaml --vocab-size 512 --out bpe.json
"""

from __future__ import annotations

import argparse
from pathlib import Path

from distill.config import DataConfig

SPECIALS = ("<pad>", "<s>", "</s>")


def train_bpe(texts: list[str], vocab_size: int, out: Path) -> Path:
    """Train byte-level BPE of `vocab_size` ids (specials included) on `texts`; write the
    tokenizer.json to `out` and return it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIALS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(out))
    return out


def train_on_corpus(data: DataConfig, vocab_size: int, out: Path) -> Path:
    """`train_bpe` on the text documents `data` names (read as a run reads them)."""
    from distill.data.loader import load_documents

    texts = [d for d in load_documents(data, vocab_size=1) if isinstance(d, str)]
    return train_bpe(texts, vocab_size, out)


def main(argv: list[str] | None = None) -> None:
    from distill.config.load import load_config

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("config", help="a run config; its data section names the corpus")
    ap.add_argument("--vocab-size", type=int, default=512)
    ap.add_argument("--out", required=True, help="where to write tokenizer.json")
    args = ap.parse_args(argv)
    path = train_on_corpus(load_config(args.config).data, args.vocab_size, Path(args.out))
    print(path)


if __name__ == "__main__":
    main()
