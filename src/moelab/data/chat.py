"""Conversations: OpenAI-format `messages`, a ChatML template, the loss mask and packing.

A conversation is a list of {"role", "content"} turns (system first if any, then user and
assistant alternating, ending on an assistant turn for training). The Jinja template below
renders it as ChatML; the assistant's content and its closing <|im_end|> sit inside
`{% generation %}...{% endgeneration %}`, the marks `transformers` reads for
`return_assistant_tokens_mask`. `encode_chat` renders with the same Jinja settings as
`transformers` (trim_blocks, lstrip_blocks, a sandbox), records where each generation
block lands in the rendered text, and maps those character spans to tokens: the loss mask
comes from the template, never from searching the text, so a template that marks other
tokens trains on those. The template is stored beside the tokenizer (CHAT_TEMPLATE_FILE in
the dataset directory, written by `moelab data prepare --chat-tokens`), exported into
tokenizer_config.json, and found again by `chat_template_of`.

Packing: conversations are laid end to end into rows of seq_len + 1 tokens, each with a
segment id (1, 2, ... in the row; 0 for padding) and positions that restart at 0 in each,
so attention stays inside a conversation and RoPE sees each as if it began the row.
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np

from moelab.errors import UserError
from moelab.schema import bounded, brief

SPECIAL_TOKENS = ("<|im_start|>", "<|im_end|>")
END_OF_TURN = "<|im_end|>"  # the stop token of a chat reply
CHAT_TEMPLATE_FILE = "chat_template.jinja"  # beside tokenizer.json in a dataset directory
ROLES = ("system", "user", "assistant")

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['role'] == 'assistant' %}"
    "{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\n' }}"
    "{% else %}"
    "{{ message['content'] + '<|im_end|>' + '\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def validate_messages(messages: object, where: str, *, final_assistant: bool = True
                      ) -> list[dict]:
    """The turns as [{"role", "content"}] once they are a conversation: a list of mappings
    with a known role and non-empty string content, an optional system turn first, then
    user and assistant alternating from user; ending on an assistant turn unless
    final_assistant is False (a prompt). Anything else is a UserError naming `where`."""
    def bad(problem: str) -> UserError:
        return UserError(bounded(f"{where}: {problem}"))

    if not isinstance(messages, list) or not messages:
        raise bad(f"'messages' must be a non-empty list of turns, got {brief(messages)}")
    turns = []
    for i, turn in enumerate(messages):
        if not isinstance(turn, dict):
            raise bad(f"turn {i} must be an object with role and content, got {brief(turn)}")
        role, content = turn.get("role"), turn.get("content")
        if role not in ROLES:
            raise bad(f"turn {i}: role {brief(role)} must be one of {', '.join(ROLES)}")
        if not isinstance(content, str) or not content.strip():
            raise bad(f"turn {i} ({role}): content must be a non-empty string, "
                      f"got {brief(content)}")
        turns.append({"role": role, "content": content})
    body = turns[1:] if turns[0]["role"] == "system" else turns
    for i, turn in enumerate(body):
        expected = "user" if i % 2 == 0 else "assistant"
        if turn["role"] != expected:
            at = i + len(turns) - len(body)
            raise bad(f"turn {at}: role {turn['role']} where {expected} was expected (an "
                      "optional system turn first, then user and assistant alternating)")
    if not body:
        raise bad("the conversation has only a system turn; add a user turn")
    if final_assistant and body[-1]["role"] != "assistant":
        raise bad("the last turn must be the assistant's (the reply trained on)")
    return turns


@lru_cache(maxsize=1)
def _generation_tracker():
    """A Jinja extension class for `{% generation %}...{% endgeneration %}`: it renders its
    body and, while `track_generation` is active, records the body's [start, end) in the
    rendered text, as transformers' AssistantTracker does, so both find the same spans.
    (Built on first use, so importing moelab.data does not import jinja2.)"""
    from jinja2 import nodes
    from jinja2.ext import Extension

    class GenerationTracker(Extension):
        tags = {"generation"}

        def __init__(self, env):
            super().__init__(env)
            self.tracking: ContextVar = ContextVar("generation_spans", default=None)
            env.extend(track_generation=self.track)

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_mark"), [], [], body).set_lineno(lineno)

        def _mark(self, caller):
            text = caller()
            if (state := self.tracking.get()) is not None:
                blocks, spans = state
                start = sum(len(b) for b in blocks)
                spans.append((start, start + len(text)))
            return text

        @contextmanager
        def track(self, blocks: list[str], spans: list[tuple[int, int]]):
            token = self.tracking.set((blocks, spans))
            try:
                yield
            finally:
                self.tracking.reset(token)

    return GenerationTracker


@lru_cache(maxsize=8)
def compile_template(template: str):
    """The template compiled as transformers compiles chat templates (sandboxed,
    trim_blocks, lstrip_blocks); a syntax error is a UserError."""
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_generation_tracker(),
                                                    "jinja2.ext.loopcontrols"])
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as err:
        raise UserError(f"chat template: {err.message} (line {err.lineno}); fix the template"
                        ) from None


def render_chat(messages: list[dict], *, add_generation_prompt: bool = False,
                template: str = CHAT_TEMPLATE) -> tuple[str, list[tuple[int, int]]]:
    """(the rendered text, [start, end) of each generation block in it)."""
    import jinja2

    compiled = compile_template(template)
    blocks: list[str] = []
    spans: list[tuple[int, int]] = []
    try:
        with compiled.environment.track_generation(blocks, spans):
            for block in compiled.generate(messages=messages,
                                           add_generation_prompt=add_generation_prompt):
                blocks.append(block)
    except jinja2.TemplateError as err:
        raise UserError(f"chat template failed to render: {err}; fix the template") from None
    return "".join(blocks), spans


def encode_chat(tokenizer, messages: list[dict], *, add_generation_prompt: bool = False,
                template: str = CHAT_TEMPLATE) -> tuple[list[int], list[int]]:
    """(token ids, assistant mask): the mask is 1 on every token that a generation block
    of the template covers (the assistant's content and its <|im_end|>). `tokenizer` is a
    `tokenizers.Tokenizer` holding SPECIAL_TOKENS (`require_chat_tokens`)."""
    text, spans = render_chat(messages, add_generation_prompt=add_generation_prompt,
                              template=template)
    encoding = tokenizer.encode(text, add_special_tokens=False)
    mask = [0] * len(encoding.ids)
    for start, end in spans:  # the tokens holding the span's first and last characters
        if end <= start:
            continue
        first, last = encoding.char_to_token(start), encoding.char_to_token(end - 1)
        if first is None or last is None:
            raise UserError("chat template: a generation block ends inside a token the "
                            "tokenizer merged across it; end the block at a special token")
        mask[first:last + 1] = [1] * (last + 1 - first)
    return encoding.ids, mask


def require_chat_tokens(tokenizer, where: str | Path) -> None:
    """A UserError unless the tokenizer holds every chat special token as one token."""
    missing = [t for t in SPECIAL_TOKENS if tokenizer.token_to_id(t) is None]
    if missing:
        raise UserError(f"{where}: the tokenizer lacks the chat token(s) {missing}; prepare "
                        "the corpus with `moelab data prepare --chat-tokens` and pre-train "
                        "on it")


def chat_template_of(data_dir: str | Path) -> str:
    """The chat template stored with a dataset's tokenizer (CHAT_TEMPLATE_FILE). A run
    finds it through its config: `chat_template_of(data_dir(cfg.data.path))`."""
    path = Path(data_dir) / CHAT_TEMPLATE_FILE
    if not path.is_file():
        raise UserError(f"{path} is missing: the corpus has no chat template; prepare it with "
                        "`moelab data prepare --chat-tokens` and pre-train on it")
    template = path.read_text()
    compile_template(template)  # a broken template fails here, not mid-request
    return template


@dataclass(frozen=True)
class Conversation:
    """One validated conversation and where it came from (file:line, its provenance)."""

    messages: list[dict]
    where: str
    source: str = ""


def read_conversations(path: str | Path) -> list[Conversation]:
    """The conversations of an OpenAI-format JSONL file: one {"messages": [...]} object a
    line (other keys kept as provenance: "source"); blank lines skipped. A bad line is a
    UserError naming file:line."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path}: no such conversations file; build one with "
                        "`moelab data sft-set --out DIR`")
    out = []
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise UserError(f"{where}: not JSON ({err.msg}); write one object a line"
                                ) from None
            if not isinstance(record, dict) or "messages" not in record:
                raise UserError(f"{where}: expected an object with 'messages', got "
                                f"{brief(record)}")
            out.append(Conversation(validate_messages(record["messages"], where), where,
                                    str(record.get("source", ""))))
    if not out:
        raise UserError(f"{path}: holds no conversations")
    return out


def encode_all(tokenizer, conversations: list[Conversation], seq_len: int,
               template: str = CHAT_TEMPLATE) -> list[tuple[list[int], list[int]]]:
    """encode_chat of each; one longer than a row (seq_len + 1 tokens) is a UserError."""
    encoded = []
    for conv in conversations:
        ids, mask = encode_chat(tokenizer, conv.messages, template=template)
        if len(ids) > seq_len + 1:
            raise UserError(f"{conv.where}: the conversation is {len(ids)} tokens, longer than "
                            f"a row of seq_len + 1 = {seq_len + 1}; raise data.seq_len or "
                            "drop the conversation")
        encoded.append((ids, mask))
    return encoded


@dataclass(frozen=True)
class Packed:
    """Rows of seq_len + 1 tokens, int32 [R, S+1] each. Inputs are tokens[:, :-1] and
    targets tokens[:, 1:]; a target counts when its loss_mask is 1."""

    tokens: np.ndarray
    segments: np.ndarray  # 1, 2, ... per conversation in the row; 0 = padding
    positions: np.ndarray  # restart at 0 in each conversation
    loss_mask: np.ndarray  # 1 on assistant tokens (as targets)

    def batch(self, rows: np.ndarray) -> dict[str, np.ndarray]:
        """The batch of these rows, the layout the train step takes."""
        return {"tokens": self.tokens[rows], "segments": self.segments[rows],
                "positions": self.positions[rows], "loss_mask": self.loss_mask[rows]}

    def __len__(self) -> int:
        return len(self.tokens)


def pack(encoded: list[tuple[list[int], list[int]]], seq_len: int, pad_id: int) -> Packed:
    """Conversations laid into rows of seq_len + 1 in order, a new row when the next does
    not fit (no conversation is split); the rest of a row is padding (segment 0, mask 0).
    Deterministic: the same conversations give the same rows."""
    width = seq_len + 1
    rows: list[list[tuple[list[int], list[int]]]] = []
    used = width
    for ids, mask in encoded:
        if len(ids) > width:
            raise UserError(f"a conversation of {len(ids)} tokens does not fit a row of "
                            f"{width}; raise data.seq_len")
        if used + len(ids) > width:
            rows.append([])
            used = 0
        rows[-1].append((ids, mask))
        used += len(ids)
    shape = (len(rows), width)
    tokens = np.full(shape, pad_id, np.int32)
    segments, positions, loss_mask = (np.zeros(shape, np.int32) for _ in range(3))
    for r, row in enumerate(rows):
        at = 0
        for segment, (ids, mask) in enumerate(row, 1):
            end = at + len(ids)
            tokens[r, at:end], loss_mask[r, at:end] = ids, mask
            segments[r, at:end], positions[r, at:end] = segment, np.arange(len(ids))
            at = end
    return Packed(tokens, segments, positions, loss_mask)

