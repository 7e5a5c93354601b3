"""Conversations and prompt/completion pairs read from records, tokenised with loss flags.

``data.format: chat`` reads a list of ``{role, content}`` messages from
``data.messages_field`` of each JSONL line or Parquet row and renders it with the chat
template (``distill.data.chat``); ``data.format: prompt_completion`` reads the plain-text
strings ``data.prompt_field`` and ``data.completion_field`` and makes
``[BOS] + prompt + completion + [EOS]`` of them. Either way an example is its token ids
[n] int32 and a flag [n] bool per token: whether the loss counts predicting it (the
assistant's turns or the completion, with its end token; every token under
``data.train_on: all``).

Malformed records are counted per kind (``BadRecords``), each kind reported in one line
with its first file and line; the corpus is refused (before any device work) only when
nothing trainable is left or more than ``data.max_bad_fraction`` of the records are bad. A
template that fails to render is an error at once, naming the template, file and record.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np

from distill.config import DataConfig
from distill.data.chat import ChatTemplate, load_template, trained_tokens
from distill.data.tokenizers import Tokenizer
from distill.errors import DistillError

log = logging.getLogger("distill")

_PARQUET_BATCH_ROWS = 1024
_ENCODE_CHUNK = 1024
Example = tuple[np.ndarray, np.ndarray]  # ids [n] int32, train [n] bool


class BadRecords:
    """Malformed records per kind: how many, and where the first one is."""

    def __init__(self):
        self.kinds: dict[str, list] = {}
        self.seen = 0  # records read, good and bad

    def add(self, kind: str, where: str) -> None:
        entry = self.kinds.setdefault(kind, [0, where])
        entry[0] += 1

    @property
    def count(self) -> int:
        return sum(n for n, _ in self.kinds.values())

    def lines(self) -> list[str]:
        return [f"{n} record(s) {kind} (first: {w})" for kind, (n, w) in self.kinds.items()]

    def check(self, kept: int, cfg: DataConfig) -> None:
        """Warn one line per kind; refuse the corpus when nothing is left or too much is bad."""
        total = self.seen
        for line in self.lines():
            log.warning("data.source: skipped %s", line)
        if kept == 0 or self.count > cfg.max_bad_fraction * total:
            summary = "; ".join(self.lines()) or "no records"
            raise DistillError(
                f"data.source: {self.count} of {total} records of '{cfg.source}' are unusable"
                f" (data.max_bad_fraction={cfg.max_bad_fraction}): {summary}"
            )


def _jsonl_records(path: Path, bad: BadRecords):
    for lineno, line in enumerate(path.read_bytes().split(b"\n"), start=1):
        if not line.strip():
            continue
        where = f"{path} line {lineno}"
        bad.seen += 1
        try:
            record = json.loads(line)
        except ValueError:
            bad.add("not valid JSON", where)
            continue
        yield where, record


def _parquet_records(path: Path, fields: list[str], key: str, bad: BadRecords, optional=()):
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        raise DistillError(f"data.source: {path} is not a readable Parquet file ({e})") from None
    missing = [f for f in fields if pf.schema_arrow.get_field_index(f) < 0]
    if missing:
        raise DistillError(
            f"data.source: {path} has no column '{missing[0]}' ({key}); its columns:"
            f" {', '.join(pf.schema_arrow.names)}"
        )
    columns = fields + [f for f in optional if pf.schema_arrow.get_field_index(f) >= 0]
    row = 0
    for batch in pf.iter_batches(batch_size=_PARQUET_BATCH_ROWS, columns=columns):
        for record in batch.to_pylist():
            bad.seen += 1
            yield f"{path} row {row}", record
            row += 1


def records(
    cfg: DataConfig, paths: list[Path], fields: list[str], key: str, bad: BadRecords, optional=()
):
    """(where, record) of every JSONL line and Parquet row of ``paths``; of Parquet only the
    columns ``fields`` (each required) and those of ``optional`` the file has."""
    for path in paths:
        suffix = path.suffix.lower()
        if suffix == ".parquet":
            yield from _parquet_records(path, fields, key, bad, optional)
        elif suffix in (".jsonl", ".json"):
            yield from _jsonl_records(path, bad)
        else:
            raise DistillError(
                f"data.format: {cfg.format} reads .jsonl/.json or .parquet records; {path} is"
                " neither (narrow data.include)"
            )


def _message_problem(messages, template: ChatTemplate, train_on: str) -> str | None:
    """Why a conversation cannot be used, or None."""
    if messages is None:
        return "without the field"
    if not isinstance(messages, list):
        return "whose field is not a list of messages"
    if not messages:
        return "with an empty conversation"
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            return "with a message without a role"
        if not isinstance(m.get("content"), (str, list)) and not m.get("tool_calls"):
            return "with a message without content"
        if m["role"] not in template.roles:
            return f"with a role the template does not know ('{m['role']}')"
    if train_on == "assistant" and not any(m["role"] == "assistant" for m in messages):
        return "with no assistant turn (data.train_on: assistant)"
    return None


def _conversation(record, cfg: DataConfig, template: ChatTemplate, train_on: str):
    """(messages, tools, why the record cannot be used or None) of one record: ``tools`` is
    the record's ``data.tools_field`` (a list of JSON schemas, or one as a JSON string)."""
    if not isinstance(record, dict):
        return None, None, "without the field"
    messages, tools = record.get(cfg.messages_field), record.get(cfg.tools_field)
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except ValueError:
            tools = False
    if tools is not None and not (
        isinstance(tools, list) and all(isinstance(t, dict) for t in tools)
    ):
        return messages, None, "whose tools are not a list of JSON schemas (data.tools_field)"
    return messages, tools, _message_problem(messages, template, train_on)


def _chat_records(cfg: DataConfig, paths, template: ChatTemplate, bad: BadRecords):
    """(where, messages, tools, problem or None) of every record of ``paths``."""
    for where, record in records(
        cfg, paths, [cfg.messages_field], "data.messages_field", bad, [cfg.tools_field]
    ):
        yield where, *_conversation(record, cfg, template, cfg.train_on)


def _render(template: ChatTemplate, messages: list, tools, where: str) -> tuple[str, list]:
    try:
        return template.render_spans(messages, tools)
    except Exception as exc:  # the template's own errors: raise_exception, undefined names
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise DistillError(
            f"data.chat_template: {template.where} fails to render {where}: {first}"
        ) from None


def _chat_texts(cfg: DataConfig, paths, template: ChatTemplate, bad: BadRecords):
    """(rendered text, answer spans) of every usable conversation."""
    out, budget = [], cfg.max_bytes
    for where, messages, tools, problem in _chat_records(cfg, paths, template, bad):
        if problem is None:
            text, spans = _render(template, messages, tools, where)
            if cfg.train_on == "assistant" and not spans:
                problem = "with no assistant turn (data.train_on: assistant)"
        if problem is not None:
            bad.add(problem, where)
            continue
        out.append((text, spans if cfg.train_on == "assistant" else [(0, len(text))]))
        if budget is not None:
            budget -= len(text.encode("utf-8"))
            if budget <= 0:
                break
    return out


def _pair_texts(cfg: DataConfig, paths, bad: BadRecords):
    """(prompt + completion, [completion span]) of every usable pair."""
    fields = [cfg.prompt_field, cfg.completion_field]
    out, budget = [], cfg.max_bytes
    for where, record in records(cfg, paths, fields, "data.prompt_field", bad):
        values = [record.get(f) if isinstance(record, dict) else None for f in fields]
        if not all(isinstance(v, str) for v in values):
            missing = fields[0] if not isinstance(values[0], str) else fields[1]
            bad.add(f"without a string field '{missing}'", where)
            continue
        prompt, completion = values
        if not completion:
            bad.add("with an empty completion", where)
            continue
        text = prompt + completion
        start = 0 if cfg.train_on == "all" else len(prompt)
        out.append((text, [(start, len(text))]))
        if budget is not None:
            budget -= len(text.encode("utf-8"))
            if budget <= 0:
                break
    return out


def load_examples(cfg: DataConfig, paths: list[Path], tokenizer: Tokenizer) -> list[Example]:
    """Every usable example of ``paths`` in order, tokenised with its loss flags."""
    if not hasattr(tokenizer, "encode_offsets"):
        raise DistillError(
            f"data.tokenizer: data.format={cfg.format} needs character offsets, which a "
            f"{tokenizer.kind} tokenizer does not give; use a tokenizer.json or 'bytes'"
        )
    bad = BadRecords()
    chat = cfg.format == "chat"
    if chat:
        texts = _chat_texts(cfg, paths, load_template(cfg, tokenizer), bad)
    else:
        texts = _pair_texts(cfg, paths, bad)
    bad.check(len(texts), cfg)
    examples = []
    for lo in range(0, len(texts), _ENCODE_CHUNK):
        chunk = texts[lo : lo + _ENCODE_CHUNK]
        encoded = tokenizer.encode_offsets([t for t, _ in chunk])
        for (_, spans), (ids, offsets) in zip(chunk, encoded, strict=True):
            train = trained_tokens(offsets, spans)
            if not chat:  # a pair is one document: [BOS] + text + [EOS], EOS trained on
                ids = np.concatenate([[tokenizer.bos_id], ids, [tokenizer.eos_id]])
                train = np.concatenate([[False], train, [True]])
            examples.append((ids.astype(np.int32), train))
    return examples


def conversation_prompts(cfg: DataConfig, paths: list[Path], tokenizer: Tokenizer) -> list[str]:
    """On-policy prompts of chat data: each usable conversation up to its last assistant
    turn, rendered with the template's generation prompt (the student answers from there)."""
    template, bad = load_template(cfg, tokenizer), BadRecords()
    out = []
    for where, messages, tools, problem in _chat_records(cfg, paths, template, bad):
        if problem is not None or not any(m["role"] == "assistant" for m in messages):
            continue  # counted and reported when the corpus was read
        last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
        try:
            out.append(template.render(messages[:last], add_generation_prompt=True, tools=tools))
        except Exception as exc:
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise DistillError(
                f"data.chat_template: {template.where} fails to render {where}: {first}"
            ) from None
    return out
