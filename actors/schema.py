"""One request schema, validated once; the speculation stats, defined once.

A `Request` (prompt token ids + `SamplingParams` + `SpeculationParams`) is what the
router, the engine, the CLI and the benchmarks all build. `validate(request, limits)`
checks every field against the serving `Limits` and returns the request with the
server defaults resolved: each field's own bounds are a pydantic rule (`_RULES`, strict:
no bool for a number, no float for an integer, no NaN or infinity), and what depends on
the limits or on other fields is checked in `validate`. A `ValueError` names the field (by
its path in the wire API, e.g. ``sampling.max_tokens``) and the limit, and becomes
INVALID_ARGUMENT (HTTP 400) with the same message everywhere: the only validation of a
request's values (the transports check only that the wire types fit).

`SpecStats` are the speculation counters of one request or of many (vLLM's
convention: drafts, draft tokens, accepted tokens, accepted per position; mean
accepted length = 1 + accepted / drafts). `Delta` is what a step commits for one
request, the shape that crosses from the engine to the verifier replica and the
router; the last one carries the usage and the stats.

Torch-free and Ray-free: the SDK side of the wire (cluster/wire.py) converts
these to and from the proto.
"""
from __future__ import annotations

import functools
from dataclasses import asdict, dataclass, field, replace
from typing import Annotated, Literal, Mapping

from pydantic import AfterValidator, ConfigDict, Field, TypeAdapter, ValidationError

MAX_GAMMA = 16  # the most draft tokens per step any request may ask for
QUANT_MODES = ("none", "int8-weight", "int8-dynamic", "mixed")  # weight modes, see actors/quant.py
PREPACK_CHOICES = ("auto", "on", "off")  # CPU weight layout, see actors.build.with_prepack
WEIGHTS_CHOICES = ("auto", "native", "dense")  # a GGUF-born target's weights, see actors/native.py
EXACT_CHOICES = ("auto", "require", "off")  # row-invariant target passes, see actors.build.with_exact
AUTO = "auto"  # γ chosen per step by the speculation policy (actors/policy.py)
KV_BLOCK = 16  # positions per KV block, the default (actors/kv.py; `specd bench --local --paged` measured it)
AUTO_MAX_GAMMA = 8  # the most the policy proposes per step
MAX_TREE = 64  # the most nodes a token tree may have
MAX_REQUEST_ID_BYTES = 128
MAX_STOP_STRINGS = 16
MAX_SEED = 2 ** 64 - 1  # torch.Generator.manual_seed's range (the proto's uint64)
NO_DRAFT = "none"  # reserved draft name: speculation off
AUTO_DRAFT = "auto"  # reserved draft name: the engine picks among its drafts per request (and may switch)
RESERVED_DRAFTS = (NO_DRAFT, AUTO_DRAFT)
MAX_TOPK_ACCEPT = 1000
MAX_BEAMS = 16
MIN_TEMPERATURE, MAX_TEMPERATURE = 1e-3, 1e3
MIN_TOP_P = 1e-6
MAX_LOGPROBS = 20  # the most alternatives a request may ask log-probabilities of, per token
MAX_REPETITION_PENALTY = 10.0  # sampling.repetition_penalty lies in (0, this]
GRAMMAR_KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")  # see actors/grammar.py
MAX_GRAMMAR_BYTES = 64 * 1024
ROLES = ("system", "user", "assistant", "tool")


@dataclass
class SamplingParams:
    """Decoding parameters. None = the server's default (resolved by `validate`)."""
    max_tokens: int | None = None  # tokens to generate, in [1, Limits.max_tokens]
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0  # nucleus mass, in [MIN_TOP_P, 1]
    top_k: int = 0  # 0 = disabled
    seed: int | None = None  # reproducible sampling; None = random
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    # Beam search (Hugging Face's semantics): B beams, the finished hypotheses' scores divided by
    # generated_length ** length_penalty, early_stopping: stop once B hypotheses finished.
    num_beams: int = 1
    length_penalty: float = 1.0
    early_stopping: bool = False
    # Log-probabilities of each generated token under the target's distribution (after penalties,
    # a grammar's mask, temperature, top-k and top-p; temperature 0: without the last three), and of
    # the k likeliest tokens there.
    # None = off; 0 = the chosen tokens' only.
    logprobs: int | None = None
    # Structured output: (kind, spec), kind one of GRAMMAR_KINDS (actors/grammar.py); None = free text.
    grammar: tuple[str, str] | None = None
    # Penalties (vLLM's semantics, actors/penalties.py): presence and frequency over the output so
    # far, in [-2, 2] (OpenAI's); repetition over prompt and output, in (0, MAX_REPETITION_PENALTY]
    # (Hugging Face's). 0, 0, 1 = off.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalties(self) -> tuple[float, float, float] | None:
        """(presence, frequency, repetition), or None when all are off."""
        t = (self.presence_penalty, self.frequency_penalty, self.repetition_penalty)
        return None if t == (0, 0, 1) else t


@dataclass
class SpeculationParams:
    """How to speculate. Never changes greedy output, the sampled distribution, or the tokens
    of a seeded request."""
    draft: str | None = None  # a draft name; None = the server's default draft; "none" = off
    gamma: int | str | None = None  # draft tokens per step, or "auto"; None = the draft's default; 0 = off
    # Token tree: its node budget (depth at most γ). None = the policy decides under γ "auto"
    # (a chain with a fixed γ); 0 = always a chain.
    tree: int | None = None
    # Confidence threshold τ: the draft stops as soon as its probability for the next token (for
    # a tree: the cumulative path probability) falls below τ. None = the server's default.
    threshold: float | None = None
    # Entropy gate: no drafting while the target's recent entropy (nats, an EMA over committed
    # positions) exceeds this. None = off.
    entropy_gate: float | None = None
    # "lossless" (the default), "topk:K" (accept a draft token among the target's K likeliest) or
    # "typical:EPS" (Medusa's typical acceptance). Lossy rules never apply to greedy requests.
    acceptance: str = "lossless"


@dataclass
class Request:
    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    speculation: SpeculationParams = field(default_factory=SpeculationParams)
    # Who asked: the router's id of the caller's bearer token ("" without auth). Never from the
    # request itself; a drafter that learns across requests scopes by it (drafters/suffix.py).
    tenant: str = ""

    @property
    def draft(self) -> str | None:
        """The draft this (validated) request speculates with, or None when speculation is off."""
        s = self.speculation
        return None if not s.gamma or s.draft in (None, NO_DRAFT) else s.draft

    @property
    def auto_gamma(self) -> bool:
        return self.draft is not None and self.speculation.gamma == AUTO

    @property
    def gamma(self) -> int:
        """The most draft tokens per step: the fixed γ, or AUTO_MAX_GAMMA under the policy."""
        if self.draft is None:
            return 0
        return AUTO_MAX_GAMMA if self.speculation.gamma == AUTO else self.speculation.gamma

    @property
    def acceptance_rule(self) -> tuple[str, float]:
        """("lossless", 0) | ("topk", K) | ("typical", ε); lossy rules never for greedy requests."""
        a = self.speculation.acceptance
        if a == "lossless" or self.sampling.greedy:
            return ("lossless", 0.0)
        kind, _, val = a.partition(":")
        return (kind, float(val))

    @property
    def coupled(self) -> bool:
        """Sampled with a seed: coupled acceptance, so the tokens depend on the seed only."""
        return not self.sampling.greedy and self.sampling.seed is not None


@dataclass(frozen=True)
class Limits:
    """What a server accepts. `drafts` maps each servable draft name to its default γ (or "auto");
    `aliases` maps a draft spec the server serves under another name (e.g. "default" served as
    "eagle") to that name, so a request may name a draft either way."""
    context: int  # prompt + max_tokens must fit
    max_tokens: int
    vocab_size: int | None = None  # prompt ids must lie in [0, vocab_size)
    drafts: Mapping[str, int | str] = field(default_factory=dict)
    aliases: Mapping[str, str] = field(default_factory=dict)
    default_draft: str = NO_DRAFT
    default_max_tokens: int = 128
    default_threshold: float = 0.0  # τ when a request leaves it unset (0: never stop early)
    max_beams: int = MAX_BEAMS  # a beam request holds one KV slot per beam: at most the batch

    def __post_init__(self):
        for r in RESERVED_DRAFTS:
            if r in self.drafts:
                raise ValueError(f"draft name {r!r} is reserved")
        if self.default_draft not in RESERVED_DRAFTS and self.default_draft not in self.drafts:
            raise ValueError(f"default draft {self.default_draft!r} is not one of {[NO_DRAFT, *self.drafts]}")
        for spec, name in self.aliases.items():
            if spec in self.drafts or spec in RESERVED_DRAFTS or name not in self.drafts:
                raise ValueError(f"draft alias {spec!r} -> {name!r}: an alias names a served draft and is not a name")
        if not 1 <= self.max_tokens < self.context:
            raise ValueError(f"max_tokens ({self.max_tokens}) must be in [1, context ({self.context}))")


def _rule(tp, check=None):
    """A field's rule as a pydantic TypeAdapter (strict: no bool for a number, no float for an int,
    no NaN or infinity), with an optional extra check."""
    if check is not None:
        tp = Annotated[tp, AfterValidator(lambda v: v if check(v) else _fail())]
    return TypeAdapter(tp, config=ConfigDict(strict=True, allow_inf_nan=False))


def _fail():
    raise ValueError("out of range")


@functools.lru_cache(maxsize=64)
def _between(lo: int, hi: int) -> TypeAdapter:
    return _rule(Annotated[int, Field(ge=lo, le=hi)])


@functools.lru_cache(maxsize=8)
def _token_ids(vocab: int) -> TypeAdapter:
    return _rule(list[Annotated[int, Field(ge=0, lt=vocab)]])


_NUMBER = float  # strict float: ints pass, bools and NaN/inf do not
_RULES = {  # field (its wire path) -> its rule; the message says what the rule says
    "request_id": (_rule(str, lambda s: len(s.encode()) <= MAX_REQUEST_ID_BYTES),
                   f"request_id must be a string of at most {MAX_REQUEST_ID_BYTES} bytes"),
    # (Bounds that survive float32: a temperature of 1e-300 is 0 on the device, 1e-40 a subnormal.)
    "sampling.temperature": (_rule(_NUMBER, lambda t: t == 0 or MIN_TEMPERATURE <= t <= MAX_TEMPERATURE),
                             f"sampling.temperature must be 0 (greedy) or in [{MIN_TEMPERATURE}, {MAX_TEMPERATURE}], "
                             "got {v}"),
    "sampling.top_p": (_rule(Annotated[_NUMBER, Field(ge=MIN_TOP_P, le=1)]),
                       f"sampling.top_p must be in [{MIN_TOP_P}, 1], got {{v}}"),
    "sampling.top_k": (_rule(Annotated[int, Field(ge=0)]), "sampling.top_k must be >= 0, got {v}"),
    "sampling.seed": (_rule(Annotated[int, Field(ge=0, le=MAX_SEED)] | None),
                      f"sampling.seed must be in [0, {MAX_SEED}], got {{v}}"),
    "sampling.stop": (_rule(tuple, lambda s: len(s) <= MAX_STOP_STRINGS),
                      f"sampling.stop holds at most {MAX_STOP_STRINGS} strings, got {{n}}"),
    "sampling.stop strings": (_rule(tuple[Annotated[str, Field(min_length=1)], ...]),
                              "sampling.stop strings must be non-empty strings"),
    "sampling.length_penalty": (_rule(Annotated[_NUMBER, Field(ge=-10, le=10)]),
                                "sampling.length_penalty must be a number in [-10, 10], got {v!r}"),
    "sampling.early_stopping": (_rule(bool), "sampling.early_stopping must be true or false, got {v!r}"),
    "sampling.grammar": (_rule(tuple[Literal[GRAMMAR_KINDS], Annotated[str, Field(max_length=MAX_GRAMMAR_BYTES)]]
                               | None),
                         f"sampling.grammar must be (kind, spec) with kind one of {list(GRAMMAR_KINDS)} and a spec "
                         f"of at most {MAX_GRAMMAR_BYTES} characters, got {{v!r:.200}}"),
    "sampling.presence_penalty": (_rule(Annotated[_NUMBER, Field(ge=-2, le=2)]),
                                  "sampling.presence_penalty must be in [-2, 2], got {v!r}"),
    "sampling.frequency_penalty": (_rule(Annotated[_NUMBER, Field(ge=-2, le=2)]),
                                   "sampling.frequency_penalty must be in [-2, 2], got {v!r}"),
    "sampling.repetition_penalty": (_rule(Annotated[_NUMBER, Field(gt=0, le=MAX_REPETITION_PENALTY)]),
                                    f"sampling.repetition_penalty must be in (0, {MAX_REPETITION_PENALTY}], "
                                    "got {v!r}"),
    "sampling.logprobs": (_rule(Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None),
                          f"sampling.logprobs must be in [0, {MAX_LOGPROBS}] (alternatives per token), got {{v!r}}"),
    "speculation.gamma": (_rule(Literal["auto"] | Annotated[int, Field(ge=0, le=MAX_GAMMA)]),
                          f"speculation.gamma must be in [0, {MAX_GAMMA}] or {AUTO!r}, got {{v!r}}"),
    "speculation.tree": (_rule(Annotated[int, Field(ge=0, le=MAX_TREE)] | None),
                         f"speculation.tree must be in [0, {MAX_TREE}], got {{v!r}}"),
    "speculation.threshold": (_rule(Annotated[_NUMBER, Field(ge=0, le=1)]),
                              "speculation.threshold must be in [0, 1], got {v!r}"),
    "speculation.entropy_gate": (_rule(Annotated[_NUMBER, Field(ge=0)] | None),
                                 "speculation.entropy_gate must be a number of nats >= 0, got {v!r}"),
    "speculation.acceptance": (_rule(str, lambda a: _acceptance_ok(a)),
                               f"speculation.acceptance must be 'lossless', 'topk:K' with K in [1, {MAX_TOPK_ACCEPT}] "
                               "or 'typical:EPS' with EPS in (0, 1), got {v!r}"),
}


def _check(name: str, value, adapter: TypeAdapter | None = None, message: str | None = None, **fmt) -> None:
    """Raise ValueError(message) unless `value` passes the field's rule."""
    rule, msg = _RULES[name] if adapter is None else (adapter, message)
    try:
        rule.validate_python(value)
    except ValidationError:
        raise ValueError(msg.format(v=value, **fmt)) from None


def _acceptance_ok(a: str) -> bool:
    if a == "lossless":
        return True
    kind, _, val = a.partition(":")
    if kind == "topk":
        return val.isdigit() and 1 <= int(val) <= MAX_TOPK_ACCEPT
    try:
        return kind == "typical" and 0 < float(val) < 1
    except ValueError:
        return False


def validate(req: Request, limits: Limits) -> Request:
    """Check `req` against `limits`; return a copy with the defaults resolved
    (max_tokens set; draft and gamma set, draft NO_DRAFT and gamma 0 when speculation is off).
    Raises ValueError naming the field and the limit. Each field's own bounds are its rule in
    `_RULES`; what depends on the server's limits or on other fields is checked here."""
    _check("request_id", req.request_id)
    ids = req.prompt_ids
    if not ids:
        raise ValueError("prompt must not be empty")
    if limits.vocab_size is not None:
        _check("prompt", list(ids), _token_ids(limits.vocab_size),
               f"prompt token ids must be integers in [0, {limits.vocab_size})")
    s = req.sampling
    max_tokens = limits.default_max_tokens if s.max_tokens is None else s.max_tokens
    _check("sampling.max_tokens", max_tokens, _between(1, limits.max_tokens),
           f"sampling.max_tokens must be in [1, {limits.max_tokens}], got {{v}}")
    if len(ids) + max_tokens > limits.context:
        raise ValueError(f"prompt is {len(ids)} tokens; prompt + sampling.max_tokens ({max_tokens}) must fit "
                         f"the context of {limits.context} tokens")
    for name in ("temperature", "top_p", "top_k", "seed"):
        _check(f"sampling.{name}", getattr(s, name))
    stop = tuple(s.stop)
    _check("sampling.stop", stop, n=len(stop))
    _check("sampling.stop strings", stop)
    beams = min(MAX_BEAMS, limits.max_beams)
    _check("sampling.num_beams", s.num_beams, _between(1, beams), f"sampling.num_beams must be in [1, {beams}], "
           "got {v!r}")
    if s.num_beams > 1:
        if s.temperature != 0:
            raise ValueError("sampling.num_beams > 1 is beam search: sampling.temperature must be 0")
        if stop:
            raise ValueError("sampling.stop is not supported with sampling.num_beams > 1")
        if s.logprobs is not None:
            raise ValueError("sampling.logprobs is not supported with sampling.num_beams > 1")
        if s.grammar is not None:
            raise ValueError("sampling.grammar is not supported with sampling.num_beams > 1")
        if s.penalties is not None:
            raise ValueError("sampling presence/frequency/repetition penalties are not supported with "
                             "sampling.num_beams > 1")
    _check("sampling.length_penalty", s.length_penalty)
    _check("sampling.early_stopping", s.early_stopping)
    _check("sampling.logprobs", s.logprobs)
    for name in ("presence_penalty", "frequency_penalty", "repetition_penalty"):
        _check(f"sampling.{name}", getattr(s, name))
    _check("sampling.grammar", None if s.grammar is None else tuple(s.grammar))
    sp = req.speculation
    draft = limits.default_draft if sp.draft in (None, "") else sp.draft
    draft = limits.aliases.get(draft, draft)  # a spec the server serves under a name of its own
    if draft not in RESERVED_DRAFTS and draft not in limits.drafts:
        raise ValueError(f"speculation.draft {draft!r} is unknown; available: {[*RESERVED_DRAFTS, *limits.drafts]}"
                         + (f" (or the specs they serve: {sorted(limits.aliases)})" if limits.aliases else ""))
    if draft == AUTO_DRAFT and not limits.drafts:
        raise ValueError("speculation.draft 'auto' needs at least one draft; this server has none")
    if sp.gamma is None:
        gamma = 0 if draft == NO_DRAFT else AUTO if draft == AUTO_DRAFT else limits.drafts[draft]
    else:
        gamma = sp.gamma
        _check("speculation.gamma", gamma)
    threshold = limits.default_threshold if sp.threshold is None else sp.threshold
    _check("speculation.tree", sp.tree)
    _check("speculation.threshold", threshold)
    _check("speculation.entropy_gate", sp.entropy_gate)
    _check("speculation.acceptance", sp.acceptance)
    if draft == NO_DRAFT or gamma == 0:
        draft, gamma = NO_DRAFT, 0
    return replace(req, prompt_ids=list(ids),
                   sampling=replace(s, max_tokens=max_tokens, stop=stop,
                                    grammar=None if s.grammar is None else tuple(s.grammar)),
                   speculation=SpeculationParams(draft=draft, gamma=gamma, tree=sp.tree, threshold=threshold,
                                                 entropy_gate=sp.entropy_gate, acceptance=sp.acceptance))


def validate_messages(messages: list) -> list[dict]:
    """Chat turns as [{"role", "content"}]; raises ValueError naming the bad turn."""
    if not messages:
        raise ValueError("messages must not be empty")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise ValueError(f"messages[{i}].role must be one of {list(ROLES)} with string content, got {m!r}")
        out.append({"role": m["role"], "content": m["content"]})
    return out


# ---- stats -------------------------------------------------------------------------------------
@dataclass
class SpecStats:
    """Speculation counters, vLLM's convention: mean accepted length = 1 + accepted / drafts.

    `accepted_per_pos[j]` / `drafted_per_pos[j]`: steps that drafted a token at position j,
    and how many of those accepted it. Times are wall seconds.
    """
    drafts: int = 0  # verify steps that had >= 1 draft token
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=lambda: [0] * MAX_GAMMA)
    drafted_per_pos: list[int] = field(default_factory=lambda: [0] * MAX_GAMMA)
    target_passes: int = 0  # target verify passes this request took part in
    draft_s: float = 0.0
    verify_s: float = 0.0

    COUNTERS = ("drafts", "draft_tokens", "accepted_tokens", "target_passes")
    TIMES = ("draft_s", "verify_s")

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        return 1 + self.accepted_tokens / self.drafts if self.drafts else 1.0

    def per_position(self) -> list[float]:
        """Acceptance rate at each draft position that was drafted at least once."""
        return [a / d for a, d in zip(self.accepted_per_pos, self.drafted_per_pos) if d]

    def record(self, drafted: int, accepted: int, depth: int | None = None) -> None:
        """One verify step of one request: `drafted` tokens proposed (a chain, or the nodes of a
        tree `depth` deep), `accepted` of them kept (a chain prefix, or a tree path)."""
        self.target_passes += 1
        if drafted:
            self.drafts += 1
            self.draft_tokens += drafted
            self.accepted_tokens += accepted
            for j in range(min(drafted if depth is None else depth, MAX_GAMMA)):
                self.drafted_per_pos[j] += 1
                self.accepted_per_pos[j] += j < accepted

    def add(self, other: "SpecStats", times: bool = True) -> None:
        for name in self.COUNTERS + (self.TIMES if times else ()):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for j in range(MAX_GAMMA):
            self.accepted_per_pos[j] += other.accepted_per_pos[j]
            self.drafted_per_pos[j] += other.drafted_per_pos[j]

    def to_dict(self) -> dict:
        """The counters plus the derived rates (what reports and JSON carry)."""
        return {**asdict(self), "acceptance_rate": self.acceptance_rate,
                "mean_accepted_length": self.mean_accepted_length,
                "acceptance_per_position": self.per_position()}

    @classmethod
    def from_dict(cls, d: Mapping) -> "SpecStats":
        known = {k: d[k] for k in cls.COUNTERS + cls.TIMES + ("accepted_per_pos", "drafted_per_pos") if k in d}
        return cls(**known)


@dataclass
class Delta:
    """What one step committed for one request: a stream message. The last one of a request
    has `finish_reason` set and carries the usage and the speculation stats."""
    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: str | None = None  # "length" | "stop" | "abort" on the last delta
    prompt_tokens: int = 0  # last delta only
    completion_tokens: int = 0  # last delta only
    stats: SpecStats | None = None  # last delta only
    stop_string: str = ""  # last delta only: the stop string that ended the request ("" otherwise)
    logprobs: list[TokenLogprob] | None = None  # one per token_ids entry, when the request asked for them

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @classmethod
    def join(cls, deltas: list["Delta"]) -> "Delta":
        """One delta holding these in order: their tokens, text and logprobs, the last one's ending."""
        last = deltas[-1]
        lps = None if all(d.logprobs is None for d in deltas) else [x for d in deltas for x in d.logprobs or ()]
        return cls(last.request_id, [t for d in deltas for t in d.token_ids], "".join(d.text for d in deltas),
                   last.finish_reason, last.prompt_tokens, last.completion_tokens, last.stats, last.stop_string, lps)


@dataclass
class TokenLogprob:
    """A generated token's log-probability under the target, and the k likeliest there."""
    token: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # (token, log-probability), likeliest first


@dataclass
class Completion:
    """A finished request: every delta joined."""
    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: str
    prompt_tokens: int
    stats: SpecStats
    stop_string: str = ""
    logprobs: list[TokenLogprob] | None = None

    @classmethod
    def join(cls, deltas: list[Delta]) -> "Completion":
        d = Delta.join(deltas)
        assert d.finished, "the last delta must finish the request"
        return cls(d.request_id, d.token_ids, d.text, d.finish_reason, d.prompt_tokens, d.stats or SpecStats(),
                   d.stop_string, d.logprobs)
