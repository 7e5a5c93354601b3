"""The `data` section: where the corpus is, its format (text, JSONL, Parquet, ArrayRecord,
chat, prompt/completion pairs), its tokenizer and chat template, and the held-out split."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, PrivateAttr, model_validator

from distill.config.model import Section

# the variables every chat template is rendered with (distill.data.chat)
RESERVED_TEMPLATE_NAMES = ("messages", "tools", "documents", "add_generation_prompt")


class DataConfig(Section):
    source: str = Field(
        ...,
        description="A file, a directory, or a glob. '{stdlib}' expands to the Python "
        "standard library directory of the running interpreter; '{stdlib_chat}' is a chat "
        "corpus made from that library's docstrings (questions on its functions and classes, "
        "answered from their docstrings; data.format chat), written once to a cache file.",
    )
    include: list[str] = Field(
        default_factory=lambda: ["**/*"], description="Glob patterns within a directory."
    )
    exclude: list[str] = Field(default_factory=list, description="Glob patterns to skip.")
    format: Literal[
        "auto", "text", "jsonl", "parquet", "arrayrecord", "chat", "prompt_completion"
    ] = Field(
        "auto",
        description="auto: .jsonl/.json files are JSONL, .parquet Parquet, .array_record/"
        ".arrayrecord ArrayRecord of token ids (docs/guides/teacher-and-data.md), the rest text. "
        "chat: conversations (data.messages_field) of JSONL or Parquet records through the chat "
        "template; prompt_completion: plain-text pairs (data.prompt_field, data.completion_field"
        "). See docs/guides/chat-data.md.",
    )
    text_field: str = Field(
        "text", description="The text field of JSONL records and the text column of Parquet."
    )
    teacher_field: str | None = Field(
        None,
        description="Several teachers (`teachers:`): each record goes to the teacher this field "
        "of its JSONL record / column of its Parquet row names (a record without it, or naming "
        "no teacher, is an error naming the record); rows never mix teachers. None: every "
        "record to all teachers, their divergences weighted (teachers[].weight).",
    )
    teacher_batches: Literal["mixed", "grouped"] = Field(
        "mixed",
        description="With data.teacher_field: mixed: each batch draws rows of every "
        "teacher's records, and every teacher runs on every batch; grouped: each batch is one "
        "teacher's rows (the teachers' batches interleaved in proportion to their rows), and "
        "only that teacher runs on it.",
    )
    prompt_field: str | None = Field(
        None,
        description="On-policy prompts: this field of the JSONL records / column of the Parquet "
        "files of data.source; None: the first distill.on_policy.prompt_len tokens of rows. "
        "With data.format prompt_completion it is the pairs' prompt (default 'prompt'), which "
        "on-policy steps then continue.",
    )
    completion_field: str = Field(
        "completion", description="data.format prompt_completion: the pairs' completion field."
    )
    messages_field: str = Field(
        "messages",
        description="data.format chat: the field (column) holding each conversation, a list of "
        "{role, content} messages.",
    )
    tools_field: str = Field(
        "tools",
        description="data.format chat: the optional field (column) holding the JSON schemas of "
        "the tools a conversation may call, handed to the template as `tools` (a list, or a "
        "string of one in JSON).",
    )
    chat_template: str | None = Field(
        None,
        description="A Jinja chat template file; None: the template saved beside data.tokenizer "
        "(chat_template.jinja, or chat_template in tokenizer_config.json).",
    )
    chat_template_kwargs: dict[str, Any] | None = Field(
        None,
        description="Variables the chat template is rendered with, as apply_chat_template's "
        "keyword arguments (e.g. {enable_thinking: false} for Qwen3); None: none.",
    )
    train_on: Literal["assistant", "all"] = Field(
        "assistant",
        description="chat and prompt_completion data: the loss counts the assistant's tokens "
        "(the completion of a pair), or all tokens. Plain text always trains on every token.",
    )
    long_conversations: Literal["truncate", "split"] = Field(
        "truncate",
        description="A conversation longer than a row (train.seq_len + 1 tokens) is cut to one "
        "row (counted and warned), or split over rows.",
    )
    max_bad_fraction: float = Field(
        0.01,
        ge=0,
        le=1,
        description="chat and prompt_completion data: the run stops before device work when a "
        "larger share of records is malformed (each kind is counted and reported).",
    )
    tokenizer: str = Field(
        "bytes",
        description="'bytes' (built-in byte-level), or a path to a Hugging Face tokenizer.json "
        "or a SentencePiece .model.",
    )
    max_bytes: int | None = Field(
        None, ge=1, description="Stop reading the corpus after this many bytes."
    )
    eval_fraction: float = Field(
        0.02, gt=0, lt=1, description="Fraction of documents held out for evaluation."
    )
    eval_batches: int = Field(
        4,
        ge=1,
        description="Batches per evaluation: train.batch_size rows each, spread evenly over "
        "the held-out split (every row, cycling, when the split has fewer).",
    )
    prepared_dir: str | None = Field(
        None,
        description="Directory of the corpus tokenised and packed by `distill prepare`. Set: "
        "`distill prepare` writes it and runs read their rows from it, not from data.source.",
    )

    # (data.teacher_field, the teacher whose records are read, every teacher's name): set by
    # `distill.data.routed` to read one teacher's chat or pair records (`examples.records`)
    _route: tuple[str, str, tuple[str, ...]] | None = PrivateAttr(None)

    @property
    def is_examples(self) -> bool:
        """Whether the data are conversations or pairs (packed whole, with loss masks)."""
        return self.format in ("chat", "prompt_completion")

    @model_validator(mode="after")
    def _template_kwargs(self) -> DataConfig:
        taken = sorted(set(self.chat_template_kwargs or ()) & set(RESERVED_TEMPLATE_NAMES))
        if taken:
            raise ValueError(
                f"chat_template_kwargs: '{taken[0]}' is set by distill itself (the template's "
                f"own variables: {', '.join(RESERVED_TEMPLATE_NAMES)})"
            )
        return self

    @model_validator(mode="after")
    def _pairs_prompt(self) -> DataConfig:
        if self.format == "prompt_completion" and self.prompt_field is None:
            self.prompt_field = "prompt"
        return self
