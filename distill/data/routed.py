"""Records routed to one of several teachers by a field of the data (`data.teacher_field`).

Text records, conversations and pairs alike: each teacher's records are read, held out and
packed into rows of their own (`distill.data.corpus.PackedRows`, held out as
`distill.data.loader.split_documents` holds out; conversations and pairs as
`distill.data.loader.example_corpus` makes them), so a row never mixes teachers;
`RoutedRows` serves the teachers' rows as one set of rows, each batch's `route` [B, S] giving
the teacher index of every position (its row's). The teachers' outputs are then weighed per
position by it (`distill.types.TeacherMix`).
"""

from __future__ import annotations

import functools
import json
import logging
from pathlib import Path

import grain
import numpy as np

from distill.config import DataConfig
from distill.data.corpus import Corpus, PackedRows
from distill.data.loader import example_corpus, pack_splits, resolve_paths
from distill.data.tokenizers import build_tokenizer
from distill.errors import DistillError
from distill.types import Batch

log = logging.getLogger("distill")


class RoutedRows:
    """The rows of each teacher's records, one after another: row i of the whole is row
    i - offset[t] of teacher t's, and its batch's `route` is t at every position."""

    def __init__(self, parts: list[PackedRows], grouped: bool = False):
        self.parts, self.grouped = parts, grouped
        self.offsets = np.cumsum([0, *(len(p) for p in parts)])
        self.seq_len = parts[0].seq_len
        self.num_tokens = sum(p.num_tokens for p in parts)
        self.num_documents = sum(p.num_documents for p in parts)

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def gather(self, rows: np.ndarray) -> Batch:
        """The Batch of rows `rows` [B], with `route` [B, S] int32."""
        rows = np.asarray(rows, dtype=np.int64)
        teacher = np.searchsorted(self.offsets, rows, side="right") - 1
        fields: list[np.ndarray] = []
        order = np.empty(len(rows), dtype=np.int64)
        done = 0
        for t, part in enumerate(self.parts):
            mine = np.flatnonzero(teacher == t)
            if not mine.size:
                continue
            fields.append(part.gather(rows[mine] - self.offsets[t]))
            order[done : done + mine.size] = mine
            done += mine.size
        back = np.argsort(order, kind="stable")  # the parts' rows back in the asked order
        whole = Batch(
            *(np.concatenate(xs)[back] for xs in zip(*(f[:5] for f in fields), strict=True))
        )
        route = np.broadcast_to(teacher[:, None], whole.tokens.shape).astype(np.int32)
        return whole._replace(route=route)

    def grouped_row_ids(self, batch_size: int, seed: int) -> grain.MapDataset:
        """The row ids [batch_size] of each batch, every batch one teacher's rows
        (`data.teacher_batches: grouped`): each teacher's rows in an order of its own each
        round, cut into whole batches; a round holds every teacher's batches, spread
        evenly in proportion to their counts. Batch i is addressable directly, as
        `distill.data.corpus.Corpus.train_row_ids`'s are."""
        per = [len(p) // batch_size for p in self.parts]
        order = sorted(((k + 0.5) / n, t) for t, n in enumerate(per) for k in range(n))
        schedule = np.array([t for _, t in order])
        within = np.zeros(len(schedule), np.int64)  # the batch's index among its teacher's
        for t in range(len(per)):
            mine = schedule == t
            within[mine] = np.arange(mine.sum())

        @functools.lru_cache(maxsize=2 * len(per))
        def order_of(t: int, round_: int) -> np.ndarray:
            rng = np.random.default_rng([seed % 2**63, t, round_])  # any run.seed
            return rng.permutation(len(self.parts[t]))

        def rows(i: int, _) -> np.ndarray:
            round_, j = divmod(i, len(schedule))
            t, k = int(schedule[j]), int(within[j])
            ids = order_of(t, round_)[k * batch_size : (k + 1) * batch_size]
            return ids + self.offsets[t]

        return grain.MapDataset.range(len(schedule)).repeat(None).map_with_index(rows)


def routed_corpus(cfg: DataConfig, seq_len: int, names: list[str]) -> Corpus:
    """The records of data.source tokenised, each teacher's packed apart (`RoutedRows`) and
    held out apart; every teacher needs a train and an eval row."""
    tokenizer = build_tokenizer(cfg)
    if cfg.is_examples:
        return _routed_examples(cfg, seq_len, names, tokenizer)
    texts = routed_texts(cfg, names)
    split = {"train": [], "eval": []}
    for t, name in enumerate(names):
        mine = [text for text, to in texts if to == t]
        docs = list(tokenizer.encode_batch(mine)) if mine else []
        what = f"data.teacher_field: the records routed to '{name}'"
        train, held = pack_splits(docs, cfg, seq_len, tokenizer, what)
        split["train"].append(train)
        split["eval"].append(held)
    grouped = cfg.teacher_batches == "grouped"
    train, held = RoutedRows(split["train"], grouped), RoutedRows(split["eval"])
    log.info(
        "data: %d documents routed by '%s' into %d train rows (%s)",
        train.num_documents,
        cfg.teacher_field,
        len(train),
        ", ".join(f"{n}: {len(p)}" for n, p in zip(names, train.parts, strict=True)),
    )
    return Corpus(tokenizer=tokenizer, train=train, eval=held)


def _routed_examples(cfg: DataConfig, seq_len: int, names: list[str], tokenizer) -> Corpus:
    """Conversations or pairs, each teacher's read, held out and packed apart (as
    `distill.data.loader.example_corpus` makes one corpus of them)."""
    parts = []
    for name in names:
        one = cfg.model_copy()
        one._route = (cfg.teacher_field, name, tuple(names))
        try:
            parts.append(example_corpus(one, seq_len, tokenizer))
        except DistillError as e:
            raise DistillError(f"data.teacher_field: the records routed to '{name}': {e}") from None
    train = RoutedRows([c.train for c in parts], cfg.teacher_batches == "grouped")
    log.info(
        "data: %d %s records routed by '%s' into %d train rows (%s)",
        train.num_documents,
        cfg.format,
        cfg.teacher_field,
        len(train),
        ", ".join(f"{n}: {len(p)}" for n, p in zip(names, train.parts, strict=True)),
    )
    return Corpus(tokenizer=tokenizer, train=train, eval=RoutedRows([c.eval for c in parts]))


def routed_texts(cfg: DataConfig, names: list[str]) -> list[tuple[str, int]]:
    """(text, teacher index) of every record of data.source with a non-empty text, in sorted
    path order, at most data.max_bytes of text; a record whose data.teacher_field is missing
    or names no teacher is one error naming it."""
    index = {n: i for i, n in enumerate(names)}
    out: list[tuple[str, int]] = []
    budget = cfg.max_bytes
    for path in resolve_paths(cfg):
        for where, text, to in _records(path, cfg):
            if to not in index:
                got = "has none" if to is None else f"is {to!r}"
                raise DistillError(
                    f"data.teacher_field: {where}: its '{cfg.teacher_field}' {got}; it must "
                    f"name one of the teachers ({', '.join(names)})"
                )
            if not text:
                continue
            if budget is not None:
                budget -= len(text.encode("utf-8"))
                if budget < 0:
                    return out
            out.append((text, index[to]))
    if not out:
        raise DistillError(f"data.source: '{cfg.source}' holds no text to route")
    return out


def _records(path: Path, cfg: DataConfig):
    """(where, text, teacher name) of each record of a JSONL or Parquet file."""
    text_key, to_key = cfg.text_field, cfg.teacher_field
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        table = pq.read_table(path)
        for key in (text_key, to_key):
            if key not in table.column_names:
                raise DistillError(f"data.source: {path} has no column '{key}'")
        texts, tos = table.column(text_key).to_pylist(), table.column(to_key).to_pylist()
        for row, (text, to) in enumerate(zip(texts, tos, strict=True)):
            yield f"{path} row {row}", text, to
        return
    if suffix not in (".jsonl", ".json"):
        raise DistillError(
            f"data.teacher_field: reads JSONL or Parquet records; {path} is neither (narrow "
            "data.include)"
        )
    for lineno, line in enumerate(path.read_bytes().split(b"\n"), start=1):
        if not line.strip():
            continue
        where = f"{path} line {lineno}"
        try:
            record = json.loads(line)
        except ValueError:
            raise DistillError(f"data.source: {where}: not valid JSON") from None
        if not isinstance(record, dict) or not isinstance(record.get(text_key), str):
            raise DistillError(f"data.source: {where}: no string field '{text_key}'")
        yield where, record[text_key], record.get(to_key)


def teacher_corpus(corpus: Corpus, t: int) -> Corpus:
    """The corpus teacher `t` is bootstrapped on and checked against: its own records' rows
    when records are routed (`RoutedRows`), else the whole corpus."""
    if not isinstance(corpus.train, RoutedRows):
        return corpus
    train, held = corpus.train.parts[t], corpus.eval.parts[t]
    return Corpus(tokenizer=corpus.tokenizer, train=train, eval=held)
