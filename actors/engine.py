"""The speculative-decoding engine: a continuous batch of sequences, one target pass per step.

Each `step()`:
  1. admits waiting requests while a KV slot and the pool's blocks allow (`kv.KVCache`; a cached
     prefix's blocks may already hold a prompt's first tokens: `prefix_cache`); makes room for
     the step's passes (evicting cached prefixes, then preempting the youngest request, whose
     KV is recomputed when it is readmitted: nothing committed is lost); and prefills prompts
     in chunks under a per-step token budget (`prefill_chunk`), so running streams keep
     decoding while a long prompt is admitted; a prompt's last chunk commits its first token;
  2. drafts: `launch_drafts` asks each decoding sequence's drafter for up to γ tokens
     (`drafting.launch`), and `drafting.gather` turns the answers into a `VerifyBatch`;
  3. verifies: `verify(batch)` scores every row's [last committed token, drafts...] in ONE
     batched target pass, `acceptance.accept` rules each row (a `Verdict`: accepted path and
     tokens to commit), and the engine applies the verdicts: the target KV rolls back to the
     accepted path (a length update, no re-prefill), the drafter's view keeps its accepted
     drafts, and the tokens are committed, checking max_tokens, EOS and stop strings.
γ = 0 (or no drafter) is plain decoding through the same code: the baseline.
With pipelining on, `pipeline.MicroBatches` runs steps 2-3 over two micro-batches instead.

Public API: `add_request(Request) -> key`, `step() -> {key: Delta}`, `abort(key)`,
`generate([Request]) -> [Completion]`. Sequences are keyed by an internal key, never by
the caller's request id, so two requests with the same id cannot meet. `observer`: an
optional `StepObserver` (`specd lab` installs one); with none the step does no analysis.

Does not know: Ray, gRPC, or how requests arrive; the caller drives `step()`.
Shapes: B rows in a pass, G the widest draft, V vocabulary, E hidden size, F feature layers.
"""
from __future__ import annotations

import os
import time
from collections import deque
from typing import Protocol

import torch

from .acceptance import Verdict, VerifyBatch, accept, depths, entropy, first_tokens, token_logprobs
from .beam import BeamGroup, BeamSearch
from .calibrate import PassCost, measure
from .drafters.base import KV_HEADROOM, Drafter
from .drafting import Features, Flight, feature_columns, feature_union, gather, launch
from .grammar import Grammars, forced_drafts
from .kv import blocks_for_memory
from .llama import LlamaRunner
from .metrics import BatcherStats
from .penalties import Penalties
from .pipeline import MicroBatches
from .policy import DraftSelector, SpeculationPolicy
from .prefix_cache import PrefixCache
from .sampling import new_generator
from .schema import AUTO, AUTO_DRAFT, KV_BLOCK, Completion, Delta, Limits, Request, SpecStats, validate
from .sequence import Sequence, mode_of
from .text import TextStream

PREFILL_FILL = 0.75  # a padded prefill pass holds at least this share of real tokens (else rows go in another)


class StepObserver(Protocol):
    """Sees every verify pass before its tokens are committed (each row's last token is still
    its root): what the analysis tools log (`specd lab`: entropy and deviation per position)."""

    def verified(self, batch: VerifyBatch, logits: torch.Tensor, verdicts: list[Verdict]) -> None: ...


class SpecEngine:
    """Continuous-batching speculative decoder over one target and named drafters."""

    def __init__(self, target: LlamaRunner, drafters: dict[str, Drafter] | None = None,
                 tokenizer=None, eos_token_ids: set[int] | None = None,
                 max_batch: int = 8, max_len: int = 2048, seq_id_base: int = 0, pipeline: bool = False,
                 prefill_chunk: int = 512, default_gamma: dict[str, int | str] | None = None,
                 pass_cost: PassCost | None = None, prefix_cache: bool = True, kv_block: int | None = KV_BLOCK,
                 kv_memory: int | None = None):
        """max_len: context (prompt + output) per sequence.
        seq_id_base: first sequence key (keys must be distinct per engine on shared drafters).
        pipeline: overlap asynchronous drafters with target passes over two micro-batches.
        prefill_chunk: prompt tokens prefilled per step, over all admitted prompts.
        default_gamma: γ per drafter name for requests that leave it unset ("auto" unless given).
        pass_cost: the target's calibrated pass cost (calibrate.calibrated); measured here when
        absent and there are drafters (the speculation policy needs it).
        prefix_cache: keep finished sequences' KV for later prompts that share a prefix (prefix_cache.py).
        kv_block: positions per KV block (None: one block of max_len per slot, the slotted cache).
        kv_memory: bytes of KV (`kv.KVCache`'s pool; None: enough for every slot at max_len)."""
        self.target = target
        self.drafters = dict(drafters or {})
        self.tokenizer = tokenizer
        self.eos = set(eos_token_ids or ())
        if max_len + KV_HEADROOM > target.max_position:
            raise ValueError(f"max_len {max_len} + {KV_HEADROOM} positions of headroom exceeds the model's "
                             f"max_position_embeddings {target.max_position}")
        if prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
        self.max_batch, self.max_len, self.prefill_chunk = max_batch, max_len, prefill_chunk
        gammas = {name: (default_gamma or {}).get(name, AUTO) for name in self.drafters}
        self.limits = Limits(context=max_len, max_tokens=max_len - 1, vocab_size=target.vocab_size, drafts=gammas,
                             max_beams=max_batch)
        self.device = target.device
        positions = max_len + KV_HEADROOM
        blocks = None
        if kv_memory is not None:
            if kv_block is None:
                raise ValueError("kv_memory sizes a pool of blocks: set kv_block too")
            blocks = blocks_for_memory(kv_memory, kv_block, target.bytes_per_position())
            if blocks * kv_block < positions:
                raise ValueError(f"kv_memory {kv_memory} bytes holds {blocks * kv_block} positions, fewer than one "
                                 f"sequence of max_len {max_len} (+{KV_HEADROOM}) needs")
        self.cache = target.new_cache(max_batch, positions, block_size=kv_block, num_blocks=blocks)
        self.preempted: dict[int, Sequence] = {}  # key -> a sequence waiting to get its KV back
        self.waiting: deque[tuple[int, Request]] = deque()
        self.active: dict[int, Sequence] = {}  # key -> sequence holding a KV slot
        self.free_slots = list(range(max_batch))
        self.stats = SpecStats()  # counts: finished requests; times: every step's wall time
        self.batcher = BatcherStats()
        self._next_key = seq_id_base
        if pass_cost is None and self.drafters:
            with torch.inference_mode():
                pass_cost = measure(target, max_batch, reps=1)
        self.pass_cost = pass_cost
        self.policy = SpeculationPolicy(pass_cost) if pass_cost is not None else None
        self.observer: StepObserver | None = None
        self._noise_gen = new_generator(target.device)  # coupled sampling, re-seeded per position
        self.info: dict = {"dtype": str(target.dtype).replace("torch.", "")}  # what it runs on, and why
        # The target layers any drafter reads (feature-level drafters: EAGLE heads), kept per slot.
        self.features = feature_union(self.drafters.values())
        self.feature_store = (Features(self.features, max_batch, max_len + KV_HEADROOM, target.hidden_size,
                                       target.dtype, target.device) if self.features else None)
        self.prefix = PrefixCache(self.cache, self.feature_store, on=prefix_cache)
        self.micro = MicroBatches(on=pipeline)
        self._out: dict[int, Delta] = {}  # this step's deltas, by key
        self.grammars = Grammars(tokenizer, target.vocab_size)  # structured output
        self._index_drafters()

    # ---- configuration ------------------------------------------------------------------------
    @property
    def pipeline(self) -> bool:
        return self.micro.on

    def set_pipeline(self, on: bool) -> None:
        """Turn pipelining on or off between steps. Turning it off sends no new asynchronous
        draft calls; those in flight are verified by the next steps, then steps are plain."""
        self.micro.on = bool(on)

    def register_drafter(self, name: str, drafter: Drafter | None, default_gamma: int | str = AUTO) -> None:
        """Add a drafter under `name` (or remove it, with None) between steps; requests may then
        name it. (A drafter that reads hidden states needs an engine built with one.)"""
        if drafter is None:
            self.drafters.pop(name, None)
        else:
            if not set(drafter.feature_layers) <= set(self.features):
                raise ValueError(f"drafter {name!r} reads target features {drafter.feature_layers}, this engine "
                                 f"keeps {self.features}: build the engine with it")
            self.drafters[name] = drafter
        gammas = {n: self.limits.drafts.get(n, default_gamma) for n in self.drafters}
        self.limits = Limits(context=self.limits.context, max_tokens=self.limits.max_tokens,
                             vocab_size=self.limits.vocab_size, drafts=gammas, max_beams=self.max_batch)
        self._index_drafters()

    def _index_drafters(self) -> None:
        """What the steps read about the drafters, derived once when they change: which draft
        trees, each feature drafter's columns of the features, and the draft "auto" selector."""
        self.tree_drafters = {n for n, d in self.drafters.items() if d.tree_drafting}
        self.feature_cols = {n: feature_columns(self.features, d.feature_layers, self.target.hidden_size, self.device)
                             for n, d in self.drafters.items() if d.wants_hidden}
        self.selector = DraftSelector(sorted(self.drafters), self.policy)

    # ---- requests -----------------------------------------------------------------------------
    def add_request(self, req: Request) -> int:
        """Validate (ValueError names the field and the limit) and queue; returns the key."""
        req = validate(req, self.limits)
        if req.sampling.grammar is not None:
            self.grammars.check(*req.sampling.grammar)
        key, self._next_key = self._next_key, self._next_key + 1
        self.waiting.append((key, req))
        return key

    def abort(self, key: int) -> bool:
        """Stop a request now and free its KV on the target and its drafter."""
        for i, (k, _) in enumerate(self.waiting):
            if k == key:
                del self.waiting[i]
                return True
        s = self.preempted.pop(key, None)
        if s is not None:  # it holds no KV, and its drafter let it go when it was preempted
            if s.req.draft == AUTO_DRAFT:
                self.selector.release(key)
            return True
        seq = self.active.get(key)
        if seq is None:
            return False
        self.micro.drop(seq)
        self._finish(seq, "abort")
        return True

    def has_work(self) -> bool:
        return bool(self.waiting or self.active or self.preempted)

    def num_waiting(self) -> int:
        return len(self.waiting) + len(self.preempted)

    def kv_slots_in_use(self) -> int:
        """Slots of running sequences (not those holding cached prefixes: admission takes them)."""
        return self.max_batch - len(self.free_slots) - self.prefix.slots

    def kv_usage(self) -> dict:
        """The KV pool: blocks in all, free (cached prefixes' blocks count as used), their size in positions and bytes."""
        c = self.cache
        return {"kv_blocks_total": c.num_blocks, "kv_blocks_free": c.free_blocks, "kv_block_size": c.block_size,
                "kv_bytes_reserved": c.num_blocks * c.bytes_per_block, "kv_bytes_used": c.used_blocks * c.bytes_per_block}

    def warm(self) -> int:
        """Compile the target's and the local drafters' kernels for every shape they will meet
        (`llama.warm_linears`), so that serving neither waits for nor grows by them."""
        return self.target.warm() + sum(d.warm() for d in self.drafters.values())

    def is_active(self, s: Sequence) -> bool:
        return self.active.get(s.key) is s

    def generate(self, requests: list[Request]) -> list[Completion]:
        """Run requests to completion (with whatever else is queued); their completions in order."""
        keys = [self.add_request(r) for r in requests]
        deltas: dict[int, list[Delta]] = {k: [] for k in keys}
        while any(not d or not d[-1].finished for d in deltas.values()):
            for key, delta in self.step().items():
                if key in deltas:
                    deltas[key].append(delta)
        return [Completion.join(deltas[k]) for k in keys]

    # ---- the step -----------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> dict[int, Delta]:
        self._out = {}
        self._admit()
        self._make_room()
        self._prefill()
        seqs = sorted((m for s in self.active.values() if s.decoding for m in (s.beam.members if s.beam else [s])),
                      key=lambda s: s.slot)
        if seqs:
            if self.micro.wanted(self, seqs):
                self.micro.step(self, seqs)
            else:
                self._speculate(seqs)
        out, self._out = self._out, {}
        return out

    def _admit(self) -> None:
        """Admit preempted sequences, then waiting requests, in order while there are KV slots (one per
        sequence, B for a beam request) and blocks for their tokens (the first that does not fit waits,
        and so does everything behind it)."""
        while self.preempted:
            s = min(self.preempted.values(), key=lambda s: s.key)
            if not self._fits(len(s.tokens), 1):
                return
            del self.preempted[s.key]
            s.slot, s.prefilled = self.prefix.take(s.tokens, self.free_slots)
            s.refill = len(s.tokens) - 1 if s.output else None  # with nothing committed: its prompt, as before
            self.active[s.key] = s
        while self.waiting and self._fits(len(self.waiting[0][1].prompt_ids), self.waiting[0][1].sampling.num_beams):
            key, req = self.waiting.popleft()
            p = req.sampling
            seed = p.seed if p.seed is not None else int.from_bytes(os.urandom(7), "little")
            text = TextStream(self.tokenizer, req.prompt_ids, p.stop) if self.tokenizer is not None else None
            draft = self.selector.initial(key) if req.draft == AUTO_DRAFT else req.draft
            slot, cached = self.prefix.take(req.prompt_ids, self.free_slots)  # cached: prompt tokens in its KV
            self.active[key] = s = Sequence(key=key, req=req, slot=slot, tokens=list(req.prompt_ids), prefilled=cached,
                                            num_prompt=len(req.prompt_ids), seed=seed,
                                            gen=new_generator(self.device).manual_seed(seed), text=text,
                                            mode=mode_of(req), draft=draft,
                                            constraint=self.grammars.constraint(*p.grammar) if p.grammar else None,
                                            penalties=Penalties.of(p.penalties, req.prompt_ids,
                                                                   self.target.vocab_size, self.device))
            if p.num_beams > 1:
                # The other members hold their slots from now on, and get the prompt's KV once it is
                # prefilled (`_beam_start`). Their keys (for the drafters) come from the same counter.
                others = [Sequence(key=self._next_key + i, req=req, slot=self.prefix.take(None, self.free_slots)[0],
                                   tokens=list(req.prompt_ids), num_prompt=len(req.prompt_ids), seed=seed, gen=s.gen,
                                   text=None, mode=s.mode, draft=draft)
                          for i in range(p.num_beams - 1)]
                self._next_key += p.num_beams - 1
                eos = set() if p.ignore_eos else self.eos
                s.beam = BeamGroup(BeamSearch(p.num_beams, eos, p.max_tokens, p.length_penalty, p.early_stopping),
                                   leader=s, members=[s] + others)
                for m in others:
                    m.beam = s.beam

    def _fits(self, tokens: int, beams: int) -> bool:
        """Whether a sequence of `tokens` tokens (and `beams` - 1 more beams) may be admitted: free slots,
        and free blocks beyond what admitted prompts will still take (cached prefixes evicted, least
        recently used first, until they are)."""
        c = self.cache
        if len(self.free_slots) + self.prefix.slots < beams:
            return False
        want = c.blocks(tokens + KV_HEADROOM) + (beams - 1) * c.blocks(KV_HEADROOM)
        pending = sum(c.need(s.slot, s.fill + KV_HEADROOM) for s in self.active.values() if not s.decoding)
        while c.free_blocks - pending < want and self.prefix.slots:
            self.free_slots.append(self.prefix.evict())
        self.free_slots.sort()
        return c.free_blocks - pending >= want

    def _step_blocks(self) -> dict[int, int]:
        """Blocks this step's passes may take, per sequence key: each prompt's next chunk (as `_prefill`
        picks them, padding included) and each decoding row's verify pass, as wide as the widest row
        may be (one token where no row drafts, and no grammar forces tokens)."""
        c, need, budget, prompts, rows = self.cache, {}, self.prefill_chunk, [], []
        for s in sorted(self.active.values(), key=lambda s: s.key):
            if s.decoding:
                rows.append(s)
            elif budget:
                prompts.append((s, min(s.fill - s.prefilled, budget)))
                budget -= prompts[-1][1]
        W = max((n for _, n in prompts), default=0)
        for s, _ in prompts:
            need[s.key] = c.need(s.slot, min(s.prefilled + W, c.max_len))
        W = max((1 if s.req.gamma == 0 and s.constraint is None and s.beam is None else KV_HEADROOM for s in rows),
                default=1)
        for s in rows:
            need[s.key] = sum(c.need(m.slot, min(c.lengths[m.slot] + W, c.max_len))
                              for m in (s.beam.members if s.beam is not None else [s]))
        return need

    def _make_room(self) -> None:
        """Free blocks for this step's passes: evict cached prefixes, least recently used first, then
        preempt the youngest running request (not a beam search) until the step fits."""
        need = self._step_blocks()
        while self.cache.free_blocks < sum(need.values()):
            if self.prefix.slots:
                self.free_slots.append(self.prefix.evict())
                continue
            victims = [s for s in self.active.values() if s.beam is None]
            if not victims or len(self.active) == 1:
                return  # alone: its pass takes what is left (a pool smaller than one sequence is refused at start)
            youngest = max(victims, key=lambda s: s.key)
            need.pop(youngest.key, None)
            self._preempt(youngest)
        self.free_slots.sort()

    def _preempt(self, s: Sequence) -> None:
        """Take a running sequence's KV back; it waits (first in line) to be prefilled again, with every
        token it committed: its client sees the stream pause, not an error."""
        self.micro.drop(s)
        self.active.pop(s.key)
        self.prefix.release(s.slot, None)
        self.free_slots.append(s.slot)
        if s.draft is not None:
            self.drafters[s.draft].release(s.key)
        s.view.reset()
        s.shadow = None
        s.prefilled = 0
        self.preempted[s.key] = s
        self.batcher.preemptions += 1

    def _prefill(self) -> None:
        """Feed prompt chunks, oldest prompt first, up to `prefill_chunk` tokens in all; each
        prompt that completes commits its first token (sampled from its last position)."""
        budget, rows = self.prefill_chunk, []
        for s in sorted(self.active.values(), key=lambda s: s.key):
            if budget == 0:
                break
            if not s.decoding:
                n = min(s.fill - s.prefilled, budget)
                rows.append((s, n))
                budget -= n
        if not rows:
            return
        t0 = time.perf_counter()
        # Padded passes: rows of like chunk lengths together (padding computes as much as a real token),
        # longest first; a row whose padding would run past its cache starts a pass of its own.
        groups: list[list] = []
        for r in sorted(rows, key=lambda r: -r[1]):
            g = groups[-1] if groups else None
            if g is None or r[0].prefilled + g[0][1] > self.cache.max_len or \
                    sum(n for _, n in g) + r[1] < PREFILL_FILL * g[0][1] * (len(g) + 1):
                groups.append([r])
            else:
                g.append(r)
        done, last = [], []
        for grp in groups:
            nums = [n for _, n in grp]
            W = max(nums)
            feed = torch.tensor([s.tokens[s.prefilled:s.prefilled + n] + [0] * (W - n) for s, n in grp])  # [B, W]
            hidden, feats = self._forward([s.slot for s, _ in grp], feed.to(self.device), nums)  # [B, W, E]
            for b, (s, n) in enumerate(grp):
                if feats is not None:
                    self.feature_store.keep(s.slot, feats[b, :n])
                s.prefilled += n
                if s.decoding and s.refill is None:  # (a preempted sequence's last token is committed already)
                    done.append(s)
                    last.append(hidden[b, n - 1])
        if done:
            logits = self.target.logits(torch.stack(last)).float()  # [B, V]
            gated = [b for b, s in enumerate(done) if s.req.speculation.entropy_gate is not None]
            if gated:  # the entropy gate's first value: the distribution of the first token
                for b, h in zip(gated, entropy(logits[gated]).tolist()):
                    done[b].entropy = h
            # The KV holds the prompt; the first token is committed but not in it: the invariant holds.
            plain = [b for b, s in enumerate(done) if s.beam is None]
            if plain:
                seqs = [done[b] for b in plain]
                for b, s in zip(plain, seqs):
                    s.shape(logits[b, None])
                for b, s, tok in zip(plain, seqs, first_tokens(logits[plain], seqs, self._noise_gen)):
                    self._commit(s, [tok], self._logprobs(s, logits[b, None], [tok]))
            for b, s in enumerate(done):
                if s.beam is not None:
                    s.beam.start(self.cache, self.feature_store, logits[b])
                    if s.beam.search.done:
                        self._beam_finish(s.beam)
        dt = time.perf_counter() - t0
        self.stats.verify_s += dt
        self.batcher.prefill_s += dt
        self.batcher.prefill_passes += len(groups)
        self.batcher.prefill_tokens += sum(n for _, n in rows)

    def _speculate(self, seqs: list[Sequence]) -> None:
        """The plain step: draft for every decoding sequence, then verify them all in one pass."""
        t0 = time.perf_counter()
        fl = self.launch_drafts(seqs, asynchronous=False)
        fl.resolve()
        t1 = time.perf_counter()
        self.observe_drafting(fl)
        self.verify(gather(seqs, {s.key: fl for s in seqs}))
        self.stats.draft_s += t1 - t0
        self.batcher.draft_s += t1 - t0
        self.batcher.draft_wait_s += fl.blocked_s + fl.wait_s

    # ---- drafting -----------------------------------------------------------------------------
    def asynchronous_drafter(self, s: Sequence) -> bool:
        """Its drafts come from another process, so they can be in flight during a target pass."""
        return s.draft is not None and self.drafters[s.draft].asynchronous and s.beam is None

    def launch_drafts(self, seqs: list[Sequence], asynchronous: bool) -> Flight:
        """Choose each row's γ (fixed, or by the speculation policy; never past what the request
        may still emit), mark shadow drafts for rows whose auto drafter is off, and ask the
        drafters (`drafting.launch`)."""
        for s in seqs:
            if s.req.draft == AUTO_DRAFT and s.beam is None:
                self._reconsider_draft(s)
        # Beam rows under `gamma: auto` do not speculate: the policy models chains, and a beam pass
        # goes past its first step only while every beam stays on its draft (rare: measured a loss
        # here, see specd bench --local --beams). A fixed γ is the request's own choice.
        rows = [(s.draft, 0 if self._gated(s) or (s.beam is not None and s.req.auto_gamma)
                 else min(s.req.gamma, self._room(s)), s.req.auto_gamma) for s in seqs]
        gammas = self.policy.choose(rows, self.tree_drafters) if self.policy is not None else [cap for _, cap, _ in rows]
        shadow = [False] * len(seqs)
        if self.policy is not None:
            wants: dict[str, bool] = {}
            for b, (s, (d, cap, auto)) in enumerate(zip(seqs, rows)):
                if auto and gammas[b] == 0 and cap > 0 and s.shadow is None and s.beam is None:
                    if d not in wants:
                        wants[d] = self.policy.wants_shadow(d, free=self.drafters[d].free_drafting)
                    if wants[d]:
                        gammas[b], shadow[b] = cap, True
        trees = [0 if shadow[b] or not gammas[b] else s.req.speculation.tree if s.req.speculation.tree is not None
                 else self.policy.tree_for(s.draft) if s.req.auto_gamma and self.policy is not None else 0
                 for b, s in enumerate(seqs)]
        return launch(seqs, gammas, self.drafters, self.feature_store, asynchronous, trees, self.feature_cols, shadow)

    def observe_drafting(self, fl: Flight) -> None:
        """Tell the policy what each drafter's call cost (shadow drafts included: their cost is
        what the policy budgets): per drafted position of a chain, per row of a token tree (a
        call that drafted any tree counts as a tree call)."""
        if self.policy is not None:
            for name, rows, sec in fl.group_s:
                tree_rows = [b for b in rows if b in fl.parents]
                if tree_rows:
                    self.policy.observe_tree_time(name, max(len(fl.drafts[b]) for b in tree_rows), len(tree_rows), sec)
                    continue
                self.policy.observe_draft_time(name, max((len(fl.drafts[b]) for b in rows), default=0), sec)
                if fl.shadow and all(fl.shadow[b] for b in rows):
                    self.policy.observe_shadow_time(name, sec)

    def _gated(self, s: Sequence) -> bool:
        """The entropy gate: drafting only while the target's recent entropy is below the request's
        gate (so a gate of 0 never drafts); from the first decode step, the prefill's distribution
        giving the first value."""
        gate = s.req.speculation.entropy_gate
        return gate is not None and (s.entropy is None or s.entropy >= gate)

    def _reconsider_draft(self, s: Sequence) -> None:
        """draft "auto": switch drafters when the selector says so (the new one starts from the
        committed tokens, as a draft replica re-syncs)."""
        new = self.selector.reconsider(s.key, s.draft)
        if new != s.draft:
            self.drafters[s.draft].release(s.key)
            s.draft, s.shadow = new, None
            s.view.reset()

    def _room(self, s: Sequence) -> int:
        """Draft no further than the tokens the request may still emit."""
        return max(0, s.req.sampling.max_tokens - len(s.output) - 1)

    # ---- verification -------------------------------------------------------------------------
    def verify(self, batch: VerifyBatch) -> None:
        """One batched target pass over every row's drafts, the verdicts, and their application:
        KV rollback, features, drafter views, policy observations, commits."""
        rows, B = batch.rows, len(batch.rows)
        t1 = time.perf_counter()
        forced_drafts(rows, self.pass_cost)  # rows without drafts whose grammar forces the next tokens
        batch.to_device(self.device)
        starts = [self.cache.lengths[r.seq.slot] for r in rows]
        hidden, feats = self._forward([r.seq.slot for r in rows], batch.feed, [len(r.drafts) + 1 for r in rows],
                                      tree=batch.tree)  # [B, G+1, E], [B, G+1, F*E] | None
        logits = self.target.logits(hidden).float()  # [B, G+1, V]
        tg = time.perf_counter()
        for b, r in enumerate(rows):  # the target as each request scores it: penalties, grammar
            r.seq.shape(logits[b, :len(r.drafts) + 1], r.drafts, r.parents)
        self.batcher.grammar_s += time.perf_counter() - tg
        verdicts = accept(logits, batch, self._noise_gen)
        t2 = time.perf_counter()
        if self.observer is not None:
            self.observer.verified(batch, logits, verdicts)
        self._update_entropy(rows, logits, verdicts)
        if self.policy is not None:
            self._observe_verified(batch, verdicts, t2 - t1)
        groups: dict[int, list[int]] = {}
        for b, (r, v) in enumerate(zip(rows, verdicts)):
            s = r.seq
            if s.beam is not None:
                groups.setdefault(id(s.beam), []).append(b)
                continue
            if r.shadow is not None:
                s.shadow = (len(s.tokens), r.shadow)
            # KV now holds [.., last, d_1..d_k] (in feed order); keep [.., last, the accepted path].
            self.cache.compact(s.slot, starts[b], [0] + v.path)
            self.cache.truncate(s.slot, starts[b] + 1 + len(v.path))
            if feats is not None:
                self.feature_store.keep(s.slot, feats[b, [0] + v.path])
            if r.drafts and r.parents is None and not r.forced:
                s.view.accepted(len(v.path))  # its view: committed + k drafts, of which a survive
            drafted, accepted = (0, 0) if r.forced else (len(r.drafts), len(v.path))  # forced: the grammar's
            s.stats.record(drafted, accepted, max(depths(r.parents)) if r.parents is not None else None)
            if r.drafts and not r.forced and s.req.draft == AUTO_DRAFT:
                self.selector.observe(s.key, s.draft, len(v.path))
            s.stats.draft_s += r.draft_s
            s.stats.verify_s += t2 - t1
            self._commit(s, v.tokens, self._logprobs(s, logits[b, [0] + v.path], v.tokens))
        for idx in groups.values():
            g = rows[idx[0]].seq.beam
            order = {id(rows[b].seq): b for b in idx}
            at = [order[id(m)] for m in g.members]  # member i's row
            g.verified(self.cache, self.feature_store, [rows[b] for b in at], logits[at],
                      feats[at] if feats is not None else None, [starts[b] for b in at])
            g.leader.stats.verify_s += t2 - t1
            if g.search.done:
                self._beam_finish(g)
        self.stats.verify_s += t2 - t1
        self.batcher.target_passes += 1
        self.batcher.rows_verified += B
        t3 = time.perf_counter()
        self.batcher.verify_s += t3 - t1
        if self.policy is not None and not any(r.forced for r in rows):  # what its last choice realized
            self.policy.observe_step(sum(len(v.path) + 1 for v in verdicts),
                                     t3 - t1 + max((r.draft_s for r in rows), default=0.0))

    def _observe_verified(self, batch: VerifyBatch, verdicts: list[Verdict], seconds: float) -> None:
        """Tell the policy what the pass cost and what each drafter's rows had accepted."""
        rows = batch.rows
        self.policy.observe_pass(len(rows), batch.width + 1, seconds)
        for name, idx, _ in batch.groups:
            for is_tree in (False, True):  # (chains: the rows that proposed nothing count too)
                sub = [b for b in idx if (rows[b].drafts or not is_tree) and (rows[b].parents is not None) == is_tree
                       and rows[b].seq.beam is None and not rows[b].forced and rows[b].shadow is None]
                if sub:
                    self.policy.observe_verified(name, [len(rows[b].drafts) for b in sub],
                                                 [len(verdicts[b].path) for b in sub], tree=is_tree)

    def _update_entropy(self, rows, logits: torch.Tensor, verdicts: list[Verdict]) -> None:
        """The entropy gate's EMA of the target's entropy over each gated row's committed positions
        (the distributions that produced this step's tokens): a second, small transfer."""
        gated = [b for b, r in enumerate(rows) if r.seq.beam is None and r.seq.req.speculation.entropy_gate is not None]
        if not gated:
            return
        for b, ent in zip(gated, entropy(logits[gated]).tolist()):  # [Bg, G+1] nats
            s = rows[b].seq
            for j in [0] + verdicts[b].path:
                s.entropy = ent[j] if s.entropy is None else 0.7 * s.entropy + 0.3 * ent[j]

    def _forward(self, slots: list[int], feed: torch.Tensor, nums: list[int], tree=None):
        """The target pass: (final hidden states [B, T, E], the drafters' features [B, T, F * E]
        or None when no drafter reads any)."""
        if not self.features:
            return self.target.forward(self.cache, slots, feed, nums, tree=tree), None
        return self.target.forward(self.cache, slots, feed, nums, tree=tree, features=self.features)

    # ---- committing ---------------------------------------------------------------------------
    def _beam_finish(self, g: BeamGroup) -> None:
        """The search is over: the request's one delta is the best finished hypothesis."""
        lead = g.leader
        tokens, reason = g.result()
        lead.tokens = list(lead.req.prompt_ids) + tokens  # (`output` is what the request returns)
        text = ""
        if lead.text is not None:
            lead.text.push(tokens)
            text = lead.text.take(final=True)
        self._out[lead.key] = Delta(lead.req.request_id, tokens, text, finish_reason=reason,
                                    prompt_tokens=lead.num_prompt, completion_tokens=len(tokens), stats=lead.stats)
        self._finish(lead, reason)

    @staticmethod
    def _logprobs(s: Sequence, logits: torch.Tensor, tokens: list[int]):
        """The tokens' log-probabilities when the request asked (logits [len(tokens), V])."""
        return token_logprobs(logits, s, tokens) if s.req.sampling.logprobs is not None else None

    def _commit(self, s: Sequence, new: list[int], logprobs: list | None = None) -> None:
        p = s.req.sampling
        emitted: list[int] = []
        reason = None
        stops = s.text is not None and bool(p.stop)
        for tok in new:
            s.tokens.append(tok)
            emitted.append(tok)
            s.consume(tok)
            if not p.ignore_eos and tok in self.eos:
                reason = "stop"
            elif s.constraint is not None and s.constraint.done:  # the grammar is complete
                reason = "stop"
            elif stops and s.text.push([tok]):
                reason = "stop"
            elif len(s.output) >= p.max_tokens:
                reason = "length"
            if reason:
                break
        if s.text is not None and not stops:
            s.text.push(emitted)
        if s.shadow is not None:
            self._resolve_shadow(s)
        text = s.text.take(final=reason is not None) if s.text is not None else ""
        d = self._out.get(s.key)
        if d is None:
            self._out[s.key] = d = Delta(s.req.request_id, [], "")
        d.token_ids += emitted
        d.text += text
        if logprobs is not None:
            d.logprobs = (d.logprobs or []) + logprobs[:len(emitted)]
        if reason is not None:
            self._finish(s, reason)
            d.finish_reason = reason
            d.prompt_tokens, d.completion_tokens, d.stats = s.num_prompt, len(s.output), s.stats
            d.stop_string = (s.text.stop_string or "") if stops else ""

    def _resolve_shadow(self, s: Sequence) -> None:
        """Compare a shadow draft with what the target committed after it, once decidable."""
        at, drafts = s.shadow
        done = s.tokens[at:at + len(drafts)]
        matched = next((i for i, (d, t) in enumerate(zip(drafts, done)) if d != t), len(done))
        if matched < len(done) or len(done) == len(drafts) or s.finish_reason is not None:
            self.policy.observe_shadow(s.draft, len(drafts) if matched < len(done) else len(done), matched)
            s.shadow = None

    def _finish(self, s: Sequence, reason: str) -> None:
        s.finish_reason = reason
        self.active.pop(s.key, None)
        cacheable = s.beam is None and reason != "abort"  # a beam's or an aborted request's KV is freed
        for m in s.beam.members if s.beam is not None else [s]:
            if not self.prefix.release(m.slot, m.tokens[:self.cache.lengths[m.slot]] if cacheable else None):
                self.free_slots.append(m.slot)
            if m.draft is not None:
                self.drafters[m.draft].release(m.key)
        self.free_slots.sort()
        if s.req.draft == AUTO_DRAFT:
            self.selector.release(s.key)
        self.stats.add(s.stats, times=False)  # engine times are wall time, counted per step
