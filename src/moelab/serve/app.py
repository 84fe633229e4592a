"""The OpenAI-compatible HTTP API (FastAPI) over an `Engine`.

Concurrency: a request queue with slots. A request takes one of `slots` slots (asyncio's
semaphore: first come, first served) for as long as it decodes, and owns its KV cache,
sampling key and text in its own generator; the model itself runs on one worker thread,
one decoding step at a time, whichever request the step is for. So requests never share
state (outputs cannot mix), a long stream does not hold a short request back (their steps
interleave), and memory is bounded (at most `slots` KV caches). A slot is freed when its
request ends, including a client that goes away mid-stream: the stream's generator is
closed, which stops its decoding.

Errors: every 4xx/5xx answer is OpenAI's shape, {"error": {"message", "type", "param",
"code"}}; a bad request never gets a traceback.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException

from moelab.errors import UserError
from moelab.export.generate import TextStream
from moelab.serve.engine import Engine
from moelab.serve.protocol import ChatRequest, CompletionRequest

log = logging.getLogger("moelab.serve")


class ApiError(Exception):
    """A request the server refuses: HTTP status and OpenAI's error fields."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = \
            status, message, param, code, kind


def _error(status: int, message: str, param=None, code=None,
           kind: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param,
                                   "code": code}}, status_code=status)


class _Device:
    """The one thread the model runs on: each call is one step (or one forward)."""

    def __init__(self):
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="moelab-serve-model")

    async def run(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)


class _Stream(StreamingResponse):
    """A StreamingResponse that always closes its body generator, also when the client
    went away (Starlette then cancels the send loop and leaves the generator suspended),
    so the request's slot and decoding are released at once, not at garbage collection."""

    async def stream_response(self, send) -> None:
        try:
            await super().stream_response(send)
        finally:
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()


class _Decoding:
    """One prompt's decoding: the text pieces as they come, then finish_reason and the
    new token ids."""

    def __init__(self, engine: Engine, prompt_ids: list[int], max_tokens: int, req,
                 stop_ids: set[int]):
        self.engine, self.prompt_ids, self.max_tokens = engine, prompt_ids, max_tokens
        self.req, self.stop_ids = req, stop_ids
        self.text = TextStream(engine.decode, req.stop)
        self.new_ids: list[int] = []  # every token generated, a stop token included
        self.finish_reason = "length"

    async def pieces(self, device: _Device) -> AsyncIterator[str]:
        if self.max_tokens == 0:
            return
        tokens = self.engine.tokens(self.prompt_ids, self.max_tokens, self.req.temperature,
                                    self.req.top_p, self.req.seed, self.stop_ids)
        try:
            while (token := await device.run(next, tokens, None)) is not None:
                self.new_ids.append(token)
                if token in self.stop_ids:
                    self.finish_reason = "stop"
                    break
                if piece := self.text.push(token):
                    yield piece
                if self.text.stopped:
                    self.finish_reason = "stop"
                    break
            if tail := self.text.finish():
                yield tail
        finally:  # also on cancellation: stop the decoding on the model's thread
            with anyio.CancelScope(shield=True):
                await device.run(tokens.close)


def create_app(engine: Engine, slots: int = 1) -> FastAPI:
    """The app serving `engine`, with `slots` requests decoding at once."""
    app = FastAPI(title="moelab serve", docs_url=None, redoc_url=None)
    device = _Device()
    queue = asyncio.Semaphore(slots)
    created = int(time.time())

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, err: ApiError):
        return _error(err.status, err.message, err.param, err.code, err.kind)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, err: RequestValidationError):
        first = err.errors()[0]
        where = [str(p) for p in first.get("loc", ()) if p != "body"]
        field = ".".join(where) or "body"
        return _error(400, f"{field}: {first.get('msg', 'invalid')}", field or None)

    @app.exception_handler(UserError)
    async def _user_error(request: Request, err: UserError):
        return _error(400, str(err))

    @app.exception_handler(HTTPException)
    async def _http(request: Request, err: HTTPException):
        kind = "not_found_error" if err.status_code == 404 else "invalid_request_error"
        return _error(err.status_code, f"{request.method} {request.url.path}: {err.detail}",
                      kind=kind)

    @app.exception_handler(Exception)
    async def _crash(request: Request, err: Exception):  # uvicorn logs the traceback
        return _error(500, f"internal error ({type(err).__name__}); see the server's log",
                      kind="server_error")

    def check_model(name: str) -> None:
        if name != engine.name:
            raise ApiError(404, f"model {name!r} does not exist; this server serves "
                                f"{engine.name!r} (GET /v1/models)", "model",
                           "model_not_found")

    def check_length(n_prompt: int, max_tokens: int) -> None:
        if n_prompt + max_tokens > engine.context:
            raise ApiError(400, f"this model's maximum context length is {engine.context} "
                                f"tokens; the request asks for {n_prompt + max_tokens} "
                                f"({n_prompt} in the prompt, {max_tokens} for the "
                                "completion): shorten the prompt or lower max_tokens",
                           "max_tokens" if max_tokens else "prompt",
                           "context_length_exceeded")

    def prompt_ids(prompt) -> list[list[int]]:
        """Each prompt of the request as token ids."""
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            prompt = [prompt]
        if not prompt:
            raise ApiError(400, "prompt: must not be empty", "prompt")
        out = []
        for p in prompt:
            if isinstance(p, str):
                out.append(engine.encode(p))
                continue
            if not p:
                raise ApiError(400, "prompt: a list of token ids must not be empty", "prompt")
            bad = [t for t in p if not 0 <= t < engine.vocab_size]
            if bad:
                raise ApiError(400, f"prompt: token id {bad[0]} is outside the vocabulary "
                                    f"[0, {engine.vocab_size})", "prompt")
            out.append(list(p))
        return out

    def usage(n_prompt: int, n_new: int) -> dict:
        return {"prompt_tokens": n_prompt, "completion_tokens": n_new,
                "total_tokens": n_prompt + n_new}

    def sse(payload: dict | str) -> str:
        return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"

    async def stream_events(make_chunks) -> AsyncIterator[str]:
        """SSE lines: the chunks, then [DONE]; a failure mid-stream (the status is sent
        already) ends the stream with an error event."""
        async with queue:
            try:
                async for chunk in make_chunks():
                    yield sse(chunk)
            except Exception as err:  # noqa: BLE001 - reported to the client, then logged
                log.exception("stream failed")
                yield sse({"error": {"message": f"internal error ({type(err).__name__})",
                                     "type": "server_error", "param": None, "code": None}})
        yield sse("[DONE]")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{
            "id": engine.name, "object": "model", "created": created, "owned_by": "moelab",
            "max_model_len": engine.context, "step": engine.step}]}

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest):
        check_model(req.model)
        prompts = prompt_ids(req.prompt)
        if req.max_tokens > engine.context:
            raise ApiError(400, f"max_tokens: must be at most the context length "
                                f"{engine.context}, got {req.max_tokens}", "max_tokens")
        for ids in prompts:
            check_length(len(ids), req.max_tokens)
        if req.max_tokens == 0 and not req.echo:
            raise ApiError(400, "max_tokens: 0 needs echo=true (score the prompt)",
                           "max_tokens")
        stops = {engine.eos_id} if engine.eos_id is not None else set()
        rid, now = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        head = {"id": rid, "object": "text_completion", "created": now, "model": engine.name}
        if req.stream:
            if req.logprobs is not None or req.echo or len(prompts) > 1:
                raise ApiError(400, "stream: streaming takes one prompt, without logprobs "
                                    "or echo", "stream")
            decoding = _Decoding(engine, prompts[0], req.max_tokens, req, stops)

            async def chunks():
                async for piece in decoding.pieces(device):
                    yield {**head, "choices": [{"index": 0, "text": piece, "logprobs": None,
                                                "finish_reason": None}]}
                yield {**head, "choices": [{"index": 0, "text": "", "logprobs": None,
                                            "finish_reason": decoding.finish_reason}]}
            return _Stream(stream_events(chunks), media_type="text/event-stream")

        choices, n_prompt, n_new = [], 0, 0
        async with queue:
            for index, ids in enumerate(prompts):
                decoding = _Decoding(engine, ids, req.max_tokens, req, stops)
                text = "".join([p async for p in decoding.pieces(device)])
                logprobs = None
                if req.logprobs is not None:
                    logprobs = await device.run(_logprobs, engine, ids, decoding.new_ids,
                                                req.logprobs, req.echo)
                prefix = engine.decode(ids) if req.echo else ""
                choices.append({"index": index, "text": prefix + text, "logprobs": logprobs,
                                "finish_reason": decoding.finish_reason})
                n_prompt, n_new = n_prompt + len(ids), n_new + len(decoding.new_ids)
        return {**head, "choices": choices, "usage": usage(n_prompt, n_new)}

    @app.post("/v1/chat/completions")
    async def chat(req: ChatRequest):
        from moelab.data.chat import validate_messages

        check_model(req.model)
        if engine.chat_template is None:
            raise ApiError(400, f"model {engine.name!r} has no chat template (its corpus was "
                                "prepared without --chat-tokens); use /v1/completions",
                           "messages", "no_chat_template")
        try:
            messages = validate_messages([m.model_dump(exclude_none=True, exclude={"name"})
                                          for m in req.messages], "messages",
                                         final_assistant=False)
        except UserError as err:
            raise ApiError(400, str(err), "messages") from None
        if messages[-1]["role"] == "assistant":
            raise ApiError(400, "messages: the last turn must be the user's (the reply "
                                "comes next)", "messages")
        ids = engine.encode_chat(messages)
        asked = req.max_completion_tokens or req.max_tokens
        check_length(len(ids), asked or 1)
        max_tokens = asked or engine.context - len(ids)
        decoding = _Decoding(engine, ids, max_tokens, req, engine.chat_stop_ids())
        rid, now = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        head = {"id": rid, "created": now, "model": engine.name}
        if req.stream:
            chunk = {**head, "object": "chat.completion.chunk"}

            def delta(d: dict, finish=None) -> dict:
                return {**chunk, "choices": [{"index": 0, "delta": d, "logprobs": None,
                                              "finish_reason": finish}]}

            async def chunks():
                yield delta({"role": "assistant", "content": ""})
                async for piece in decoding.pieces(device):
                    yield delta({"content": piece})
                yield delta({}, decoding.finish_reason)
            return _Stream(stream_events(chunks), media_type="text/event-stream")

        async with queue:
            text = "".join([p async for p in decoding.pieces(device)])
        return {**head, "object": "chat.completion", "choices": [{
            "index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
            "finish_reason": decoding.finish_reason}], "usage": usage(len(ids),
                                                                      len(decoding.new_ids))}

    # vLLM's tokenizer endpoints: lm-evaluation-harness's `remote` tokenizer backend reads
    # them, so `local-completions` needs no tokenizer files (nor the network)
    @app.get("/tokenizer_info")
    async def tokenizer_info():
        from moelab.data.tokenizer import EOS

        return {"eos_token": EOS, "bos_token": None, "pad_token": None,
                "chat_template": engine.chat_template, "model_max_length": engine.context}

    @app.post("/tokenize")
    async def tokenize(body: dict):
        text = body.get("prompt")
        if not isinstance(text, str):
            raise ApiError(400, "prompt: must be a string", "prompt")
        ids = engine.tokenizer.encode(text, add_special_tokens=False).ids
        return {"tokens": ids, "count": len(ids), "max_model_len": engine.context}

    @app.post("/detokenize")
    async def detokenize(body: dict):
        ids = body.get("tokens")
        if not isinstance(ids, list) or not all(isinstance(t, int) and
                                                0 <= t < engine.vocab_size for t in ids):
            raise ApiError(400, f"tokens: must be a list of ids in [0, {engine.vocab_size})",
                           "tokens")
        return {"prompt": engine.decode(ids)}

    return app


def _logprobs(engine: Engine, prompt: list[int], new: list[int], k: int, echo: bool) -> dict:
    """OpenAI's legacy logprobs object for the new tokens (and the prompt's, with echo),
    from one forward pass over prompt + new (the model's distribution: temperature 1)."""
    scores = engine.score(prompt + new, k)
    start = 0 if echo else len(prompt)
    ids = (prompt + new)[start:]
    tokens = [engine.decode([t]) for t in ids]
    offsets, at = [], 0
    for text in tokens:
        offsets.append(at)
        at += len(text)
    top = [None if t is None else {engine.decode([i]): lp for i, lp in t}
           for t in scores.top[start:]]
    return {"tokens": tokens, "token_logprobs": scores.token_logprobs[start:],
            "top_logprobs": top, "text_offset": offsets}
