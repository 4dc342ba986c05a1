"""Fuzzing the request message against a live local cluster (tiny models, real Ray Serve gRPC).

`hypothesis` builds `GenerateRequest`s with garbage in every field: huge and negative numbers,
NaN, ±inf and subnormal floats, empty, huge and unicode strings, unknown roles and drafts, many
and empty stop strings, both/neither input, gamma with gamma_auto, request ids over the limit or
equal to another in-flight request's, tiny deadlines, prompts of megabytes; and every speculation
field this proto has (tree, threshold, entropy_gate, acceptance where present). They go through the
raw stub (only the `application` metadata Serve needs), so nothing is checked client-side.

The oracle is the wire API's documentation (protos/specd.proto) and ListModels' limits: per field,
a value must be accepted, must be rejected, or is the server's call (a limit the proto does not
state, e.g. how many stop strings; tiny models take token-id prompts and have no chat template).
For each answer:
  * the status is OK, INVALID_ARGUMENT (whose details name one of the offending fields, and only
    when something is offending), RESOURCE_EXHAUSTED, or DEADLINE_EXCEEDED when the call had a
    tiny deadline. Anything else (INTERNAL, UNAVAILABLE, a hang into the 30 s deadline) fails;
  * an OK answer is well formed (ids echoed, finish reason on the last message only, usage =
    tokens, LENGTH = max_tokens); a greedy one equals the target's Hugging Face greedy output;
    seeded ones agree with each other.
Meanwhile another thread streams an unrelated 200-token greedy request again and again; every run
must yield exactly the target's greedy tokens. After the fuzz the server is healthy, answers a
small request exactly, and holds no KV.

Budget: SPECD_FUZZ_EXAMPLES (default 300) examples and SPECD_FUZZ_SECONDS (default 90) seconds of
fuzzing, derandomized (the same examples every run). `make fuzz` runs 3000 examples for up to
900 s with a fresh random seed each time. Each kind of failure (a status and its message) is
shrunk by hypothesis (SHRINK_SECONDS in all) and reported as a request to paste into
`text_format.Parse`, with the first request seen for every kind.
"""
from __future__ import annotations

import collections
import hashlib
import math
import os
import re
import threading
import time
from dataclasses import dataclass, field

import grpc
import pytest
from google.protobuf import text_format
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from actors.schema import MAX_TEMPERATURE, MIN_TEMPERATURE, MIN_TOP_P
from protos import specd_pb2 as pb
from protos import specd_pb2_grpc

EXAMPLES = int(os.environ.get("SPECD_FUZZ_EXAMPLES", "300"))
SECONDS = float(os.environ.get("SPECD_FUZZ_SECONDS", "90"))
LONG_RUN = "SPECD_FUZZ_EXAMPLES" in os.environ  # `make fuzz`: a random seed, not the suite's fixed one
SHRINK_SECONDS = 30.0  # after the first failure: time for hypothesis to shrink what it found
CALL_TIMEOUT = 30.0  # a call without a tiny deadline that runs into this has hung
TINY_DEADLINES = (0.001, 0.01, 0.05, 0.2)

VOCAB = 512  # the tiny target's vocabulary (actors/models.py)
MAX_LEN, MAX_TOKENS, DEFAULT_MAX_TOKENS = 512, 256, 8
DRAFTS = ("ngram", "truncated:2", "remote")
MAX_QUEUE, DRAFT_SLOTS = 8, 2
CONFIG = {
    "model": "tiny", "dtype": "fp32", "max_len": MAX_LEN, "grpc_port": 0, "http_port": 0,
    "router": {"max_queue": MAX_QUEUE, "max_tokens": MAX_TOKENS, "default_max_tokens": DEFAULT_MAX_TOKENS,
               "default_draft": "ngram"},
    "verifier": {"max_batch": 4, "resources": {"custom": {"large_accel": 1}}},
    "drafts": [{"name": "ngram", "spec": "ngram", "default_gamma": 3},
               {"name": "truncated:2", "spec": "truncated:2"},  # colocated, gamma auto
               # two draft slots for the verifier's four: a pool smaller than the load (test_draft_pool_...)
               {"name": "remote", "spec": "truncated:1", "placement": "remote", "max_batch": DRAFT_SLOTS,
                "resources": {"custom": {"small_accel": 1}}}]}
MD = (("application", "specd"),)
SPEC_FIELDS = set(pb.SpeculationParams.DESCRIPTOR.fields_by_name)

BG_ID = "fuzz-background"
BG_PROMPT = [5, 6, 7, 8, 9]
BG_TOKENS = 200
BG_REQUEST = pb.GenerateRequest(request_id=BG_ID, prompt=" ".join(map(str, BG_PROMPT)),
                                sampling=pb.SamplingParams(max_tokens=BG_TOKENS),
                                speculation=pb.SpeculationParams(draft="ngram", gamma=3))
OK, INVALID, EXHAUSTED, DEADLINE = (grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT,
                                    grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.DEADLINE_EXCEEDED)


def one_line(req: pb.GenerateRequest, limit: int = 600) -> str:
    s = text_format.MessageToString(req, as_one_line=True)
    return s if len(s) <= limit else s[:limit] + f"... ({len(s)} chars)"


# ---- the requests ------------------------------------------------------------------------------------
class Case:
    """One call: the request, the RPC, and a tiny deadline in seconds (None: CALL_TIMEOUT). Not a
    dataclass, so that hypothesis reports it by its repr: a line that rebuilds the request."""

    def __init__(self, req: pb.GenerateRequest, rpc: str, deadline: float | None):
        self.req, self.rpc, self.deadline = req, rpc, deadline

    def key(self) -> bytes:
        return hashlib.sha256(self.req.SerializeToString(deterministic=True) +
                              f"|{self.rpc}|{self.deadline}".encode()).digest()

    def __repr__(self) -> str:
        return (f"{self.rpc}(text_format.Parse({one_line(self.req)!r}, GenerateRequest()), "
                f"timeout={self.deadline or CALL_TIMEOUT})")


INT32 = st.integers(-2**31, 2**31 - 1)


@st.composite
def pick(draw, *weighted: tuple[int, st.SearchStrategy]):
    """One of the strategies, each about as often as its weight (st.one_of leans on its first
    branch); shrinks towards the first."""
    return draw(weighted[draw(st.sampled_from([i for i, (w, _) in enumerate(weighted) for _ in range(w)]))][1])


def mostly(valid: st.SearchStrategy, garbage: st.SearchStrategy, weight: int = 3) -> st.SearchStrategy:
    """`valid` about `weight` times as often as `garbage`, so that requests get past validation too."""
    return pick((weight, valid), (1, garbage))


def int32_around(lo: int, hi: int) -> st.SearchStrategy[int]:
    """The edges of [lo, hi] and just outside it, or anything in int32."""
    return st.one_of(st.sampled_from([-2**31, -1, 0, 1, lo - 1, lo, hi, hi + 1, 2**31 - 1]), INT32)


TINY = st.sampled_from([5e-324, 1e-320, 1e-300, 1e-45, 1.4e-45, 1e-40, 1.2e-38, 1e-30, 1e-7])  # > 0, float32-nasty
FLOATS = pick(
    (2, st.floats(allow_nan=True, allow_infinity=True)),
    (1, TINY),
    (1, st.sampled_from([0.0, -0.0, 0.5, 1.0, 1.0000000000000002, 2.0, 3.4e38, 3.5e38, 1e308, math.inf,
                         -math.inf, math.nan, -1e-300])))
TOKEN = st.integers(0, VOCAB - 1)
SEP = st.sampled_from([" ", " ", " ", "  ", "\t", "\n"])


@st.composite
def token_prompt(draw, ids: st.SearchStrategy[int]) -> str:
    toks = draw(st.lists(ids, min_size=1, max_size=24))
    return "".join(f"{draw(SEP) if i else ''}{t}" for i, t in enumerate(toks))


PROMPTS = mostly(token_prompt(TOKEN), pick(
    (3, token_prompt(st.one_of(TOKEN, st.integers(-2**70, 2**70), st.sampled_from([-1, VOCAB, VOCAB + 1, 99999])))),
    (1, st.text(max_size=40)),
    (1, st.sampled_from(["", " ", "\t\n", " 5 6 ", "٣ ٤", "+5", "1_0", "0x10", "5.0", "5e2", "-0", "00007",
                         "5\x006"])),
    (1, st.builds(lambda n, piece: piece * n, st.sampled_from([300, 600, 20_000, 2_200_000]),
                  st.sampled_from(["5 ", "é", "99999 "]))),  # over the context, up to 13 MB (Serve takes 2 GiB)
), weight=4)
ROLES = st.one_of(st.sampled_from(["system", "user", "assistant", "tool", "", "wizard", "USER", "user\x00"]),
                  st.text(max_size=10))
MESSAGES = st.lists(st.builds(pb.ChatMessage, role=ROLES, content=st.text(max_size=40)), max_size=5)
STOPS = mostly(st.lists(st.text(min_size=1, max_size=8), max_size=3),
               st.lists(st.one_of(st.text(max_size=12), st.sampled_from(["", "\x00", " ", "\n", "é" * 5000])),
                        max_size=24), weight=6)
DRAFT_NAMES = mostly(st.sampled_from(["", "none", *DRAFTS]),
                     st.one_of(st.sampled_from(["NGRAM", " ngram", "ngram:3", "truncated:99", "default", "auto",
                                                "../../etc/passwd"]), st.text(max_size=20)), weight=6)
REQUEST_IDS = mostly(st.one_of(st.just(""), st.text(max_size=16)),
                     st.one_of(st.sampled_from([BG_ID, "x" * 128, "x" * 129, "é" * 64, "é" * 65, "\x00",
                                                "r" * 100_000]), st.text(min_size=120, max_size=140)), weight=6)


def plan(draw, n: int, classes: int) -> tuple[int, ...]:
    """n class numbers in [0, classes), drawn together: hypothesis spreads a tuple's draws evenly,
    where separate draws late in a composite lean on their simplest value."""
    return draw(st.tuples(*[st.integers(0, classes - 1)] * n))


@st.composite
def sampling(draw) -> pb.SamplingParams:
    s = pb.SamplingParams()
    mt, temp, top_p, top_k, seed = plan(draw, 5, 6)  # per field, 0 (and more) = unset
    if mt >= 2:
        s.max_tokens = draw([st.integers(1, 16), st.integers(1, 16), st.integers(1, MAX_TOKENS),
                             int32_around(1, MAX_TOKENS)][mt - 2])
    if temp >= 1:
        s.temperature = draw([st.just(0.0), st.floats(0.05, 2.0), st.floats(0.05, 2.0), TINY, FLOATS][temp - 1])
    if top_p >= 2:
        s.top_p = draw([st.just(1.0), st.floats(0.05, 1.0), TINY, FLOATS][top_p - 2])
    if top_k >= 3:
        s.top_k = draw([st.integers(0, VOCAB + 10), st.integers(0, VOCAB + 10), INT32][top_k - 3])
    if seed >= 3:
        s.seed = draw(st.one_of(st.integers(0, 2**64 - 1), st.sampled_from([0, 2**63, 2**64 - 1])))
    s.stop.extend(draw(STOPS))
    beams, penalty, early = plan(draw, 3, 4)
    if beams >= 2:  # beam search (the verifier's max_batch, 4, bounds it)
        s.num_beams = draw([st.integers(1, 4), st.integers(0, 6)][beams - 2])
    if penalty >= 2:
        s.length_penalty = draw([st.floats(-2.0, 2.0), FLOATS][penalty - 2])
    if early >= 3:
        s.early_stopping = draw(st.booleans())
    return s


ACCEPTANCES = mostly(
    st.sampled_from(["", "lossless", "topk:1", "topk:40", "topk:1000", "typical:0.3", "typical:0.999"]),
    st.one_of(st.sampled_from(["topk:0", "topk:1001", "topk:-1", "topk:5.0", "topk:", "topk:+5", "TOPK:5",
                               "typical:0", "typical:1", "typical:nan", "typical:inf", "typical:-0.1",
                               "typical:1e-300", "typical:5e-324", "typical: 0.5", "typical:", "lossy",
                               "topk:1:2"]), st.text(max_size=12)))


@st.composite
def speculation(draw) -> pb.SpeculationParams:
    auto, gamma, tree, threshold, gate, acceptance = plan(draw, 6, 4)
    sp = pb.SpeculationParams(draft=draw(DRAFT_NAMES), gamma_auto=auto == 3)
    if gamma >= 1:
        sp.gamma = draw([st.integers(0, 16), st.integers(0, 16), int32_around(0, 16)][gamma - 1])
    # fields newer than the first proto: fuzzed where this proto has them
    if tree >= 2 and "tree" in SPEC_FIELDS:
        sp.tree = draw(mostly(st.integers(0, 64), int32_around(0, 64)))
    if threshold >= 2 and "threshold" in SPEC_FIELDS:
        sp.threshold = draw(pick((2, st.floats(0.0, 1.0)), (1, FLOATS)))
    if gate >= 2 and "entropy_gate" in SPEC_FIELDS:
        sp.entropy_gate = draw(pick((2, st.floats(0.0, 10.0)), (1, FLOATS)))
    if acceptance >= 2 and "acceptance" in SPEC_FIELDS:
        sp.acceptance = draw(ACCEPTANCES)
    return sp


@st.composite
def cases(draw) -> Case:
    rpc, deadline, which, samp, spec = plan(draw, 5, 8)
    req = pb.GenerateRequest(request_id=draw(REQUEST_IDS))
    if which < 6:
        req.prompt = draw(PROMPTS)
    elif which == 6:
        req.messages.SetInParent()  # set even when empty
        req.messages.messages.extend(draw(MESSAGES))
    if samp >= 2:
        req.sampling.CopyFrom(draw(sampling()))
    if spec >= 3:
        req.speculation.CopyFrom(draw(speculation()))
    return Case(req, ["Generate", "GenerateStream"][rpc % 2],
                draw(st.sampled_from(TINY_DEADLINES)) if deadline >= 6 else None)


# ---- the oracle: what protos/specd.proto and ListModels promise ---------------------------------------------
@dataclass
class Verdict:
    """`must`: fields whose values the server must reject; `may`: fields it may reject (a limit the
    proto leaves to the server). The details of an INVALID_ARGUMENT must name one of either."""
    must: set[str] = field(default_factory=set)
    may: set[str] = field(default_factory=set)
    prompt_ids: list[int] | None = None  # when the prompt is plainly valid token ids
    max_tokens: int = DEFAULT_MAX_TOKENS
    temperature: float = 0.0
    num_beams: int = 1

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 and self.num_beams == 1


def expect(req: pb.GenerateRequest) -> Verdict:
    v = Verdict()
    if len(req.request_id.encode()) > 128:
        v.must.add("request_id")
    which = req.WhichOneof("input")
    if which is None:
        v.must.add("prompt")  # "Exactly one input is required"
    elif which == "messages":
        # must be non-empty; roles are "whatever the model's template accepts" and tiny has no template
        (v.must if not req.messages.messages else v.may).add("messages")
    else:
        pieces = req.prompt.split()
        if not pieces or len(pieces) > MAX_LEN:  # each piece is at least one token
            v.must.add("prompt")
        elif all(re.fullmatch(r"[0-9]+", p) for p in pieces):
            ids = [int(p) for p in pieces]
            if all(t < VOCAB for t in ids):
                v.prompt_ids = ids
            else:
                v.must.add("prompt")  # not a token id of this model
        elif any(re.fullmatch(r"-[0-9]*[1-9][0-9]*", p) for p in pieces):
            v.must.add("prompt")  # a negative id
        else:
            v.may.add("prompt")  # not plain decimal ids: the server may read them ("+5", "٣") or refuse
    s = req.sampling
    if s.HasField("max_tokens"):
        v.max_tokens = s.max_tokens
        if not 1 <= s.max_tokens <= MAX_TOKENS:
            v.must.add("max_tokens")
    if 1 <= v.max_tokens <= MAX_TOKENS and len(req.prompt.split()) + v.max_tokens > MAX_LEN:
        (v.must if v.prompt_ids is not None else v.may).update({"prompt", "max_tokens"})
    if s.HasField("temperature"):
        t = s.temperature
        v.temperature = t
        if not (t == 0 or MIN_TEMPERATURE <= t <= MAX_TEMPERATURE):  # NaN fails both comparisons
            v.must.add("temperature")
    if s.HasField("top_p") and not (MIN_TOP_P <= s.top_p <= 1):
        v.must.add("top_p")
    if s.HasField("num_beams"):
        v.num_beams = s.num_beams
        if not 1 <= s.num_beams <= 4:
            v.must.add("num_beams")
        elif s.num_beams > 1 and v.temperature != 0:
            v.must.update({"num_beams", "temperature"})
        elif s.num_beams > 1 and s.stop:
            v.must.update({"num_beams", "stop"})
    if s.HasField("length_penalty") and not abs(s.length_penalty) <= 10:
        v.must.add("length_penalty")
    if s.top_k < 0:
        v.must.add("top_k")
    if any(x == "" for x in s.stop):
        v.must.add("stop")
    if len(s.stop) > 16 or any(len(x) > 64 for x in s.stop):
        v.may.add("stop")  # the proto states no limit
    sp = req.speculation
    if sp.draft == "auto":
        v.may.add("draft")  # newer protos: the server picks a draft; older ones: an unknown name
    elif sp.draft not in ("", "none", *DRAFTS):
        v.must.add("draft")
    if sp.HasField("gamma") and not 0 <= sp.gamma <= 16:
        v.must.add("gamma")
    if sp.gamma_auto and sp.HasField("gamma"):
        v.must.add("gamma")  # "gamma must then be unset" (gamma_auto is named by "gamma" too)
    if "tree" in SPEC_FIELDS and sp.HasField("tree") and not 0 <= sp.tree <= 64:
        v.must.add("tree")
    if "threshold" in SPEC_FIELDS and sp.HasField("threshold") and not 0 <= sp.threshold <= 1:
        v.must.add("threshold")
    if "entropy_gate" in SPEC_FIELDS and sp.HasField("entropy_gate"):
        g = sp.entropy_gate
        if math.isnan(g) or g < 0:
            v.must.add("entropy_gate")
        elif math.isinf(g):
            v.may.add("entropy_gate")
    if "acceptance" in SPEC_FIELDS:
        verdict = acceptance_verdict(sp.acceptance)
        if verdict != "ok":
            getattr(v, verdict).add("acceptance")
    return v


def acceptance_verdict(a: str) -> str:
    """"ok", "must" (be rejected) or "may": "" | "lossless" | "topk:K", K in [1, 1000] |
    "typical:EPS", EPS in (0, 1). Other spellings of a number that lies in range ("topk:+5",
    "typical: 0.5") are the server's call."""
    if a in ("", "lossless"):
        return "ok"
    kind, sep, val = a.partition(":")
    if not sep or kind not in ("topk", "typical"):
        return "must"
    try:
        x = float(val)
    except ValueError:
        return "must"
    canonical = re.fullmatch(r"[0-9]+" if kind == "topk" else r"[0-9]*\.?[0-9]+(e-?[0-9]+)?", val)
    inside = (1 <= x <= 1000 and x == int(x)) if kind == "topk" else 0 < x < 1
    return "must" if not inside else "ok" if canonical else "may"


# ---- calling the server and checking the answer -------------------------------------------------------
@dataclass
class Answer:
    code: grpc.StatusCode
    details: str
    messages: list[pb.GenerateResponse]
    seconds: float


def call(stub, case: Case) -> Answer:
    t0 = time.monotonic()
    msgs: list[pb.GenerateResponse] = []
    try:
        if case.rpc == "Generate":
            msgs.append(stub.Generate(case.req, metadata=MD, timeout=case.deadline or CALL_TIMEOUT))
        else:
            msgs.extend(stub.GenerateStream(case.req, metadata=MD, timeout=case.deadline or CALL_TIMEOUT))
        return Answer(OK, "", msgs, time.monotonic() - t0)
    except grpc.RpcError as e:
        return Answer(e.code(), e.details() or "", msgs, time.monotonic() - t0)


def short(details: str, n: int = 300) -> str:
    """The last line of a details string (a server traceback's exception), shortened."""
    lines = [ln for ln in details.strip().splitlines() if ln.strip()]
    last = re.sub(r"\x1b\[[0-9;]*m", "", lines[-1] if lines else "")
    return last if len(last) <= n else last[:n] + "..."


_FAILURE_TYPES: dict[str, type] = {}


def failure_type(label: str) -> type[AssertionError]:
    """One AssertionError subclass per kind of failure (a status and its message, numbers aside), so
    that hypothesis reports, and shrinks, each bug it meets on its own."""
    key = re.sub(r"[0-9]+", "N", label)
    if key not in _FAILURE_TYPES:
        _FAILURE_TYPES[key] = type(f"ServerFailure{len(_FAILURE_TYPES) + 1}", (AssertionError,), {"__doc__": key})
    return _FAILURE_TYPES[key]


def _raise(kind: type, msg: str):
    raise kind(msg)  # one line for every failure: hypothesis also tells bugs apart by where they were raised


class Fuzz:
    """State shared by the examples of one run (hypothesis calls `example` once per case)."""

    def __init__(self, stub, reference):
        self.stub, self.reference = stub, reference  # reference(ids, n) -> the target's greedy tokens
        self.start = time.monotonic()
        self.end = self.start + SECONDS
        self.first_failure: float | None = None
        # Verdicts by case: hypothesis re-runs a case (replaying, shrinking) and must see what it saw
        # the first time, even where timing decides (a tiny deadline against a fast failure).
        self.failed: dict[bytes, tuple[type, str]] = {}
        self.passed: set[bytes] = set()
        self.distinct: dict[str, str] = {}  # kind of failure ("INTERNAL: <last line>") -> its first request
        self.seeded: dict[tuple, list[int]] = {}
        self.statuses: collections.Counter = collections.Counter()
        self.examples = self.calls = 0
        self._recent: collections.deque = collections.deque(maxlen=3)  # for the background's reports
        self._lock = threading.Lock()

    def recent(self) -> list[str]:
        """The last requests sent (read by the background thread when its stream fails)."""
        with self._lock:
            return list(self._recent)

    def summary(self) -> str:
        return (f"{self.examples} examples, {self.calls} calls to the server, "
                f"{time.monotonic() - self.start:.0f} s; statuses {dict(self.statuses)}")

    def fail(self, case: Case, label: str, msg: str):
        kind = failure_type(label)
        self.failed[case.key()] = (kind, msg)
        self.distinct.setdefault(kind.__doc__, repr(case))
        self.first_failure = self.first_failure or time.monotonic()
        _raise(kind, msg)

    def example(self, case: Case) -> None:
        self.examples += 1
        if case.key() in self.failed:
            _raise(*self.failed[case.key()])
        if case.key() in self.passed:
            return
        now = time.monotonic()
        if self.first_failure is None and now > self.end:
            return  # the time budget is spent: the remaining examples are no-ops
        if self.first_failure is not None and now > self.first_failure + SHRINK_SECONDS:
            return  # done shrinking: new candidates count as passing; the best failure is replayed above
        with self._lock:
            self._recent.append(f"{case.rpc} {one_line(case.req, 300)}")
        ans = call(self.stub, case)
        self.calls += 1
        self.statuses[ans.code.name] += 1
        if ans.code == DEADLINE:
            self.drain()
        problem = self.check(case, expect(case.req), ans)
        if problem:
            label = (f"{ans.code.name}: {short(ans.details, 160)}" if problem.startswith("status ")
                     else re.split(r"[0-9'\"\[{(]", problem)[0].strip())
            self.fail(case, label, f"{problem}\n  request: {case!r}\n  after {ans.seconds:.3f} s")
        self.passed.add(case.key())

    def drain(self, timeout: float = 5.0) -> None:
        """Wait until a request the client gave up on has left the server (only the background
        stream may remain), so that every answer belongs to the request that got it."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            st_ = self.stub.GetStats(pb.StatsRequest(), metadata=MD, timeout=timeout)
            if st_.requests_active <= 1 and all(r.active_sequences <= 1 for r in st_.replicas if r.role == "verifier"):
                return
            time.sleep(0.02)

    def check(self, case: Case, v: Verdict, ans: Answer) -> str | None:
        code, details = ans.code, ans.details
        allowed = {OK, INVALID, EXHAUSTED} | ({DEADLINE} if case.deadline else set())
        if code not in allowed:
            return f"status {code.name} (allowed: {sorted(c.name for c in allowed)}): {short(details, 2000)}"
        if code == INVALID:
            named = v.must | v.may
            if not named:
                return f"INVALID_ARGUMENT for a valid request: {details!r}"
            if not details.strip() or not any(f in details for f in named):
                return f"INVALID_ARGUMENT details {details!r} name none of the offending fields {sorted(named)}"
        elif code == EXHAUSTED:
            if not details.strip():
                return "RESOURCE_EXHAUSTED without details"
        elif code == OK:
            if v.must:
                return f"accepted although {sorted(v.must)} must be rejected"
            return self.check_ok(case, v, ans.messages)
        return None

    def check_ok(self, case: Case, v: Verdict, msgs: list[pb.GenerateResponse]) -> str | None:
        req = case.req
        if not msgs:
            return "OK without a single response message"
        last = msgs[-1]
        if any(m.finish_reason != pb.FINISH_REASON_UNSPECIFIED for m in msgs[:-1]):
            return "a finish_reason before the last stream message"
        if any(m.HasField("usage") for m in msgs[:-1]):
            return "usage on a stream message before the last"
        if last.finish_reason not in (pb.FINISH_REASON_LENGTH, pb.FINISH_REASON_STOP):
            return f"finish_reason {pb.FinishReason.Name(last.finish_reason)}"
        ids = {m.request_id for m in msgs}
        if len(ids) != 1 or (req.request_id and ids != {req.request_id}) or not last.request_id:
            return f"request ids {sorted(ids)!r} do not echo {req.request_id!r}"
        tokens = [t for m in msgs for t in m.token_ids]
        if last.usage.completion_tokens != len(tokens) or not 1 <= len(tokens) <= v.max_tokens:
            return f"{len(tokens)} tokens, usage {last.usage.completion_tokens}, max_tokens {v.max_tokens}"
        if last.finish_reason == pb.FINISH_REASON_LENGTH and len(tokens) != v.max_tokens:
            return f"finish LENGTH after {len(tokens)} of {v.max_tokens} tokens"
        if any(t >= VOCAB for t in tokens):
            return f"token ids outside the vocabulary: {tokens}"
        if v.prompt_ids is None:
            return None
        if last.usage.prompt_tokens != len(v.prompt_ids):
            return f"usage.prompt_tokens {last.usage.prompt_tokens} for a {len(v.prompt_ids)}-token prompt"
        if v.greedy:  # speculation never changes greedy output; a stop string can only cut it short
            ref = self.reference(v.prompt_ids, v.max_tokens)
            if tokens != ref[:len(tokens)] or (not req.sampling.stop and tokens != ref):
                return f"greedy output {tokens} differs from the target's {ref}"
        elif req.sampling.HasField("seed") or v.num_beams > 1:
            # identical seeded requests: identical tokens (prefixes); identical beam requests: identical
            # tokens (beam search's result depends on max_tokens and is deterministic whatever the drafts)
            s = req.sampling
            key = ((tuple(v.prompt_ids), s.temperature, s.top_p if s.HasField("top_p") else 1.0, s.top_k, s.seed,
                    req.speculation.SerializeToString(deterministic=True)) if v.num_beams == 1 else
                   (tuple(v.prompt_ids), v.max_tokens, v.num_beams,
                    s.length_penalty if s.HasField("length_penalty") else 1.0, s.early_stopping))
            seen = self.seeded.setdefault(key, tokens)
            n = min(len(seen), len(tokens))
            if seen[:n] != tokens[:n]:
                return f"seeded output {tokens} differs from an identical seeded request's {seen}"
            if len(tokens) > len(seen):
                self.seeded[key] = tokens
        return None


class Background(threading.Thread):
    """Streams BG_REQUEST again and again until stopped; every run must be exactly `expected`."""

    def __init__(self, stub, expected: list[int], fuzz: Fuzz):
        super().__init__(daemon=True, name="fuzz-background")
        self.stub, self.expected, self.fuzz = stub, expected, fuzz
        self.halt = threading.Event()
        self.completed = 0
        self.failures: list[str] = []

    def run(self) -> None:
        while not self.halt.is_set():
            tokens, problem = [], None
            try:
                for m in self.stub.GenerateStream(BG_REQUEST, metadata=MD, timeout=CALL_TIMEOUT):
                    tokens += m.token_ids
                    if m.request_id != BG_ID:
                        problem = f"request_id {m.request_id!r}"
            except grpc.RpcError as e:
                problem = f"{e.code().name}: {short(e.details() or '')}"
            if problem is None and tokens != self.expected:
                at = next((i for i, (a, b) in enumerate(zip(tokens, self.expected)) if a != b),
                          min(len(tokens), len(self.expected)))
                problem = f"{len(tokens)} tokens, differing from the target's greedy output from index {at}"
            if problem is None:
                self.completed += 1
            elif len(self.failures) < 5:
                self.failures.append(f"{problem}; fuzz requests sent just before: {self.fuzz.recent()}")


# ---- the run -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def fuzzed(start_cluster, tiny, hf_greedy):
    """Start the cluster, the background stream and the fuzz; return what happened."""
    addr, client = start_cluster(CONFIG, timeout=90)
    channel = grpc.insecure_channel(addr)
    stub = specd_pb2_grpc.SpecDecodeStub(channel)
    models = client.list_models()
    assert (models.max_tokens, models.context_length, models.max_gamma) == (MAX_TOKENS, MAX_LEN, 16)
    assert set(DRAFTS) <= {d.name for d in models.drafts}

    def reference(ids, n):
        return hf_greedy(tiny.model, ids, n)

    expected = reference(BG_PROMPT, BG_TOKENS)
    plain = stub.Generate(pb.GenerateRequest(prompt=BG_REQUEST.prompt, sampling=pb.SamplingParams(max_tokens=BG_TOKENS),
                                             speculation=pb.SpeculationParams(draft="none")),
                          metadata=MD, timeout=CALL_TIMEOUT)
    assert list(plain.token_ids) == expected, "the plain request is not the target's greedy output"

    fuzz = Fuzz(stub, reference)
    bg = Background(stub, expected, fuzz)
    bg.start()
    error: BaseException | None = None

    @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=not LONG_RUN,
              suppress_health_check=list(HealthCheck), print_blob=LONG_RUN)
    @given(case=cases())
    def fuzz_request(case):
        fuzz.example(case)

    t0 = time.monotonic()
    try:
        fuzz_request()
    except Exception as e:  # noqa: BLE001 -- reported by test_every_answer_is_ok_or_a_precise_status
        error = e
    seconds = time.monotonic() - t0
    bg.halt.set()
    bg.join(timeout=CALL_TIMEOUT + 5)
    print(f"\nfuzz: {fuzz.summary()}; {seconds:.0f} s with shrinking; background streams completed: "
          f"{bg.completed}, failed: {len(bg.failures)}")
    yield {"client": client, "stub": stub, "fuzz": fuzz, "bg": bg, "error": error, "reference": reference}
    channel.close()


def test_every_answer_is_ok_or_a_precise_status(fuzzed):
    fuzz, error = fuzzed["fuzz"], fuzzed["error"]
    if error is not None:
        errors = list(getattr(error, "exceptions", [error]))  # hypothesis groups distinct bugs
        shrunk = "\n\n".join(f"{type(e).__name__}: {e}\n" + "\n".join(getattr(e, "__notes__", [])) for e in errors)
        seen = "\n".join(f"  {label}\n    first request: {req}" for label, req in fuzz.distinct.items())
        raise AssertionError(f"{type(error).__name__}: {len(errors)} failure(s), shrunk:\n\n{shrunk}\n\n"
                             f"every kind of failure seen ({fuzz.summary()}):\n{seen}") from None
    assert fuzz.calls >= min(EXAMPLES, 50), f"the fuzz barely ran: {fuzz.summary()}"


def test_concurrent_stream_completes_with_its_expected_tokens(fuzzed):
    bg = fuzzed["bg"]
    assert not bg.failures, "the unrelated stream was hurt:\n" + "\n".join(bg.failures)
    assert bg.completed >= 1 and not bg.is_alive()


def test_server_keeps_serving(fuzzed):
    client, stub, reference = fuzzed["client"], fuzzed["stub"], fuzzed["reference"]
    assert client.health() == "SERVING"
    r = stub.Generate(pb.GenerateRequest(prompt="11 12 13 11 12", sampling=pb.SamplingParams(max_tokens=16)),
                      metadata=MD, timeout=CALL_TIMEOUT)
    assert list(r.token_ids) == reference([11, 12, 13, 11, 12], 16)
    end = time.time() + 30  # aborted and timed-out requests release their KV
    while True:
        st_ = client.stats()
        if st_.requests_active == 0 and st_.replicas and all(x.kv_slots_in_use == 0 for x in st_.replicas):
            break
        assert time.time() < end, f"KV or requests still held after the fuzz: {st_}"
        time.sleep(0.3)
    assert {x.role for x in st_.replicas} == {"verifier", "draft"}


N_POOL = 160  # tokens per request: long enough that all twelve are in flight together


def test_draft_pool_smaller_than_the_load(fuzzed):
    """Twelve requests at once on the remote draft, whose pool holds DRAFT_SLOTS sequences for the
    verifier's four KV slots and the router's MAX_QUEUE: the router refuses what it cannot admit
    (RESOURCE_EXHAUSTED naming router.max_queue), the verifier queues what it cannot seat, rows
    that find no draft slot run at γ=0 until one frees (the draft replica reports them `full`),
    and every admitted request still ends with exactly the target's greedy tokens. Nothing
    raises, and afterwards no KV is held on either side."""
    import concurrent.futures as cf

    client, stub, reference = fuzzed["client"], fuzzed["stub"], fuzzed["reference"]

    def remote_stats() -> dict:
        return next(r for r in client.stats().replicas if r.role == "draft")

    import threading

    prompts = [[20 + i, 21 + i, 22 + i, 23 + i] for i in range(12)]  # distinct: nothing coalesces
    together = threading.Barrier(len(prompts))  # all at once: a slow thread start must not let the first finish

    def call(ids):
        req = pb.GenerateRequest(prompt=" ".join(map(str, ids)), sampling=pb.SamplingParams(max_tokens=N_POOL),
                                 speculation=pb.SpeculationParams(draft="remote", gamma=3))
        together.wait()
        try:
            return list(stub.Generate(req, metadata=MD, timeout=CALL_TIMEOUT).token_ids)
        except grpc.RpcError as e:
            return e
    verifier = next(r for r in client.stats().replicas if r.role == "verifier")
    full_before = _full_rows(fuzzed)
    with cf.ThreadPoolExecutor(len(prompts)) as ex:
        out = list(ex.map(call, prompts))
    refused = [o for o in out if isinstance(o, grpc.RpcError)]
    assert all(e.code() == EXHAUSTED and f"router.max_queue = {MAX_QUEUE}" in e.details() for e in refused), refused
    assert 0 < len(refused) <= len(prompts) - MAX_QUEUE  # the first MAX_QUEUE always find room
    for ids, o in zip(prompts, out):
        if not isinstance(o, grpc.RpcError):
            assert o == reference(ids, N_POOL)
    assert _full_rows(fuzzed) > full_before, "no row ever lacked a draft slot: the pool was not the bottleneck"
    end = time.time() + 30
    while any(r.kv_slots_in_use for r in client.stats().replicas) and time.time() < end:
        time.sleep(0.2)
    assert all(r.kv_slots_in_use == 0 for r in client.stats().replicas)
    assert verifier.kv_slots_total == 4 and remote_stats().kv_slots_total == DRAFT_SLOTS


def _full_rows(fuzzed) -> int:
    """Rows the verifier sent to the remote draft that found no slot there (it ran them at γ=0)."""
    from ray import serve

    return serve.get_deployment_handle("Verifier", app_name="specd").stats.remote().result()[
        "remote_drafts"]["remote"]["full_rows"]
