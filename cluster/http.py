"""The OpenAI-compatible HTTP API: `/v1/models`, `/v1/completions`, `/v1/chat/completions`, and
vLLM's `/health`, `/ping`, `/version`, `/tokenize` and `/detokenize`.

A FastAPI app over one `Router` replica, which Serve mounts as that deployment's ingress
(`RouterDeployment.__serve_build_asgi_app__`), so the HTTP proxy reaches it under the app's
`route_prefix` (`http://HOST:PORT/v1/...` with the default prefix "/"). `GET /health` (and
`/ping`) answers 200 once a verifier replica answers, 503 before; `GET /version` the version. A request body becomes the router's
`schema.Request` here (`_Body.request_args`) and streams through the transport-neutral core
(`Router.generate`): the same bearer-token check (header `Authorization: Bearer <token>`),
validation, admission and coalescing as gRPC. A request's deadline: the `X-Request-Timeout`
header (seconds), else `router.request_timeout_s`. A client that disconnects mid-stream ends its
stream: the router cancels the generation (unless coalesced callers remain), which frees its KV.

Beside OpenAI's fields (`max_tokens`, chat's `max_completion_tokens`, `temperature`, `top_p`,
`stop`, `seed`, `stream`, `stream_options.include_usage`, `logprobs` with chat's `top_logprobs`:
the target's log-probabilities after penalties, grammar, temperature and top-k/top-p, exact under
speculation; `n` up to MAX_N choices, independent generations, seeded seed, seed + 1, ...:
reproducible; `presence_penalty`, `frequency_penalty`; `response_format` json_object /
json_schema) a body may carry vLLM's `ignore_eos`, `repetition_penalty` (actors/penalties.py:
lossless under speculation), `return_token_ids` and structured outputs (`structured_outputs` with json, regex, choice or
grammar, and `disable_any_whitespace` for compact JSON, or the older `guided_json`, `guided_regex`, `guided_choice`,
`guided_grammar`: see actors/grammar.py, lossless under speculation), and specd's controls: `draft`, `gamma` (0..16 or "auto"), `tree`,
`threshold`, `entropy_gate`, `acceptance`, `top_k`, `num_beams`, `length_penalty`,
`early_stopping`, `request_id` (for Abort). As vLLM does, a field the server does not know is
accepted and named in one warning log line per request. A field that would change the output in
a way this server cannot honour yet (`tools`, `tool_choice` other than "none", `logit_bias`,
`min_tokens`, ...: `UNSUPPORTED`) is refused
by name (400) unless it holds its neutral value.
A completions `prompt` is text, or a list of token ids.

The response (or, streamed as server-sent events, the chunk that carries `finish_reason`) holds
`usage` and `spec_decode_metrics`: vLLM's per-request speculation counters (`num_drafts`,
`num_draft_tokens`, `num_accepted_tokens`, `num_accepted_tokens_per_pos`) and the rates it
derives (`mean_acceptance_length` = 1 + accepted / drafts, `draft_acceptance_rate`,
`acceptance_rate_per_pos`), plus `num_draft_tokens_per_pos` (the per-position denominators).
Errors are OpenAI's shape, {"error": {"message", "type", "param", "code"}}: 400 (validation;
the message names the field and the limit, `param` the body field), 401 (bearer token), 404
(unknown model), 429 (over `router.max_queue`), 503 (no verifier replica running), 500 (with an
incident id in the router's log). An error after a stream started arrives as a last event with
that shape, before `data: [DONE]`.

Does not know: tokenization, limits or admission (the router's), or gRPC (statuses are the
router's `Status`).
"""
from __future__ import annotations

import asyncio
import importlib.metadata
import json
import logging
import re
import time
from typing import Annotated, Any, Callable, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, model_validator

from actors.grammar import compact_json
from actors.schema import AUTO, MAX_GAMMA, MAX_SEED, Delta, SamplingParams, SpecStats, SpeculationParams

from .router import Router, RouterError, Status

log = logging.getLogger("specd.http")

INT32 = 2 ** 31 - 1
Int32 = Annotated[int, Field(ge=-INT32 - 1, le=INT32)]
TokenId = Annotated[int, Field(ge=0, le=2 ** 32 - 1)]

# the router's status -> HTTP status, OpenAI error type, OpenAI error code
STATUS = {
    Status.INVALID_ARGUMENT: (400, "invalid_request_error", None),
    Status.UNAUTHENTICATED: (401, "invalid_request_error", "invalid_api_key"),
    Status.NOT_FOUND: (404, "invalid_request_error", "model_not_found"),
    Status.RESOURCE_EXHAUSTED: (429, "rate_limit_error", "rate_limit_exceeded"),
    Status.UNAVAILABLE: (503, "server_error", "not_ready"),
    Status.DEADLINE_EXCEEDED: (504, "server_error", "timeout"),
}
INTERNAL = (500, "server_error", None)
try:
    VERSION = importlib.metadata.version("specd")
except importlib.metadata.PackageNotFoundError:  # run from a checkout without installing
    VERSION = "0+unknown"
TIMEOUT_HEADER = "x-request-timeout"  # seconds the request may run
MAX_N = 16  # choices per request
# the field a router message starts with (its path in the wire API: "sampling.max_tokens must be ...")
_PARAM = re.compile(r"^(?:(?:sampling|speculation|token_ids)\.)?(\w+)")


def _off(v) -> bool:
    return v is None or v is False or v == 0 or v == [] or v == {} or v == ""


# Fields that change the output in a way this server cannot honour yet: each is refused by name
# unless it holds its neutral value (what the predicate accepts).
UNSUPPORTED: dict[str, Callable[[Any], bool]] = {
    "tools": _off, "functions": _off, "tool_choice": lambda v: v in (None, "none"),
    "function_call": lambda v: v in (None, "none"),
    "prompt_logprobs": lambda v: v is None,
    "best_of": lambda v: v in (None, 1),
    "logit_bias": _off, "min_tokens": _off, "echo": _off, "suffix": _off,
}


class _Body(BaseModel):
    """What both endpoints accept. Ranges are the router's to check (the schema's messages name
    them); only what the wire cannot carry is bounded here. Other fields are kept as extras
    (`unsupported`, `ignored`)."""
    model_config = ConfigDict(extra="allow")
    model: str
    max_tokens: Int32 | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    stream_options: dict | None = None  # {"include_usage": true}: a last chunk with the usage, no choices
    stop: str | list[str] | None = None
    seed: Annotated[int, Field(ge=0, le=MAX_SEED)] | None = None
    n: Int32 | None = None  # choices: independent generations (seeded: seed, seed + 1, ...)
    ignore_eos: bool = False
    presence_penalty: float | None = None  # OpenAI's, in [-2, 2]
    frequency_penalty: float | None = None  # OpenAI's, in [-2, 2]
    repetition_penalty: float | None = None  # vLLM's extension (Hugging Face's), in (0, 10]
    # Structured output: OpenAI's response_format, vLLM's structured_outputs and its older guided_* fields.
    response_format: dict | None = None
    structured_outputs: dict | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    @model_validator(mode="after")
    def _one_grammar(self):
        self.grammar()  # (a 400 when malformed or when two grammars are given)
        return self

    def grammar(self) -> tuple[str, str] | None:
        """SamplingParams.grammar from whichever structured-output field the body uses."""
        found = []
        rf = self.response_format
        if rf is not None:
            kind = rf.get("type")
            if kind == "json_object":
                found.append(("json_object", ""))
            elif kind == "json_schema":
                schema = (rf.get("json_schema") or {}).get("schema")
                if not isinstance(schema, dict):
                    raise ValueError("response_format.json_schema.schema must be a JSON schema object")
                found.append(("json_schema", json.dumps(schema)))
            elif kind != "text":
                raise ValueError(f"response_format.type must be text, json_object or json_schema, got {kind!r}")
        so = dict(self.structured_outputs or {})
        compact = bool(so.pop("disable_any_whitespace", False))  # vLLM's: JSON without optional whitespace
        for name, value in (("json", self.guided_json), ("regex", self.guided_regex), ("choice", self.guided_choice),
                            ("grammar", self.guided_grammar)):
            if value is not None:
                so[name] = value
        for name, value in so.items():
            if name == "json":
                found.append(("json_schema", value if isinstance(value, str) else json.dumps(value)))
            elif name == "choice":
                found.append(("choice", json.dumps(value)))
            elif name in ("regex", "grammar"):
                found.append((name, value))
            elif value not in (None, False):
                raise ValueError(f"structured_outputs.{name} is not supported (json, regex, choice, grammar)")
        if len(found) > 1:
            raise ValueError("give one structured output: response_format, structured_outputs or a guided_* field")
        if compact and found and found[0][0] in ("json_schema", "json_object"):
            found[0] = ("json_schema", compact_json(found[0][1] or '{"type": "object"}'))
        return found[0] if found else None
    # specd's controls
    top_k: Annotated[int, Field(ge=0, le=INT32)] | None = None
    num_beams: Annotated[int, Field(ge=0, le=2 ** 32 - 1)] | None = None
    length_penalty: float | None = None
    early_stopping: bool | None = None
    draft: str | None = None
    gamma: Int32 | Literal["auto"] | None = None
    tree: Int32 | None = None
    threshold: float | None = None
    entropy_gate: float | None = None
    acceptance: str | None = None
    request_id: str | None = None
    return_token_ids: bool = False  # vLLM's extension: each choice also carries the generated token ids

    def source(self) -> dict:
        """The input, as `Router.request` takes it."""
        raise NotImplementedError

    def logprobs_k(self) -> int | None:
        """SamplingParams.logprobs: None (off) or the alternatives per token."""
        raise NotImplementedError

    def unsupported(self) -> str | None:
        """The first extra field that would change the output in a way this server cannot honour."""
        return next((k for k, v in (self.model_extra or {}).items() if k in UNSUPPORTED and not UNSUPPORTED[k](v)),
                    None)

    def ignored(self) -> list[str]:
        """Extra fields accepted without effect (known-neutral or unknown)."""
        return sorted(self.model_extra or {})

    @property
    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))

    def request_args(self, choice: int = 0) -> dict:
        """`Router.request`'s keywords for choice `choice` (of `n`): the body's fields as the
        schema's parameters, unset ones None (or the schema's neutral value) so that the router
        applies its defaults, as it does for a GenerateRequest without them (`cluster.wire`).
        Choice i of a seeded request samples with seed + i: the choices are independent samples,
        and the same request reproduces them."""
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        seed = None if self.seed is None else (self.seed + choice) % (MAX_SEED + 1)
        rid = f"{self.request_id}/{choice}" if self.request_id and (self.n or 1) > 1 else self.request_id or ""
        sampling = SamplingParams(
            max_tokens=self.max_tokens, temperature=0.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p, top_k=self.top_k or 0, seed=seed, stop=stop,
            num_beams=1 if self.num_beams is None else self.num_beams,
            length_penalty=1.0 if self.length_penalty is None else self.length_penalty,
            early_stopping=bool(self.early_stopping), ignore_eos=self.ignore_eos, logprobs=self.logprobs_k(),
            grammar=self.grammar(), presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty)
        speculation = SpeculationParams(
            draft=self.draft or None, gamma=AUTO if self.gamma == "auto" else self.gamma, tree=self.tree,
            threshold=self.threshold, entropy_gate=self.entropy_gate, acceptance=self.acceptance or "lossless")
        return {"request_id": rid, "sampling": sampling, "speculation": speculation, **self.source()}


class CompletionBody(_Body):
    prompt: str | list[TokenId]
    logprobs: Int32 | None = None  # the chosen tokens' log-probabilities and the k likeliest's

    def logprobs_k(self) -> int | None:
        return self.logprobs

    def source(self) -> dict:
        return {"prompt": self.prompt} if isinstance(self.prompt, str) else {"token_ids": self.prompt}


class _TextPart(BaseModel):
    type: Literal["text"]  # (an image or audio part: a 400 naming it)
    text: str


class _Message(BaseModel):
    model_config = ConfigDict(extra="ignore")  # name, tool_call_id, ...: accepted, unused
    role: str
    content: str | list[_TextPart]

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


def _turns(messages: list[_Message]) -> list[dict]:
    """Chat messages as `Router.encode` takes them."""
    return [{"role": m.role, "content": m.text} for m in messages]


class ChatBody(_Body):
    messages: list[_Message]
    max_completion_tokens: Int32 | None = None  # OpenAI's newer name for max_tokens; wins when both are set
    logprobs: bool | None = None
    top_logprobs: Int32 | None = None  # with logprobs: the k likeliest tokens' too

    @model_validator(mode="after")
    def _max_completion_tokens(self):
        if self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    def logprobs_k(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def source(self) -> dict:
        return {"messages": _turns(self.messages)}


_BODY_FIELDS = {*CompletionBody.model_fields, *ChatBody.model_fields}


class TokenizeBody(BaseModel):
    """vLLM's `/tokenize`: a prompt, or chat messages (with the generation prompt, as a chat request
    is fed). vLLM's other fields (add_special_tokens, return_token_strs, ...) are accepted and unused:
    the ids are the ones the server feeds the model for the same input."""
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    prompt: str | None = None
    messages: list[_Message] | None = None


class DetokenizeBody(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    tokens: list[TokenId]


def error_body(code: Status | None, message: str, param: str | None = None) -> tuple[int, dict]:
    """(HTTP status, OpenAI's error object) for a router status and its message; a 400's `param`
    is the body field the message starts with, unless given."""
    status, kind, err_code = STATUS.get(code, INTERNAL)
    if status == 400 and param is None:
        m = _PARAM.match(message)
        name = m.group(1) if m else None
        param = "prompt" if name in ("token_ids", "ids") else name if name in _BODY_FIELDS else None
    return status, {"error": {"message": message, "type": kind, "param": param, "code": err_code}}


def _error(code: Status | None, message: str, param: str | None = None) -> JSONResponse:
    status, body = error_body(code, message, param)
    return JSONResponse(body, status_code=status)


def _refusal(err: RouterError) -> JSONResponse:
    return _error(err.status, err.message)


def _timeout(request: Request) -> float | None:
    """The X-Request-Timeout header's seconds (a malformed or non-positive value: 400)."""
    raw = request.headers.get(TIMEOUT_HEADER)
    if raw is None:
        return None
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise RouterError(Status.INVALID_ARGUMENT, f"header X-Request-Timeout must be a positive number of "
                                                   f"seconds, got {raw!r}")
    return value


def spec_decode_metrics(st: SpecStats | None) -> dict:
    """One request's speculation counters and rates, in vLLM's names."""
    st = st or SpecStats()
    n = sum(1 for j in range(MAX_GAMMA) if st.drafted_per_pos[j])  # drafted positions: a prefix
    return {"num_drafts": st.drafts, "num_draft_tokens": st.draft_tokens, "num_accepted_tokens": st.accepted_tokens,
            "num_accepted_tokens_per_pos": st.accepted_per_pos[:n], "num_draft_tokens_per_pos": st.drafted_per_pos[:n],
            "mean_acceptance_length": st.mean_accepted_length, "draft_acceptance_rate": st.acceptance_rate,
            "acceptance_rate_per_pos": st.per_position()}


def _final_fields(lasts: list[Delta]) -> dict:
    """The usage and speculation metrics of a response's choices (their last deltas): the prompt
    once, the completions and the speculation counters summed."""
    stats = SpecStats()
    for d in lasts:
        if d.stats is not None:
            stats.add(d.stats)
    prompt, completion = lasts[0].prompt_tokens, sum(d.completion_tokens for d in lasts)
    return {"usage": {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion},
            "spec_decode_metrics": spec_decode_metrics(stats)}


def build_http_app(router: Router) -> FastAPI:
    """The FastAPI app serving the OpenAI-compatible API over `router` (a `cluster.router.Router`)."""
    app = FastAPI(title="specd", docs_url=None, redoc_url=None, openapi_url=None)
    model = router.cfg.served_name

    @app.exception_handler(RequestValidationError)
    async def _invalid(_, exc: RequestValidationError):
        locs = [".".join(str(x) for x in e["loc"] if x != "body") for e in exc.errors()]
        message = "; ".join(f"{loc}: {e['msg']}" for loc, e in zip(locs, exc.errors()))
        return _error(Status.INVALID_ARGUMENT, message, param=locs[0].split(".")[0] if locs else None)

    @app.get("/v1/models")
    async def models(request: Request):
        try:
            router.authorize(request.headers.get("authorization"))
        except RouterError as e:
            return _refusal(e)
        m = router.models()
        return {"object": "list", "data": [{
            "id": m["target"], "object": "model", "created": int(router.started), "owned_by": "specd",
            "max_model_len": m["context_length"],
            "drafts": [{k: d[k] for k in ("name", "kind", "default", "placement", "default_gamma")}
                       for d in m["drafts"]]}]}

    def admit(request: Request, name: str | None) -> str | JSONResponse:
        """The caller's tenant, or the refusal: a bad token (401), another model (404)."""
        try:
            tenant = router.authorize(request.headers.get("authorization"))
        except RouterError as e:
            return _refusal(e)
        if name is not None and name != model:
            return _error(Status.NOT_FOUND, f"model {name!r} does not exist; this server serves "
                                            f"{model!r} (GET /v1/models)")
        return tenant

    async def serve_body(request: Request, body: _Body, chat: bool):
        tenant = admit(request, body.model)
        if isinstance(tenant, JSONResponse):
            return tenant
        try:
            timeout_s = router.timeout_s(_timeout(request))
        except RouterError as e:
            return _refusal(e)
        bad = body.unsupported()
        if bad is not None:
            return _error(Status.INVALID_ARGUMENT, f"{bad} is not supported by this server (got "
                                                   f"{body.model_extra[bad]!r}); leave it unset", param=bad)
        if body.ignored():
            log.warning("request fields ignored (not used by this server): %s", ", ".join(body.ignored()))
        n = 1 if body.n is None else body.n
        if not 1 <= n <= MAX_N:
            return _error(Status.INVALID_ARGUMENT, f"n must be in [1, {MAX_N}], got {n}", param="n")
        if n > 1 and (body.num_beams or 1) > 1:
            return _error(Status.INVALID_ARGUMENT, "n > 1 is not supported with num_beams > 1", param="n")
        if not await router.serving():
            return _error(Status.UNAVAILABLE, "not ready: no verifier replica is running yet; retry later")
        # Every choice is its own generation, all running at once (each in its router task, its chunks
        # buffered there): they are answered one after the other. (Greedy choices coalesce into one.)
        streams, firsts = [], []
        try:  # each first message, or the refusal: validation, admission
            for i in range(n):
                streams.append(router.generate(await router.request(**body.request_args(i), tenant=tenant), timeout_s))
                firsts.append((await anext(streams[-1]))[0])
        except Exception as e:
            for st in streams:
                await st.aclose()
            return _refusal(router.failure(e))
        rid = firsts[0].request_id if n == 1 else firsts[0].request_id.rsplit("/", 1)[0]  # ("id/0": choice 0)
        head = {"id": ("chatcmpl-" if chat else "cmpl-") + rid, "created": int(time.time()), "model": model}
        if body.stream:
            return StreamingResponse(_events(router, firsts, streams, head, chat, body.return_token_ids,
                                             body.include_usage), media_type="text/event-stream")
        answers = []
        try:
            for first, st in zip(firsts, streams):
                answers.append([first] + [d async for d, _ in st])
        except Exception as e:
            return _refusal(router.failure(e))
        finally:
            for st in streams:
                await st.aclose()
        choices = []
        for i, deltas in enumerate(answers):
            last, text = deltas[-1], "".join(d.text for d in deltas)
            choice = {"index": i, "logprobs": _logprobs(router, deltas, chat), "finish_reason": last.finish_reason,
                      "stop_reason": last.stop_string or None}
            choice.update({"message": {"role": "assistant", "content": text}} if chat else {"text": text})
            if body.return_token_ids:
                choice["token_ids"] = [t for d in deltas for t in d.token_ids]
            choices.append(choice)
        return {**head, "object": "chat.completion" if chat else "text_completion", "choices": choices,
                **_final_fields([a[-1] for a in answers])}

    @app.get("/health")
    async def health():
        """vLLM's readiness check: 200 once a verifier replica answers, 503 before."""
        return Response(status_code=200 if await router.serving() else 503)

    @app.api_route("/ping", methods=["GET", "POST"])
    async def ping():
        return await health()

    @app.get("/version")
    async def version():
        return {"version": VERSION}

    @app.post("/tokenize")
    async def tokenize(request: Request, body: TokenizeBody):
        """vLLM's: the prompt's token ids as this server feeds them to the model (load generators such as
        `vllm bench serve` check their own tokenizer's prompt lengths against it)."""
        refused = admit(request, body.model)
        if isinstance(refused, JSONResponse):
            return refused
        try:  # (both or neither of prompt and messages: the router's 400)
            ids = await asyncio.to_thread(router.encode, prompt=body.prompt,
                                          messages=None if body.messages is None else _turns(body.messages))
        except ValueError as e:
            return _error(Status.INVALID_ARGUMENT, str(e), param="messages" if body.messages else "prompt")
        return {"count": len(ids), "max_model_len": router.cfg.max_len, "tokens": ids, "token_strs": None}

    @app.post("/detokenize")
    async def detokenize(request: Request, body: DetokenizeBody):
        """vLLM's: the text of token ids."""
        refused = admit(request, body.model)
        if isinstance(refused, JSONResponse):
            return refused
        vocab = router.limits.vocab_size
        bad = next((i for i, t in enumerate(body.tokens) if vocab is not None and t >= vocab), None)
        if bad is not None:
            return _error(Status.INVALID_ARGUMENT, f"tokens[{bad}] must be in [0, {vocab}), got {body.tokens[bad]}",
                          param="tokens")
        if router.tokenizer is None:  # a model without a tokenizer reads prompts as space-separated ids
            return {"prompt": " ".join(map(str, body.tokens))}
        return {"prompt": await asyncio.to_thread(router.tokenizer.decode, body.tokens)}

    @app.post("/v1/completions")
    async def completions(request: Request, body: CompletionBody):
        return await serve_body(request, body, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request, body: ChatBody):
        return await serve_body(request, body, chat=True)

    return app


async def _events(router: Router, firsts: list[Delta], streams: list, head: dict, chat: bool, token_ids: bool,
                  include_usage: bool):
    """Server-sent events: one chunk per message of each choice's generation (choice after choice;
    they all run at once), `data: [DONE]` last. A choice's finishing chunk carries its usage and
    speculation metrics; with `include_usage` (OpenAI's stream_options) every chunk carries "usage":
    null instead and one more chunk, with no choices, carries the usage of them all. A client that
    disconnects closes this generator (Starlette stops iterating it), which closes the router's
    streams: each generation is cancelled unless coalesced callers remain."""
    obj = "chat.completion.chunk" if chat else "text_completion"

    def chunk(i: int, d: Delta, role: bool) -> str:
        choice = {"index": i, "logprobs": _logprobs(router, [d], chat), "finish_reason": d.finish_reason}
        if chat:
            choice["delta"] = {"role": "assistant", "content": d.text} if role else {"content": d.text}
        else:
            choice["text"] = d.text
        if token_ids:
            choice["token_ids"] = d.token_ids
        if d.finished:
            choice["stop_reason"] = d.stop_string or None
        msg = {**head, "object": obj, "choices": [choice], **(_final_fields([d]) if d.finished else {})}
        if include_usage:  # the usage comes in a chunk of its own
            msg["usage"] = None
        return f"data: {json.dumps(msg)}\n\n"

    lasts = []
    try:
        for i, (first, stream) in enumerate(zip(firsts, streams)):
            yield chunk(i, first, role=True)
            last = first
            async for d, _ in stream:
                yield chunk(i, d, role=False)
                last = d
            lasts.append(last)
        if include_usage and all(d.finished for d in lasts):
            yield f"data: {json.dumps({**head, 'object': obj, 'choices': [], **_final_fields(lasts)})}\n\n"
    except Exception as e:  # the stream has started: the error is its last event
        err = router.failure(e)
        yield f"data: {json.dumps(error_body(err.status, err.message)[1])}\n\n"
    finally:
        for stream in streams:  # a client that left: the router stops each generation if it was the last caller
            await stream.aclose()
    yield "data: [DONE]\n\n"


def _logprobs(router: Router, deltas: list[Delta], chat: bool) -> dict | None:
    """OpenAI's `logprobs` of a choice for these deltas' tokens (None when not asked for): chat's
    {"content": [{token, logprob, bytes, top_logprobs}]}, completions' {tokens, token_logprobs,
    top_logprobs, text_offset}."""
    if all(d.logprobs is None for d in deltas):
        return None
    items = [x for d in deltas for x in d.logprobs or ()]
    text = router.token_text
    if chat:
        def entry(t: int, lp: float) -> dict:
            s = text(t)
            return {"token": s, "logprob": lp, "bytes": list(s.encode())}
        return {"content": [{**entry(x.token, x.logprob), "top_logprobs": [entry(t, v) for t, v in x.top]}
                            for x in items]}
    tokens = [text(x.token) for x in items]
    offsets, at = [], 0
    for s in tokens:
        offsets.append(at)
        at += len(s)
    return {"tokens": tokens, "token_logprobs": [x.logprob for x in items],
            "top_logprobs": [{text(t): v for t, v in x.top} for x in items], "text_offset": offsets}
