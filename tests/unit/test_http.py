"""The OpenAI-compatible HTTP API (cluster/http.py) without Ray: the real `Router` and its FastAPI
app, served by uvicorn on a free port, driven by the official `openai` client, over a canned
verifier handle (no Serve controller: readiness is whether the verifier answers its health call).

  * 503 with OpenAI's error shape while no verifier answers, then the completion once one does;
  * the response's `spec_decode_metrics` are vLLM's counters and rates of the request's stats;
  * a 400 from the schema names the body field (`param`), not the wire API's path;
  * fields as clients send them: unknown ones accepted with one warning line, ones the server
    cannot honour refused by name, vLLM's `ignore_eos` and OpenAI's `max_completion_tokens` and
    `stream_options.include_usage` honoured; `/health`, `/ping` and `/version` at the root.
(The cluster tests in tests/cluster/test_placement.py cover 401, 404, 429, streaming, chat and
equality with the gRPC path.)
"""
from __future__ import annotations

import json
import logging
import threading
import time
import urllib.error
import urllib.request

import openai
import pytest
import uvicorn

from actors.schema import Delta, SpecStats, TokenLogprob
from cluster.http import ChatBody, build_http_app
from cluster.router import Router
from cluster.serve import free_port

CONFIG = {"model": "tiny", "dtype": "fp32", "max_len": 128,
          "router": {"max_tokens": 32, "default_max_tokens": 8, "default_draft": "ngram"},
          "drafts": [{"name": "ngram", "spec": "ngram", "default_gamma": 3}]}


class _Method:
    def __init__(self, fn):
        self.remote = fn


class CannedVerifier:
    """Streams two messages per request (tokens 5 and 6, planted stats); healthy once `ready`."""

    def __init__(self):
        self.ready = False
        self.timeouts: list[float | None] = []  # the time each request was given
        self.requests = []  # what each request became
        self.generate = _Method(self._stream)
        self.check_health = _Method(self._health)
        self.stats = SpecStats()
        self.stats.record(drafted=3, accepted=2)
        self.stats.record(drafted=3, accepted=0)

    def options(self, **_):
        return self

    async def _health(self):
        if not self.ready:
            raise RuntimeError("models still loading")

    async def _stream(self, req, timeout_s=None):
        self.timeouts.append(timeout_s)
        self.requests.append(req)
        k = req.sampling.logprobs
        lps = (lambda t, v: None if k is None else [TokenLogprob(t, v, [(t, v), (9, v - 1)][:k])])
        yield Delta(req.request_id, [5], "", logprobs=lps(5, -0.5))
        yield Delta(req.request_id, [6], "", finish_reason="length", prompt_tokens=len(req.prompt_ids),
                    completion_tokens=2, stats=self.stats, logprobs=lps(6, -0.25))


@pytest.fixture(scope="module")
def served():
    verifier = CannedVerifier()
    port = free_port()
    config = {**CONFIG, "router": {**CONFIG["router"], "request_timeout_s": 30.0}}
    server = uvicorn.Server(uvicorn.Config(build_http_app(Router(config, verifier)), host="127.0.0.1", port=port,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    end = time.time() + 30
    while not server.started and time.time() < end:
        time.sleep(0.02)
    yield verifier, openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
    server.should_exit = True
    thread.join(10)


def test_not_ready_is_503_then_the_completion_carries_vllm_metrics(served):
    verifier, oa = served
    with pytest.raises(openai.InternalServerError) as e:
        oa.completions.create(model="tiny", prompt="1 2 3")
    assert e.value.status_code == 503
    assert e.value.body == {"message": "not ready: no verifier replica is running yet; retry later",
                            "type": "server_error", "param": None, "code": "not_ready"}
    verifier.ready = True
    r = oa.completions.create(model="tiny", prompt="1 2 3", extra_body={"return_token_ids": True})
    assert r.choices[0].token_ids == [5, 6] and r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (3, 2, 5)
    assert r.spec_decode_metrics == {
        "num_drafts": 2, "num_draft_tokens": 6, "num_accepted_tokens": 2,
        "num_accepted_tokens_per_pos": [1, 1, 0], "num_draft_tokens_per_pos": [2, 2, 2],
        "mean_acceptance_length": 2.0, "draft_acceptance_rate": pytest.approx(1 / 3),
        "acceptance_rate_per_pos": [0.5, 0.5, 0.0]}


def test_schema_errors_name_the_body_field(served):
    _, oa = served
    with pytest.raises(openai.BadRequestError) as e:
        oa.completions.create(model="tiny", prompt="1 2 3", top_p=0.0)
    assert e.value.body["param"] == "top_p" and "sampling.top_p must be in" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        oa.completions.create(model="tiny", prompt=[], max_tokens=2)
    assert e.value.body["param"] == "prompt"
    with pytest.raises(openai.BadRequestError) as e:
        oa.completions.create(model="tiny", prompt="1 2", n=17)
    assert e.value.body["param"] == "n" and "[1, 16]" in e.value.body["message"]


def test_a_deadline_from_the_header_else_the_config_reaches_the_verifier(served):
    """HTTP has what gRPC's deadline gives: X-Request-Timeout (seconds) crosses to the verifier as the
    time the request has, else router.request_timeout_s; a malformed value is a 400 naming the header."""
    verifier, oa = served
    verifier.ready = True
    oa.completions.create(model="tiny", prompt="1 2 3", extra_headers={"X-Request-Timeout": "2.5"})
    oa.completions.create(model="tiny", prompt="1 2 3")
    assert verifier.timeouts[-2:] == [2.5, 30.0]
    for bad in ("soon", "0", "-1"):
        with pytest.raises(openai.BadRequestError) as e:
            oa.completions.create(model="tiny", prompt="1 2 3", extra_headers={"X-Request-Timeout": bad})
        assert "X-Request-Timeout must be a positive number of seconds" in e.value.body["message"]


def _get(oa, path: str) -> tuple[int, bytes]:
    root = str(oa.base_url).rstrip("/").removesuffix("/v1")
    try:
        with urllib.request.urlopen(root + path, timeout=10) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def test_health_ping_and_version_at_the_root(served):
    """vLLM's probes, where load generators look for them: 200 once a verifier answers, 503 before."""
    verifier, oa = served
    verifier.ready = False
    try:
        assert _get(oa, "/health")[0] == 503 and _get(oa, "/ping")[0] == 503
    finally:
        verifier.ready = True
    assert _get(oa, "/health")[0] == 200 and _get(oa, "/ping")[0] == 200
    status, body = _get(oa, "/version")
    assert status == 200 and json.loads(body)["version"]


def test_unknown_fields_are_accepted_with_one_warning(served, caplog):
    verifier, oa = served
    verifier.ready = True
    with caplog.at_level(logging.WARNING, logger="specd.http"):
        r = oa.completions.create(model="tiny", prompt="1 2", user="u1", presence_penalty=0.0,
                                  extra_body={"some_new_field": {"x": 1}, "parallel_tool_calls": False,
                                              "response_format": {"type": "text"}, "tool_choice": "none"})
    assert r.choices[0].text == "" and r.usage.completion_tokens == 2
    lines = [rec.getMessage() for rec in caplog.records if rec.name == "specd.http"]
    assert len(lines) == 1 and all(f in lines[0] for f in ("some_new_field", "parallel_tool_calls", "user"))


@pytest.mark.parametrize("field,value", [("tools", [{"type": "function", "function": {"name": "f"}}]),
                                         ("tool_choice", "required"), ("functions", [{"name": "f"}]),
                                         ("min_tokens", 4), ("best_of", 2), ("echo", True),
                                         ("logit_bias", {"5": 10})])
def test_fields_the_server_cannot_honour_are_refused_by_name(served, field, value):
    verifier, oa = served
    verifier.ready = True
    before = len(verifier.requests)
    with pytest.raises(openai.BadRequestError) as e:
        oa.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "1 2"}],
                                   extra_body={field: value})
    assert e.value.body["param"] == field and e.value.body["message"].startswith(f"{field} is not supported")
    assert len(verifier.requests) == before  # refused before it reached a verifier
    with pytest.raises(openai.BadRequestError) as e:  # completions too
        oa.completions.create(model="tiny", prompt="1 2", extra_body={field: value})
    assert e.value.body["param"] == field


def test_vllm_and_newer_openai_fields_are_honoured(served):
    verifier, oa = served
    verifier.ready = True
    oa.completions.create(model="tiny", prompt="1 2", max_tokens=7, stop=None, extra_body={"ignore_eos": True})
    req = verifier.requests[-1]
    assert req.sampling.ignore_eos is True and req.sampling.max_tokens == 7 and req.sampling.stop == ()
    oa.completions.create(model="tiny", prompt="1 2", presence_penalty=0.5, frequency_penalty=-0.25,
                          extra_body={"repetition_penalty": 1.2})
    assert verifier.requests[-1].sampling.penalties == (0.5, -0.25, 1.2)
    with pytest.raises(openai.BadRequestError) as e:  # out of range: the router's message names the field
        oa.completions.create(model="tiny", prompt="1 2", frequency_penalty=2.5)
    assert "frequency_penalty must be in [-2, 2]" in e.value.body["message"]
    chat = ChatBody(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3, max_completion_tokens=9)
    assert chat.request_args()["sampling"].max_tokens == 9  # OpenAI's newer name wins
    chunks = list(oa.completions.create(model="tiny", prompt="1 2", stream=True,
                                        stream_options={"include_usage": True}))
    assert [c.usage for c in chunks[:-1]] == [None] * (len(chunks) - 1)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 2
    assert chunks[-2].choices[0].finish_reason == "length"


def test_logprobs_in_openais_shapes(served):
    """The verifier's per-token log-probabilities reach the client: completions' tokens /
    token_logprobs / top_logprobs / text_offset, chat's content entries (streamed too); the
    request asks the schema for k alternatives. (Their exactness: tests/unit/test_logprobs.py.)"""
    verifier, oa = served
    verifier.ready = True
    r = oa.completions.create(model="tiny", prompt="1 2", logprobs=2)
    assert verifier.requests[-1].sampling.logprobs == 2
    lp = r.choices[0].logprobs
    assert lp.tokens == ["token_id:5", "token_id:6"] and lp.token_logprobs == [-0.5, -0.25]
    assert lp.top_logprobs == [{"token_id:5": -0.5, "token_id:9": -1.5}, {"token_id:6": -0.25, "token_id:9": -1.25}]
    assert lp.text_offset == [0, 10]
    r = oa.completions.create(model="tiny", prompt="1 2")
    assert r.choices[0].logprobs is None and verifier.requests[-1].sampling.logprobs is None
    chunks = list(oa.completions.create(model="tiny", prompt="1 2", logprobs=0, stream=True))
    assert [c.choices[0].logprobs.token_logprobs for c in chunks] == [[-0.5], [-0.25]]
    with pytest.raises(openai.BadRequestError) as e:
        oa.completions.create(model="tiny", prompt="1 2", logprobs=21)
    assert e.value.body["param"] == "logprobs" and "sampling.logprobs must be in [0, 20]" in e.value.body["message"]


def test_chat_logprobs_shape():
    """Chat's shape, built from deltas (the tiny model has no chat template to serve chat with)."""
    from cluster.http import _logprobs

    class R:
        token_text = staticmethod(lambda t: f"t{t}")
    d = [Delta("r", [5], "", logprobs=[TokenLogprob(5, -0.5, [(5, -0.5)])])]
    assert _logprobs(R, d, chat=True) == {"content": [
        {"token": "t5", "logprob": -0.5, "bytes": [116, 53],
         "top_logprobs": [{"token": "t5", "logprob": -0.5, "bytes": [116, 53]}]}]}
    assert _logprobs(R, [Delta("r", [5], "")], chat=True) is None
    body = ChatBody(model="m", messages=[{"role": "user", "content": "hi"}], logprobs=True, top_logprobs=3)
    assert body.request_args()["sampling"].logprobs == 3
    assert ChatBody(model="m", messages=[{"role": "user", "content": "hi"}]).request_args()["sampling"].logprobs is None


def test_n_choices_are_independent_generations_seeded_in_turn(served):
    """n = 3: three generations (seed, seed + 1, seed + 2: reproducible samples), three choices in
    order, the usage summed over them; streamed, each choice's chunks carry its index."""
    verifier, oa = served
    verifier.ready = True
    before = len(verifier.requests)
    r = oa.completions.create(model="tiny", prompt="1 2", n=3, temperature=1.0, seed=41, extra_body={"request_id": "q"})
    reqs = verifier.requests[before:]
    assert [q.sampling.seed for q in reqs] == [41, 42, 43] and [q.request_id for q in reqs] == ["q/0", "q/1", "q/2"]
    assert [c.index for c in r.choices] == [0, 1, 2] and r.usage.completion_tokens == 6 and r.usage.prompt_tokens == 2
    chunks = list(oa.completions.create(model="tiny", prompt="1 2", n=2, stream=True, temperature=1.0))
    assert [c.choices[0].index for c in chunks] == [0, 0, 1, 1]
    assert [q.sampling.seed for q in verifier.requests[-2:]] == [None, None]  # unseeded: each draws its own


def test_structured_output_fields_become_the_requests_grammar(served):
    """response_format, vLLM's structured_outputs and guided_* all reach the schema as one grammar;
    two at once, or a malformed one, are a 400; a grammar needs a model with a tokenizer (the canned
    router's "tiny" has none: refused by the router, by name, before any verifier sees it)."""
    verifier, oa = served
    verifier.ready = True
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    cases = [({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}},
              ("json_schema", json.dumps(schema))),
             ({"response_format": {"type": "json_object"}}, ("json_object", "")),
             ({"structured_outputs": {"regex": "[0-9]+"}}, ("regex", "[0-9]+")),
             ({"guided_choice": ["a", "b"]}, ("choice", json.dumps(["a", "b"]))),
             ({"guided_json": schema}, ("json_schema", json.dumps(schema))),
             ({"response_format": {"type": "text"}}, None),
             # vLLM's disable_any_whitespace: llguidance's compact JSON (keys and separators forced)
             ({"structured_outputs": {"json": schema, "disable_any_whitespace": True}},
              ("json_schema", json.dumps({**schema, "x-guidance": {"whitespace_flexible": False}}))),
             ({"response_format": {"type": "json_object"}, "structured_outputs": {"disable_any_whitespace": True}},
              ("json_schema", json.dumps({"type": "object", "x-guidance": {"whitespace_flexible": False}}))),
             ({"structured_outputs": {"regex": "[0-9]+", "disable_any_whitespace": True}}, ("regex", "[0-9]+"))]
    from cluster.http import CompletionBody

    for extra, want in cases:
        assert CompletionBody(model="tiny", prompt="1", **extra).request_args()["sampling"].grammar == want
    before = len(verifier.requests)
    with pytest.raises(openai.BadRequestError) as e:
        oa.completions.create(model="tiny", prompt="1 2", extra_body=cases[0][0])
    assert "sampling.grammar needs a model with a tokenizer" in e.value.body["message"]
    for bad in ({"response_format": {"type": "json_object"}, "guided_regex": "a"},
                {"response_format": {"type": "xml"}}, {"response_format": {"type": "json_schema"}}):
        with pytest.raises(openai.BadRequestError):
            oa.completions.create(model="tiny", prompt="1 2", extra_body=bad)
    assert len(verifier.requests) == before
