"""Conversations through the model's own chat template, and which characters are answers.

The template is read beside the tokenizer (``chat_template.jinja``, or ``chat_template`` in
``tokenizer_config.json``, as Hugging Face saves them) or from ``data.chat_template``. It is
rendered as ``transformers``' ``apply_chat_template`` renders it
(``transformers/utils/chat_template_utils.py``): Jinja2's immutable sandbox with
``trim_blocks`` and ``lstrip_blocks``, the loop controls, ``raise_exception``,
``strftime_now``, a ``tojson`` that does not escape HTML, ``dict`` and a namespace that
refuses underscore names, the ``{% generation %}`` block, and the tokenizer's special token
strings (``bos_token``, ``eos_token``, ...) as variables. Tokenising the rendered text
without adding specials then gives ``apply_chat_template``'s token ids.

The answer spans are character ranges of the rendered text: the ``{% generation %}``
blocks where the template has them, else, for each assistant message, the text between
the conversation rendered up to it with ``add_generation_prompt`` and rendered through it
(trailing whitespace after the end-of-turn token left out). A token is trained on when it
overlaps a span, the rule ``apply_chat_template(return_assistant_tokens_mask=True)`` uses.

Each answer is learnt in the context the model answers in: the conversation before it with
the generation prompt. Where the whole conversation renders every answer so (each turn a
continuation of the ones before it), it is one example with every answer trained. A
template that rewrites earlier turns once a later one follows (Qwen3 drops an earlier
answer's ``<think>`` block; Mistral's moves the system message into the last user turn)
makes one example per answer instead: the conversation through that answer, as the
template renders it when the answer is the last turn, only that answer trained
(``ChatTemplate.render_examples``).
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import numpy as np

from distill.errors import DistillError

BASE_ROLES = ("system", "user", "assistant")
_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
_SPECIALS = ("bos_token", "eos_token", "unk_token", "pad_token")
Example = tuple[str, list[tuple[int, int]]]  # a rendered text and its answers' spans


def _sandbox():
    """The Jinja2 environment ``transformers`` compiles chat templates in, with a
    ``generation`` block that records the character span it renders."""
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTracker(Extension):
        tags = {"generation"}

        def __init__(self, environment):
            super().__init__(environment)
            self.blocks: list[str] | None = None
            self.spans: list[tuple[int, int]] = []

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            call = self.call_method("_track")
            return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

        def _track(self, caller):
            text = caller()
            if self.blocks is not None:
                start = len("".join(self.blocks))
                self.spans.append((start, start + len(text)))
            return text

    class TemplateDict:
        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(jinja2.utils.Namespace):
        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check_name(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r}")

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTracker, loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.globals["dict"] = TemplateDict()
    env.globals["namespace"] = TemplateNamespace
    return env, env.extensions[GenerationTracker.identifier]


def _normalise(messages: list[dict]) -> list[dict]:
    """What ``apply_chat_template`` hands the template: keys with None values dropped, and
    a message's reasoning under every name templates read it by."""
    out = []
    for m in messages:
        m = {k: v for k, v in m.items() if v is not None}
        reasoning = next((m[k] for k in _REASONING_FIELDS if m.get(k) is not None), None)
        if reasoning is not None:
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        out.append(m)
    return out


@dataclass
class ChatTemplate:
    """A compiled chat template, where it came from, and the variables it is rendered with."""

    text: str
    where: str  # the file it was read from, for error messages
    specials: dict[str, str]
    key: str = "data.chat_template"  # the config key that names it, for error messages
    variables: dict | None = None  # data.chat_template_kwargs: more variables it sees

    def __post_init__(self):
        self._env, self._tracker = _sandbox()
        try:
            self._template = self._env.from_string(self.text)
        except Exception as exc:
            raise DistillError(f"{self.key}: {self.where}: {_first_line(exc)}") from None
        self.has_generation = bool(_GENERATION_TAG.search(self.text))
        quoted = set(re.findall(r"""['"](\w+)['"]""", self.text))
        self.roles = frozenset(BASE_ROLES) | {r for r in quoted if r not in BASE_ROLES}

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.text.encode()).hexdigest()

    def render(self, messages: list[dict], add_generation_prompt: bool = False, tools=None) -> str:
        """The text of ``messages``, as ``apply_chat_template(tokenize=False)`` gives it;
        ``tools``: the JSON schemas of the tools the conversation may call, or None."""
        return "".join(self._generate(messages, add_generation_prompt, tools))

    def _generate(self, messages, add_generation_prompt, tools):
        return self._template.generate(
            messages=_normalise(messages),
            tools=tools,
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **{**self.specials, **(self.variables or {})},
        )

    def _generation_spans(self, messages, tools) -> Example:
        self._tracker.blocks, self._tracker.spans = [], []
        try:
            for block in self._generate(messages, False, tools):
                self._tracker.blocks.append(block)
            return "".join(self._tracker.blocks), list(self._tracker.spans)
        finally:
            self._tracker.blocks = None

    def render_spans(self, messages: list[dict], tools=None) -> Example:
        """The rendered text and the character spans [start, end) of the assistant's turns
        it renders after the conversation before them."""
        (example,) = self.render_examples(messages, tools, split=False)
        return example

    def render_examples(self, messages: list[dict], tools=None, split=None) -> list[Example]:
        """(text, answer spans) of the conversation: one example with every answer when the
        template renders each after the conversation before it with the generation prompt
        (or marks them with generation blocks), else one per answer (the conversation
        through it, that answer's span). ``split=True`` forces the second form;
        ``split=False`` the first, with the spans of the answers it renders so (the others
        left out, none refused).

        ValueError where an answer, rendered as the last turn, does not follow the
        conversation before it with the generation prompt."""
        turns = [i for i, m in enumerate(messages) if m.get("role") == "assistant"]
        if self.has_generation:
            if not split:
                return [self._generation_spans(messages, tools)]
            return [_last_span(self._generation_spans(messages[: i + 1], tools)) for i in turns]
        text = self.render(messages, tools=tools)
        pieces = []
        for i in turns:
            head = self.render(messages[:i], add_generation_prompt=True, tools=tools)
            through = self.render(messages[: i + 1], tools=tools)
            if not through.startswith(head):
                if split is False:
                    continue
                raise ValueError(
                    f"message {i}, an answer, does not follow the conversation before it with "
                    "the generation prompt as the template renders them (give the template "
                    "{% generation %} blocks around the assistant's text)"
                )
            pieces.append((head, through))
        placed = [(head, through) for head, through in pieces if text.startswith(through)]
        if split is None:
            split = len(placed) < len(turns)
        if not split:
            return [(text, [(len(head), len(through.rstrip())) for head, through in placed])]
        return [(through, [(len(head), len(through.rstrip()))]) for head, through in pieces]


def _last_span(example: Example) -> Example:
    text, spans = example
    return text, spans[-1:]


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__


def _configured_template(config: Path) -> str | None:
    try:
        raw = json.loads(config.read_text())
    except (OSError, ValueError):
        return None
    value = raw.get("chat_template")
    if isinstance(value, list):  # named templates: the one called "default"
        value = next((t.get("template") for t in value if t.get("name") == "default"), None)
    return value if isinstance(value, str) else None


def _specials(tokenizer) -> dict[str, str]:
    """The special token strings a template sees: those named in ``tokenizer_config.json``
    beside the tokenizer (what ``transformers`` passes), else the tokenizer's BOS and EOS."""
    named: dict[str, str] = {}
    for f in tokenizer.files:
        try:
            raw = json.loads((Path(f).parent / "tokenizer_config.json").read_text())
        except (OSError, ValueError):
            continue
        for key in _SPECIALS:
            value = raw.get(key)
            value = value.get("content") if isinstance(value, dict) else value
            if isinstance(value, str):
                named[key] = value
    tokens = getattr(tokenizer, "tokens", {})
    for key, i in (("bos_token", tokenizer.bos_id), ("eos_token", tokenizer.eos_id)):
        if key not in named and i in tokens:
            named[key] = tokens[i]
    return named


# The byte tokenizer's template (it has none saved beside it): ChatML's markers, spelled in
# bytes, each answer and its end-of-turn marker trained.
BYTES_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message.role == 'assistant' -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{% generation %}{{- message.content + '<|im_end|>' -}}{% endgeneration %}{{- '\\n' -}}"
    "{%- else -%}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


def load_template(cfg, tokenizer, role: str = "data", variables: dict | None = None):
    """The ``ChatTemplate`` of ``cfg.chat_template``, else the one saved beside the tokenizer
    ``cfg.tokenizer`` names (the byte tokenizer: ``BYTES_TEMPLATE``); ``role``: the config
    section of both (``data``; ``teacher`` for a teacher tokenizer of its own), for errors;
    ``variables``: those it is rendered with (default ``cfg.chat_template_kwargs``).

    A SentencePiece model is refused: it spells the special tokens a template writes
    (``<s>``, ``[INST]``, ...) out as text, where ``transformers`` gives their ids."""
    tok_key, key = f"{role}.tokenizer", f"{role}.chat_template"
    if variables is None:
        variables = getattr(cfg, "chat_template_kwargs", None)
    if tokenizer.kind == "sentencepiece":
        (path,) = tokenizer.files
        raise DistillError(
            f"{tok_key}: {path} is a SentencePiece model, which encodes the special tokens "
            "a chat template writes as plain text; chat data needs the model's tokenizer.json "
            "(AutoTokenizer.from_pretrained(DIR).save_pretrained(DIR) writes one)"
        )
    if cfg.chat_template is None and tokenizer.kind == "bytes":  # no template of its own
        where = "distill's ChatML (the byte tokenizer's)"
        return ChatTemplate(BYTES_TEMPLATE, where, {}, key, variables)
    if cfg.chat_template is not None:
        path = Path(cfg.chat_template).expanduser()
        if not path.is_file():
            raise DistillError(f"{key}: no such file: {path}")
        return ChatTemplate(path.read_text(), str(path), _specials(tokenizer), key, variables)
    for f in tokenizer.files:
        beside = Path(f).parent
        if (beside / "chat_template.jinja").is_file():
            path = beside / "chat_template.jinja"
            return ChatTemplate(path.read_text(), str(path), _specials(tokenizer), key, variables)
        text = _configured_template(beside / "tokenizer_config.json")
        if text is not None:
            where = str(beside / "tokenizer_config.json")
            return ChatTemplate(text, where, _specials(tokenizer), key, variables)
    raise DistillError(
        f"{key}: chat data needs a chat template and none is saved "
        f"beside {tok_key}={cfg.tokenizer} (chat_template.jinja, or chat_template in "
        f"tokenizer_config.json); set {key} to a .jinja file"
    )


def trained_tokens(offsets: np.ndarray, spans: list[tuple[int, int]]) -> np.ndarray:
    """[n] bool: the tokens whose character range [start, end) ([n, 2] ``offsets``) overlaps
    one of the sorted, disjoint ``spans``."""
    if not spans or not len(offsets):
        return np.zeros(len(offsets), dtype=bool)
    starts = np.array([s for s, _ in spans])
    ends = np.array([e for _, e in spans])
    j = np.searchsorted(ends, offsets[:, 0], side="right")  # first span ending after the start
    inside = j < len(spans)
    return inside & (offsets[:, 1] > starts[np.minimum(j, len(spans) - 1)])
