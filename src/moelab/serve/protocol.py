"""The request bodies `moelab serve` accepts, as pydantic models: OpenAI's field names,
types and ranges. A field OpenAI defines that the server does not implement is refused
(400) rather than ignored, unless it is at its no-op value, so nothing is silently wrong.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    field_validator,
)

MAX_STOPS = 4  # as OpenAI
MAX_LOGPROBS = 5  # top log-probs per position on /v1/completions, as OpenAI's legacy API


def _utf8(text: str) -> str:
    """JSON may escape a lone surrogate ("\\ud800"), which no tokenizer can encode: a 400
    naming it, not the tokenizer's TypeError as a 500."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise ValueError(f"not UTF-8 text (a lone surrogate at character {err.start})") from None
    return text


Text = Annotated[str, AfterValidator(_utf8)]
Temperature = Annotated[float, Field(ge=0, le=2)]
TopP = Annotated[float, Field(gt=0, le=1)]
Seed = Annotated[StrictInt, Field(ge=0, le=2**32 - 1)]


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    stop: str | Annotated[list[str], Field(max_length=MAX_STOPS)] | None = None
    n: Literal[1] = 1  # one choice per prompt: sample again with another seed for more
    stream: StrictBool = False
    seed: Seed = 0  # sampling is seeded: the same request gives the same text
    user: str | None = None  # accepted, unused
    presence_penalty: Literal[0] = 0  # penalties are not implemented
    frequency_penalty: Literal[0] = 0

    @field_validator("stop")
    @classmethod
    def _stops(cls, stop):
        return [_utf8(s) for s in ([stop] if isinstance(stop, str) else stop or [])]


class CompletionRequest(_Request):
    # a string, a list of token ids, or a batch of either (one choice each)
    prompt: str | list[StrictInt] | list[str] | list[list[StrictInt]]
    max_tokens: Annotated[StrictInt, Field(ge=0)] = 16
    logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    echo: StrictBool = False

    @field_validator("prompt")
    @classmethod
    def _text(cls, prompt):
        for text in [prompt] if isinstance(prompt, str) else prompt:
            if isinstance(text, str):
                _utf8(text)
        return prompt


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Text
    content: Text
    name: str | None = None  # accepted, unused


class ChatRequest(_Request):
    messages: list[Message]
    max_tokens: Annotated[StrictInt, Field(ge=1)] | None = None  # None: up to the context
    max_completion_tokens: Annotated[StrictInt, Field(ge=1)] | None = None  # newer name
    logprobs: Literal[False] | None = None  # not implemented for chat
