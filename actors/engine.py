"""The speculative-decoding engine: a continuous batch of sequences, one target pass per step.

Each `step()`:
  1. admits waiting requests into free KV slots and prefills them (one padded pass),
     committing each one's first token;
  2. asks each sequence's drafter for up to γ tokens, telling it how far to roll back;
  3. scores every row's [last committed token, drafts...] in ONE batched target pass;
  4. accepts the longest acceptable prefix per row plus one recovered/bonus token
     (`sampling.verify_greedy` / `verify_sampled`), rolls the target KV back to the
     accepted prefix (a length update, no re-prefill), and commits tokens,
     checking max_tokens, EOS and stop strings.
γ = 0 (or no drafter) is plain decoding through the same code: the baseline.

Pipelining (`pipeline=True`, `set_pipeline`): sequences whose drafter can propose
asynchronously (`propose_async`: drafts on other processes, e.g. Ray draft replicas) are
split into two micro-batches. Each step verifies one of them while the draft calls for the
other are already in flight; right after a micro-batch is verified and committed its next
draft calls are sent, so they run on the draft replicas while the target verifies the other
micro-batch. Sequences with local drafters (or none) join every step's target pass and draft
in the step itself, as without pipelining. The accept rule and per-row randomness are the
same, so greedy output is identical with pipelining on or off. `batcher_stats` records where
the batcher's time goes (target passes, drafting it waited for, drafting hidden behind it).

Target KV invariant: it holds every committed token except the last one, which
is the first input of the next verify pass.

Does not know: Ray, gRPC, or how requests arrive; the caller drives `step()`.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

import torch

from .drafters.base import KV_HEADROOM, MAX_GAMMA, Drafter, DraftSeq
from .gamma import AdaptiveGamma, PassCost
from .llama import LlamaRunner
from .sampling import process_logits, sample, verify_greedy, verify_sampled


@dataclass
class SamplingParams:
    """Per-request decoding parameters. `validate` names the field and the limit on error."""
    max_tokens: int = 128
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0  # nucleus mass, in (0, 1]
    top_k: int = 0  # 0 = disabled
    seed: int | None = None  # reproducible sampling; None = random
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False

    def validate(self, max_tokens_limit: int) -> None:
        if not isinstance(self.max_tokens, int) or not 1 <= self.max_tokens <= max_tokens_limit:
            raise ValueError(f"max_tokens must be in [1, {max_tokens_limit}], got {self.max_tokens}")
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop strings must be non-empty strings, got {self.stop!r}")


@dataclass
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    draft: str | None = None  # a drafter name registered with the engine, or None
    gamma: int = 0  # draft tokens per step; 0 = speculation off


@dataclass
class SpecStats:
    """Speculation counters, vLLM's convention: mean accepted length = 1 + accepted / drafts."""
    drafts: int = 0  # verify steps that had >= 1 draft token
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=lambda: [0] * MAX_GAMMA)
    drafted_per_pos: list[int] = field(default_factory=lambda: [0] * MAX_GAMMA)
    steps: int = 0  # target verify passes
    draft_s: float = 0.0
    verify_s: float = 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        return 1 + self.accepted_tokens / self.drafts if self.drafts else 1.0

    def per_position(self) -> list[float]:
        return [a / d for a, d in zip(self.accepted_per_pos, self.drafted_per_pos) if d]

    def add(self, other: "SpecStats", times: bool = True) -> None:
        names = ["drafts", "draft_tokens", "accepted_tokens", "steps"] + (["draft_s", "verify_s"] if times else [])
        for name in names:
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for j in range(MAX_GAMMA):
            self.accepted_per_pos[j] += other.accepted_per_pos[j]
            self.drafted_per_pos[j] += other.drafted_per_pos[j]

    def to_dict(self) -> dict:
        return {"drafts": self.drafts, "draft_tokens": self.draft_tokens,
                "accepted_tokens": self.accepted_tokens, "acceptance_rate": self.acceptance_rate,
                "mean_accepted_length": self.mean_accepted_length,
                "acceptance_per_position": self.per_position(), "target_passes": self.steps,
                "draft_s": self.draft_s, "verify_s": self.verify_s}


@dataclass
class StepOutput:
    """What one step committed for one request (a stream delta)."""
    request_id: str
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None = None  # "length" | "stop" | "abort"


@dataclass(eq=False)
class _Seq:
    req: Request
    slot: int
    seq_id: int
    tokens: list[int]  # prompt + committed output
    num_prompt: int
    seed: int  # the request's seed, or a random one; the drafter derives its generator from it
    gen: torch.Generator
    draft_keep: int = 0  # tokens of the drafter's view that are still valid
    draft_sent: int = 0  # committed tokens the drafter has been told about
    hid_len: int = 0  # committed tokens whose target hidden state is in the engine's buffer
    hid_sent: int = 0  # of those, how many the drafter has received
    stats: SpecStats = field(default_factory=SpecStats)
    text: str = ""  # detokenised output so far (emitted)
    finish_reason: str | None = None
    stop_at: int | None = None  # where a stop string starts in the decoded output
    t_admit: float = 0.0
    mb: int | None = None  # pipelined: which micro-batch (0 or 1) the sequence is verified in
    flight: "_Flight | None" = None  # pipelined: draft calls sent for it, not yet verified

    @property
    def output(self) -> list[int]:
        return self.tokens[self.num_prompt:]


@dataclass(eq=False)
class _Flight:
    """Draft calls for some sequences, sent (or, for local drafters, already answered) and not
    yet verified. `resolve` waits for every answer once and keeps the drafts."""
    seqs: list[_Seq]
    gamma: list[int]
    waiters: list[tuple[str, list[int], object]]  # (drafter name, rows, () -> Proposal)
    t_launch: float
    launch_s: float = 0.0  # time in the launching call (local drafting, sending remote calls)
    drafts: list[list[int]] | None = None
    probs: dict[int, torch.Tensor] = field(default_factory=dict)  # row -> [k, V]
    own_s: dict[str, float] = field(default_factory=dict)  # per drafter: time in its launching call
    group_s: list[tuple[str, list[int], float]] = field(default_factory=list)  # adaptive-γ cost per group
    wait_s: float = 0.0  # time blocked on asynchronous answers in `resolve`
    blocked_s: float = 0.0  # time an asynchronous-capable drafter was called synchronously (plain step)
    done_at: float = 0.0
    error: BaseException | None = None

    def resolve(self) -> None:
        if self.drafts is not None:
            return
        if self.error is not None:
            raise self.error
        t0 = time.perf_counter()
        drafts: list[list[int]] = [[] for _ in self.seqs]
        try:
            for name, rows, wait in self.waiters:
                tg = time.perf_counter()
                prop = wait()
                self.group_s.append((name, rows, self.own_s.get(name, 0.0) + time.perf_counter() - tg))
                for i, b in enumerate(rows):
                    k = prop.num_draft[i]
                    drafts[b] = prop.tokens[i, :k].tolist()
                    if prop.probs is not None and self.seqs[b].req.params.temperature > 0:
                        self.probs[b] = prop.probs[i, :k]
        except BaseException as e:
            self.error = e
            raise
        self.waiters = []
        self.drafts = drafts
        self.done_at = time.perf_counter()
        self.wait_s = self.done_at - t0


BATCHER_STATS = ("target_passes", "rows_verified", "pipelined_steps", "verify_s", "prefill_s", "draft_s",
                 "draft_wait_s", "draft_flight_s")


class SpecEngine:
    """Continuous-batching speculative decoder over one target and named drafters."""

    def __init__(self, target: LlamaRunner, drafters: dict[str, Drafter] | None = None,
                 tokenizer=None, eos_token_ids: set[int] | None = None,
                 max_batch: int = 8, max_len: int = 2048, adaptive_gamma: bool = False,
                 seq_id_base: int = 0, pipeline: bool = False):
        """adaptive_gamma: treat each request's γ as a maximum and pick the draft length per
        step for goodput (see gamma.py); off = every request drafts its own γ.
        pipeline: overlap asynchronous drafters with target passes over two micro-batches."""
        self.target = target
        self.drafters = dict(drafters or {})
        self.tokenizer = tokenizer
        self.eos = set(eos_token_ids or ())
        if max_len + KV_HEADROOM > target.max_position:
            raise ValueError(f"max_len {max_len} + {KV_HEADROOM} positions of headroom exceeds the model's "
                             f"max_position_embeddings {target.max_position}")
        self.max_batch, self.max_len = max_batch, max_len
        self.cache = target.new_cache(max_batch, max_len + KV_HEADROOM)
        self.waiting: list[Request] = []
        self.active: dict[str, _Seq] = {}
        self.free_slots = list(range(max_batch))
        self.stats = SpecStats()  # counts: finished requests; times: every step's wall time
        self.finished: dict[str, _Seq] = {}
        self._next_seq = seq_id_base  # drafter-side ids; distinct per engine when drafters are shared
        self.adaptive_gamma = adaptive_gamma
        self._policy: AdaptiveGamma | None = None  # built on first use (measures the pass cost)
        # Target hidden states of committed tokens, per slot, for feature-level drafters
        # (EAGLE heads): they reach the drafter with the rollback information.
        self.hidden_buf = (torch.zeros(max_batch, max_len + KV_HEADROOM, target.hidden_size, dtype=target.dtype)
                           if any(d.wants_hidden for d in self.drafters.values()) else None)
        self.pipeline = bool(pipeline)
        self._turn = 0  # pipelined: the micro-batch verified next
        # Where the batcher's time goes, cumulative (both modes): target verify passes and rows,
        # verify_s (target pass + accept + commit), prefill_s, draft_s (drafting the batcher did
        # or waited for: not hidden behind a target pass), draft_wait_s (of which, blocked on
        # asynchronous answers), draft_flight_s (pipelined: send -> answers in hand, per flight;
        # minus the waits it is the drafting hidden behind target passes).
        self.batcher_stats = {k: 0.0 if k.endswith("_s") else 0 for k in BATCHER_STATS}

    def set_pipeline(self, on: bool) -> None:
        """Turn pipelining on or off between steps. Turning it off sends no new asynchronous
        draft calls; those in flight are verified by the next steps, then steps are plain."""
        self.pipeline = bool(on)

    @property
    def gamma_policy(self) -> AdaptiveGamma:
        if self._policy is None:
            self._policy = AdaptiveGamma(PassCost.measure(self.target, self.max_batch * (MAX_GAMMA + 1)))
        return self._policy

    # ---- admission -------------------------------------------------------------------------
    def validate(self, req: Request) -> None:
        if not req.prompt_ids:
            raise ValueError("prompt must not be empty")
        if any(not 0 <= t < self.target.vocab_size for t in req.prompt_ids):
            raise ValueError(f"prompt token ids must be in [0, {self.target.vocab_size})")
        req.params.validate(self.max_len - 1)
        if len(req.prompt_ids) + req.params.max_tokens > self.max_len:
            raise ValueError(f"prompt ({len(req.prompt_ids)} tokens) + max_tokens ({req.params.max_tokens}) "
                             f"must fit the context of {self.max_len} tokens")
        if not 0 <= req.gamma <= MAX_GAMMA:
            raise ValueError(f"gamma must be in [0, {MAX_GAMMA}], got {req.gamma}")
        if req.gamma > 0 and req.draft is None:
            raise ValueError("gamma > 0 needs a draft")
        if req.draft is not None and req.draft not in self.drafters:
            raise ValueError(f"unknown draft {req.draft!r}; available: {sorted(self.drafters)}")
        if req.request_id in self.active or any(w.request_id == req.request_id for w in self.waiting):
            raise ValueError(f"request_id {req.request_id!r} is already in flight")

    def add_request(self, req: Request) -> None:
        self.validate(req)
        self.waiting.append(req)

    def abort(self, request_id: str) -> bool:
        """Stop a request now and free its KV on the target and its drafter."""
        for i, r in enumerate(self.waiting):
            if r.request_id == request_id:
                del self.waiting[i]
                return True
        seq = self.active.get(request_id)
        if seq is None:
            return False
        if seq.flight is not None:
            # Its draft call may still be running on a draft replica: let it finish before the
            # release, so the replica frees the state (the drafts stay with the other rows).
            try:
                seq.flight.resolve()
            except Exception:  # a failed call holds no state; the other rows see the error
                pass
            seq.flight = None
        self._finish(seq, "abort")
        return True

    def has_work(self) -> bool:
        return bool(self.waiting or self.active)

    def kv_slots_in_use(self) -> int:
        return len(self.active)

    # ---- the step --------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[StepOutput]:
        outputs: dict[str, StepOutput] = {}
        self._admit(outputs)
        seqs = sorted(self.active.values(), key=lambda s: s.slot)
        if seqs:
            pipelined = self.pipeline and any(self._pipelinable(s) for s in seqs)
            if pipelined or any(s.flight is not None for s in seqs):  # (draining flights after turning it off)
                self._step_pipelined(seqs, outputs)
            else:
                self._speculate(seqs, outputs)
        return list(outputs.values())

    def _admit(self, outputs: dict[str, StepOutput]) -> None:
        new: list[_Seq] = []
        while self.waiting and self.free_slots:
            req = self.waiting.pop(0)
            seed = req.params.seed if req.params.seed is not None else int.from_bytes(os.urandom(7), "little")
            seq = _Seq(req=req, slot=self.free_slots.pop(0), seq_id=self._next_seq, tokens=list(req.prompt_ids),
                       num_prompt=len(req.prompt_ids), seed=seed, gen=torch.Generator().manual_seed(seed),
                       t_admit=time.perf_counter())
            self._next_seq += 1
            self.active[req.request_id] = seq
            new.append(seq)
        if not new:
            return
        new.sort(key=lambda s: s.slot)
        t0 = time.perf_counter()
        lens = [s.num_prompt for s in new]
        feed = torch.zeros(len(new), max(lens), dtype=torch.long)
        for b, s in enumerate(new):
            feed[b, :lens[b]] = torch.tensor(s.tokens, dtype=torch.long)
        hidden = self.target.forward(self.cache, [s.slot for s in new], feed, lens)  # [B, P, E]
        last = hidden[torch.arange(len(new)), torch.tensor(lens) - 1]  # [B, E]
        if self.hidden_buf is not None:
            for b, s in enumerate(new):
                self._keep_hidden(s, hidden[b, :lens[b]])
        logits = self.target.logits(last).float()  # [B, V]
        first = self._sample_one(new, logits)
        # The KV holds the prompt; `first` is committed but not in it: the invariant holds.
        for b, s in enumerate(new):
            self._commit(s, [first[b]], outputs)
        self.stats.verify_s += time.perf_counter() - t0
        self.batcher_stats["prefill_s"] += time.perf_counter() - t0

    def _sample_one(self, seqs: list[_Seq], logits: torch.Tensor) -> list[int]:
        """logits [B, V] -> one token per row (greedy argmax, or a draw from the processed target)."""
        toks = logits.argmax(-1)
        rows = [b for b, s in enumerate(seqs) if s.req.params.temperature > 0]
        if rows:
            p = self._process(logits[rows], [seqs[b] for b in rows])
            toks[rows] = sample(p, [seqs[b].gen for b in rows])
        return toks.tolist()

    @staticmethod
    def _process(logits: torch.Tensor, seqs: list[_Seq]) -> torch.Tensor:
        return process_logits(
            logits,
            torch.tensor([s.req.params.temperature for s in seqs]),
            torch.tensor([s.req.params.top_k for s in seqs], dtype=torch.long),
            torch.tensor([s.req.params.top_p for s in seqs]))

    def _speculate(self, seqs: list[_Seq], outputs: dict[str, StepOutput]) -> None:
        """The plain step: draft for every active sequence, then verify them all in one pass."""
        t0 = time.perf_counter()
        fl = self._launch(seqs, asynchronous=False)
        fl.resolve()
        t1 = time.perf_counter()
        self._verify(seqs, fl.drafts, fl.probs, fl.group_s, [t1 - t0] * len(seqs), outputs)
        self.stats.draft_s += t1 - t0
        bs = self.batcher_stats
        bs["draft_s"] += t1 - t0
        bs["draft_wait_s"] += fl.blocked_s + fl.wait_s

    # ---- pipelining --------------------------------------------------------------------------
    def _pipelinable(self, s: _Seq) -> bool:
        """Drafts for it can be in flight while the target works: an asynchronous drafter."""
        return (s.req.draft is not None and s.req.gamma > 0
                and hasattr(self.drafters[s.req.draft], "propose_async"))

    def _step_pipelined(self, seqs: list[_Seq], outputs: dict[str, StepOutput]) -> None:
        """Verify one micro-batch (plus every sequence with a local drafter) while the draft
        calls of the other micro-batch run elsewhere; then send this micro-batch's next calls."""
        pipe = [s for s in seqs if self._pipelinable(s) or s.flight is not None]
        in_pipe = {id(s) for s in pipe}
        local = [s for s in seqs if id(s) not in in_pipe]
        for s in pipe:  # newcomers join the smaller micro-batch
            if s.mb is None:
                s.mb = 0 if sum(x.mb == 0 for x in pipe) <= sum(x.mb == 1 for x in pipe) else 1
        mbs = [[s for s in pipe if s.mb == i] for i in (0, 1)]
        cur = self._turn if mbs[self._turn] else 1 - self._turn
        self._turn = 1 - cur
        bs = self.batcher_stats
        t0 = time.perf_counter()
        # Calls for this micro-batch first (it is waited for first), then the other's; local
        # drafters propose meanwhile, in this thread.
        for group in (mbs[cur], mbs[1 - cur] if self.pipeline else []):
            lacking = [s for s in group if s.flight is None]
            if lacking:
                self._launch(lacking, asynchronous=True)
        local_fl = self._launch(local, asynchronous=False) if local else None
        mine: list[_Flight] = []
        for s in mbs[cur]:
            if all(s.flight is not f for f in mine):
                mine.append(s.flight)
        for f in mine + ([local_fl] if local_fl else []):
            f.resolve()
        t2 = time.perf_counter()
        rows = sorted(mbs[cur] + local, key=lambda s: s.slot)
        drafts, probs, group_s, draft_s = [], {}, [], []
        where = {id(s): b for b, s in enumerate(rows)}
        for f in mine + ([local_fl] if local_fl else []):
            for name, frows, sec in f.group_s:
                group_s.append((name, [where[id(f.seqs[i])] for i in frows if id(f.seqs[i]) in where], sec))
        for b, s in enumerate(rows):
            f = s.flight if s.flight is not None else local_fl
            i = next(i for i, x in enumerate(f.seqs) if x is s)
            drafts.append(f.drafts[i])
            if i in f.probs:
                probs[b] = f.probs[i]
            draft_s.append(f.launch_s + f.wait_s)
            s.flight = None
        self._verify(rows, drafts, probs, group_s, draft_s, outputs)
        t3 = time.perf_counter()
        bs["pipelined_steps"] += 1
        bs["draft_s"] += t2 - t0
        bs["draft_wait_s"] += sum(f.wait_s for f in mine)
        bs["draft_flight_s"] += sum(f.done_at - f.t_launch for f in mine)
        self.stats.draft_s += t2 - t0
        if self.pipeline:
            # This micro-batch's next draft calls go out now, to run during the other's pass.
            # Rebalance first: finished sequences may have left the micro-batches uneven.
            live = [s for s in mbs[cur] if self.active.get(s.req.request_id) is s]
            other = [s for s in mbs[1 - cur] if self.active.get(s.req.request_id) is s]
            move = (len(live) - len(other)) // 2
            moved = live[len(live) - move:] if move > 0 else []
            for s in moved:
                s.mb = 1 - cur
            stay = live[:len(live) - len(moved)]
            for group in (moved, stay):  # `moved` is verified next: its calls go out first
                if group:
                    self._launch(group, asynchronous=True)
            bs["draft_s"] += time.perf_counter() - t3
            self.stats.draft_s += time.perf_counter() - t3

    def _launch(self, seqs: list[_Seq], asynchronous: bool) -> _Flight:
        """Ask each sequence's drafter for its drafts, grouped by drafter. asynchronous: send
        the calls of drafters that can answer later (`propose_async`) and return at once; the
        rest (and everything when not asynchronous) propose now, in this thread."""
        t0 = time.perf_counter()
        B = len(seqs)
        gamma = [min(s.req.gamma, self._room(s)) if s.req.draft is not None else 0 for s in seqs]
        groups: dict[str, list[int]] = {}
        for b, s in enumerate(seqs):
            if gamma[b] > 0:
                groups.setdefault(s.req.draft, []).append(b)
        if self.adaptive_gamma:
            for name, rows in list(groups.items()):
                g = self.gamma_policy.choose(name, max(gamma[b] for b in rows), len(rows), B - len(rows))
                for b in rows:
                    gamma[b] = min(gamma[b], g)
                if g == 0:
                    del groups[name]
        fl = _Flight(seqs=list(seqs), gamma=gamma, waiters=[], t_launch=t0)
        for name, rows in groups.items():
            drafter = self.drafters[name]
            dseqs = []
            for b in rows:
                s = seqs[b]
                p = s.req.params
                ds = DraftSeq(seq_id=s.seq_id, keep=s.draft_keep, new_tokens=s.tokens[s.draft_keep:],
                              gamma=gamma[b], temperature=p.temperature,
                              top_k=p.top_k, top_p=p.top_p, seed=s.seed)
                if drafter.wants_hidden:
                    ds.hidden_start = s.hid_sent
                    ds.hidden = self.hidden_buf[s.slot, s.hid_sent:s.hid_len].clone()
                    ds.hidden_history = self.hidden_buf[s.slot, :s.hid_len]  # for a lost drafter's re-prefill
                    s.hid_sent = s.hid_len
                dseqs.append(ds)
                # The drafter's view is now committed + its drafts.
                s.draft_keep = len(s.tokens)
            tg = time.perf_counter()
            if asynchronous and hasattr(drafter, "propose_async"):
                wait = drafter.propose_async(dseqs)
            else:
                prop = drafter.propose(dseqs)
                wait = (lambda prop=prop: prop)
                if hasattr(drafter, "propose_async"):
                    fl.blocked_s += time.perf_counter() - tg
            fl.own_s[name] = time.perf_counter() - tg
            fl.waiters.append((name, rows, wait))
        if asynchronous:
            for s in seqs:
                s.flight = fl
        fl.launch_s = time.perf_counter() - t0
        return fl

    def _verify(self, seqs: list[_Seq], drafts: list[list[int]], draft_probs: dict[int, torch.Tensor],
                group_s: list[tuple[str, list[int], float]], draft_s: list[float],
                outputs: dict[str, StepOutput]) -> None:
        """One batched target pass over every row's drafts, acceptance, rollback, commit."""
        B = len(seqs)
        t1 = time.perf_counter()

        # 2. One batched target pass over [last committed, d_1 .. d_k] for every row.
        G = max(len(d) for d in drafts)
        feed = torch.zeros(B, G + 1, dtype=torch.long)
        for b, s in enumerate(seqs):
            feed[b, 0] = s.tokens[-1]
            feed[b, 1:1 + len(drafts[b])] = torch.tensor(drafts[b], dtype=torch.long)
        starts = [self.cache.lengths[s.slot] for s in seqs]
        num_new = [len(d) + 1 for d in drafts]
        hidden = self.target.forward(self.cache, [s.slot for s in seqs], feed, num_new)  # [B, G+1, E]
        logits = self.target.logits(hidden).float()  # [B, G+1, V]

        # 3. Accept.
        draft_t = torch.zeros(B, G, dtype=torch.long)
        for b, d in enumerate(drafts):
            draft_t[b, :len(d)] = torch.tensor(d, dtype=torch.long)
        num_draft = torch.tensor([len(d) for d in drafts], dtype=torch.long)
        n_acc, out = verify_greedy(logits, draft_t, num_draft)  # [B], [B, G+1]
        rows = [b for b, s in enumerate(seqs) if s.req.params.temperature > 0]
        if rows:
            sub = [seqs[b] for b in rows]
            p_target = self._process(logits[rows], sub)  # [Bs, G+1, V]
            if any(b in draft_probs for b in rows):
                q = torch.zeros(len(rows), G, logits.shape[-1])
                for i, b in enumerate(rows):
                    if b in draft_probs:
                        q[i, :len(drafts[b])] = draft_probs[b]
                    elif drafts[b]:  # a deterministic drafter in a mixed batch: one-hot q
                        q[i, torch.arange(len(drafts[b])), draft_t[b, :len(drafts[b])]] = 1.0
            else:
                q = None
            # Verify each row at its own draft length, so its random draws (k uniforms + one
            # sample per step) do not depend on the rest of the batch: a seed reproduces the output.
            by_gamma: dict[int, list[int]] = {}
            for i, b in enumerate(rows):
                by_gamma.setdefault(len(drafts[b]), []).append(i)
            for g, idx in by_gamma.items():
                rb = [rows[i] for i in idx]
                s_acc, s_out = verify_sampled(p_target[idx, :g + 1], None if q is None else q[idx, :g],
                                              draft_t[rb, :g], num_draft[rb], [sub[i].gen for i in idx])
                n_acc[rb] = s_acc
                out[rb] = -1
                out[rb, :g + 1] = s_out
        t2 = time.perf_counter()

        # 4. Roll back and commit.
        n_acc_l, out_l = n_acc.tolist(), out.tolist()
        if self.adaptive_gamma:
            for name, rows, sec in group_s:
                if rows:
                    self.gamma_policy.observe(name, [len(drafts[b]) for b in rows], [n_acc_l[b] for b in rows],
                                              sec)
        for b, s in enumerate(seqs):
            a, k = n_acc_l[b], len(drafts[b])
            # KV now holds [.., last, d_1..d_k]; keep [.., last, d_1..d_a].
            self.cache.truncate(s.slot, starts[b] + 1 + a)
            if self.hidden_buf is not None:
                self._keep_hidden(s, hidden[b, :a + 1])
            if k:
                s.draft_keep += a  # drafter view: committed + k drafts, of which a survive
                st = s.stats
                st.drafts += 1
                st.draft_tokens += k
                st.accepted_tokens += a
                for j in range(k):
                    st.drafted_per_pos[j] += 1
                    st.accepted_per_pos[j] += j < a
            s.stats.steps += 1
            s.stats.draft_s += draft_s[b]
            s.stats.verify_s += t2 - t1
            self._commit(s, out_l[b][:a + 1], outputs)
        self.stats.verify_s += t2 - t1
        bs = self.batcher_stats
        bs["target_passes"] += 1
        bs["rows_verified"] += B
        bs["verify_s"] += time.perf_counter() - t1

    def _keep_hidden(self, s: _Seq, h: torch.Tensor) -> None:
        """Append the target's hidden states of newly committed tokens (all but the last one)."""
        self.hidden_buf[s.slot, s.hid_len:s.hid_len + len(h)] = h
        s.hid_len += len(h)

    def _room(self, s: _Seq) -> int:
        """Draft no further than the tokens the request may still emit."""
        return max(0, s.req.params.max_tokens - len(s.output) - 1)

    # ---- committing --------------------------------------------------------------------------
    def _commit(self, s: _Seq, new: list[int], outputs: dict[str, StepOutput]) -> None:
        p = s.req.params
        emitted: list[int] = []
        reason = None
        for tok in new:
            s.tokens.append(tok)
            emitted.append(tok)
            if not p.ignore_eos and tok in self.eos:
                reason = "stop"
                break
            if p.stop and self._hit_stop(s):
                reason = "stop"
                break
            if len(s.output) >= p.max_tokens:
                reason = "length"
                break
        text = self._text_delta(s, final=reason is not None)
        prev = outputs.get(s.req.request_id)
        if prev is not None:  # admitted and stepped in the same call
            prev.token_ids += emitted
            prev.text += text
        else:
            outputs[s.req.request_id] = prev = StepOutput(s.req.request_id, emitted, text, False)
        if reason is not None:
            prev.finished, prev.finish_reason = True, reason
            self._finish(s, reason)

    def _decode(self, s: _Seq) -> str:
        return self.tokenizer.decode(s.output, skip_special_tokens=True) if self.tokenizer is not None else ""

    def _hit_stop(self, s: _Seq) -> bool:
        full = self._decode(s)
        for stop in s.req.params.stop:
            i = full.find(stop, max(0, len(s.text) - len(stop)))
            if i >= 0:
                s.stop_at = i
                return True
        return False

    def _text_delta(self, s: _Seq, final: bool) -> str:
        if self.tokenizer is None:
            return ""
        full = self._decode(s)
        if s.stop_at is not None:
            full = full[:s.stop_at]
        elif not final:
            if full.endswith("\ufffd"):
                return ""  # an incomplete UTF-8 sequence: wait for the next token
            # Hold back a tail that may be the start of a stop string: it must never be streamed.
            hold = max((k for stop in s.req.params.stop for k in range(1, len(stop))
                        if full.endswith(stop[:k])), default=0)
            full = full[:len(full) - hold]
        delta = full[len(s.text):]
        s.text = full
        return delta

    def _finish(self, s: _Seq, reason: str) -> None:
        s.finish_reason = reason
        self.active.pop(s.req.request_id, None)
        self.cache.free(s.slot)
        self.free_slots.append(s.slot)
        self.free_slots.sort()
        if s.req.draft is not None:
            self.drafters[s.req.draft].release(s.seq_id)
        self.stats.add(s.stats, times=False)  # engine times are wall time, counted per step
        self.finished[s.req.request_id] = s

    # ---- convenience -------------------------------------------------------------------------
    def run(self, requests: list[Request]) -> dict[str, _Seq]:
        """Run requests to completion; returns each request's final state by id."""
        for r in requests:
            self.add_request(r)
        while self.has_work():
            self.step()
        return {r.request_id: self.finished.pop(r.request_id) for r in requests}
