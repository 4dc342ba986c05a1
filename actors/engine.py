"""The speculative-decoding engine: a continuous batch of sequences, one target pass per step.

Each `step()`:
  1. admits waiting requests into free KV slots, and prefills prompts in chunks under a
     per-step token budget (`prefill_chunk`), so running streams keep decoding while a
     long prompt is admitted; a prompt's last chunk commits its first token;
  2. asks each decoding sequence's drafter for up to γ tokens, telling it how far to roll
     back (`drafting.launch`);
  3. scores every row's [last committed token, drafts...] in ONE batched target pass;
  4. accepts the longest acceptable prefix per row plus one recovered/bonus token
     (`sampling.verify_greedy` / `verify_sampled`), rolls the target KV back to the
     accepted prefix (a length update, no re-prefill), and commits tokens, checking
     max_tokens, EOS and stop strings.
γ = 0 (or no drafter) is plain decoding through the same code: the baseline.
With pipelining on, `pipeline.MicroBatches` runs step 2-4 over two micro-batches instead.

Public API: `add_request(Request) -> key`, `step() -> {key: Delta}`, `abort(key)`,
`generate([Request]) -> [Completion]`. Sequences are keyed by an internal key, never by
the caller's request id, so two requests with the same id cannot meet.

Does not know: Ray, gRPC, or how requests arrive; the caller drives `step()`.
Shapes: B rows in a pass, G the widest draft, V vocabulary, E hidden size.
"""
from __future__ import annotations

import os
import time
from collections import deque

import torch

from .beam import BeamGroup, BeamSearch, advance
from .calibrate import PassCost, measure
from .drafters.base import KV_HEADROOM, Drafter
from .drafting import Flight, feature_columns, feature_union, launch
from .llama import LlamaRunner, TreeMask
from .metrics import BatcherStats
from .pipeline import MicroBatches
from .policy import DraftSelector, SpeculationPolicy
from .sampling import coupled_scores, gumbel_noise, new_generator, process_logits, sample, verify_greedy, verify_sampled
from .schema import AUTO, AUTO_DRAFT, Completion, Delta, Limits, Request, SpecStats, validate
from .sequence import Sequence
from .text import TextStream


class SpecEngine:
    """Continuous-batching speculative decoder over one target and named drafters."""

    def __init__(self, target: LlamaRunner, drafters: dict[str, Drafter] | None = None,
                 tokenizer=None, eos_token_ids: set[int] | None = None,
                 max_batch: int = 8, max_len: int = 2048, seq_id_base: int = 0, pipeline: bool = False,
                 prefill_chunk: int = 512, default_gamma: dict[str, int | str] | None = None,
                 pass_cost: PassCost | None = None):
        """max_len: context (prompt + output) per sequence.
        seq_id_base: first sequence key (keys must be distinct per engine on shared drafters).
        pipeline: overlap asynchronous drafters with target passes over two micro-batches.
        prefill_chunk: prompt tokens prefilled per step, over all admitted prompts.
        default_gamma: γ per drafter name for requests that leave it unset ("auto" unless given).
        pass_cost: the target's calibrated pass cost (calibrate.calibrated); measured here when
        absent and there are drafters (the speculation policy needs it)."""
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
        self.cache = target.new_cache(max_batch, max_len + KV_HEADROOM)
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
        self.entropy_log: list | None = None  # set to [] to record (entropy, accepted, context) per drafted position
        self.tv_log: list | None = None  # set to [] to record (request key, position, TV) per lossy-ruled position
        self._noise_gen = new_generator(target.device)  # coupled sampling, re-seeded per position
        self.info: dict = {"dtype": str(target.dtype).replace("torch.", "")}  # what it runs on, and why
        # Target features of committed tokens, per slot, for feature-level drafters (EAGLE
        # heads): every layer any of them reads (`features`), concatenated; they reach each
        # drafter, cut to its own layers, with the rollback information.
        self.features = feature_union(self.drafters.values())
        self.hidden_buf = (torch.zeros(max_batch, max_len + KV_HEADROOM, len(self.features) * target.hidden_size,
                                       dtype=target.dtype, device=target.device)
                           if self.features else None)  # [S, P, F * E]
        self.micro = MicroBatches(on=pipeline)
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
        trees, each feature drafter's columns of `hidden_buf`, and the draft "auto" selector."""
        self.tree_drafters = {n for n, d in self.drafters.items() if d.tree_drafting}
        width = self.target.hidden_size
        self.feature_cols = {n: feature_columns(self.features, d.feature_layers, width, self.device)
                             for n, d in self.drafters.items() if d.wants_hidden}
        self.selector = DraftSelector(sorted(self.drafters), self.policy)

    # ---- requests -----------------------------------------------------------------------------
    def add_request(self, req: Request) -> int:
        """Validate (ValueError names the field and the limit) and queue; returns the key."""
        req = validate(req, self.limits)
        key = self._next_key
        self._next_key += 1
        self.waiting.append((key, req))
        return key

    def abort(self, key: int) -> bool:
        """Stop a request now and free its KV on the target and its drafter."""
        for i, (k, _) in enumerate(self.waiting):
            if k == key:
                del self.waiting[i]
                return True
        seq = self.active.get(key)
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

    def num_waiting(self) -> int:
        return len(self.waiting)

    def kv_slots_in_use(self) -> int:
        return self.max_batch - len(self.free_slots)

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
        outputs: dict[int, Delta] = {}
        self._admit()
        self._prefill(outputs)
        seqs = sorted((m for s in self.active.values() if s.decoding for m in (s.beam.members if s.beam else [s])),
                      key=lambda s: s.slot)
        if seqs:
            if self.micro.wanted(self, seqs):
                self.micro.step(self, seqs, outputs)
            else:
                self._speculate(seqs, outputs)
        return outputs

    def _admit(self) -> None:
        """Admit waiting requests in order while there are KV slots: one per sequence, B for a
        beam request (the first that does not fit waits, and so does everything behind it)."""
        while self.waiting and len(self.free_slots) >= self.waiting[0][1].sampling.num_beams:
            key, req = self.waiting.popleft()
            p = req.sampling
            seed = p.seed if p.seed is not None else int.from_bytes(os.urandom(7), "little")
            text = TextStream(self.tokenizer, req.prompt_ids, p.stop) if self.tokenizer is not None else None
            draft = self.selector.initial(key) if req.draft == AUTO_DRAFT else req.draft
            self.active[key] = s = Sequence(key=key, req=req, slot=self.free_slots.pop(0), tokens=list(req.prompt_ids),
                                            num_prompt=len(req.prompt_ids), seed=seed,
                                            gen=new_generator(self.device).manual_seed(seed), text=text, draft=draft)
            if p.num_beams > 1:
                # The other members hold their slots from now on, and get the prompt's KV once it is
                # prefilled (`_beam_start`). Their keys (for the drafters) come from the same counter.
                others = [Sequence(key=self._next_key + i, req=req, slot=self.free_slots.pop(0), tokens=list(req.prompt_ids),
                                   num_prompt=len(req.prompt_ids), seed=seed, gen=s.gen, text=None, draft=draft)
                          for i in range(p.num_beams - 1)]
                self._next_key += p.num_beams - 1
                eos = set() if p.ignore_eos else self.eos
                s.beam = BeamGroup(BeamSearch(p.num_beams, eos, p.max_tokens, p.length_penalty, p.early_stopping),
                                   leader=s, members=[s] + others)
                for m in others:
                    m.beam = s.beam

    def _prefill(self, outputs: dict[int, Delta]) -> None:
        """Feed prompt chunks, oldest prompt first, up to `prefill_chunk` tokens in all; each
        prompt that completes commits its first token (sampled from its last position)."""
        budget, rows = self.prefill_chunk, []
        for s in sorted(self.active.values(), key=lambda s: s.key):
            if budget == 0:
                break
            if not s.decoding:
                n = min(s.num_prompt - s.prefilled, budget)
                rows.append((s, n))
                budget -= n
        if not rows:
            return
        t0 = time.perf_counter()
        rows.sort(key=lambda r: r[0].slot)
        W = max(n for _, n in rows)
        # One padded pass; a row whose padding would run past its cache goes alone.
        fits = [r for r in rows if r[0].prefilled + W <= self.cache.max_len]
        groups = ([fits] if fits else []) + [[r] for r in rows if r[0].prefilled + W > self.cache.max_len]
        done, last = [], []
        for grp in groups:
            nums = [n for _, n in grp]
            W = max(nums)
            feed = torch.tensor([s.tokens[s.prefilled:s.prefilled + n] + [0] * (W - n) for s, n in grp])  # [B, W]
            hidden, feats = self._forward([s.slot for s, _ in grp], feed.to(self.device), nums)  # [B, W, E]
            for b, (s, n) in enumerate(grp):
                if feats is not None:
                    self._keep_hidden(s, feats[b, :n])
                s.prefilled += n
                if s.decoding:
                    done.append(s)
                    last.append(hidden[b, n - 1])
        if done:
            logits = self.target.logits(torch.stack(last)).float()  # [B, V]
            gated = [b for b, s in enumerate(done) if s.req.speculation.entropy_gate is not None]
            if gated:  # the entropy gate's first value: the distribution of the first token
                for b, h in zip(gated, _entropy(logits[gated]).tolist()):
                    done[b].entropy = h
            # The KV holds the prompt; the first token is committed but not in it: the invariant holds.
            plain = [b for b, s in enumerate(done) if s.beam is None]
            if plain:
                for s, tok in zip([done[b] for b in plain], self._sample_one([done[b] for b in plain], logits[plain])):
                    self._commit(s, [tok], outputs)
            for b, s in enumerate(done):
                if s.beam is not None:
                    self._beam_start(s.beam, logits[b], outputs)
        dt = time.perf_counter() - t0
        self.stats.verify_s += dt
        self.batcher.prefill_s += dt
        self.batcher.prefill_passes += len(groups)
        self.batcher.prefill_tokens += sum(n for _, n in rows)

    def _sample_one(self, seqs: list[Sequence], logits: torch.Tensor) -> list[int]:
        """logits [B, V] -> one token per row (greedy argmax, or a draw from the processed target);
        the step's one transfer to the host."""
        toks = logits.argmax(-1)  # [B]
        coupled = [b for b, s in enumerate(seqs) if s.req.coupled]
        if coupled:
            toks[coupled] = self._coupled_scores(logits[coupled, None], [seqs[b] for b in coupled], 1)[:, 0].argmax(-1)
        rows = [b for b, s in enumerate(seqs) if not s.req.sampling.greedy and not s.req.coupled]
        if rows:
            p = self._process(logits[rows], [seqs[b] for b in rows])  # [Bs, V]
            toks[rows] = sample(p, [seqs[b].gen for b in rows])
        return self._to_host(toks)

    @staticmethod
    def _process(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        dev = logits.device
        return process_logits(
            logits,
            torch.tensor([s.req.sampling.temperature for s in seqs], device=dev),
            torch.tensor([s.req.sampling.top_k for s in seqs], dtype=torch.long, device=dev),
            torch.tensor([s.req.sampling.top_p for s in seqs], device=dev))

    def _speculate(self, seqs: list[Sequence], outputs: dict[int, Delta]) -> None:
        """The plain step: draft for every decoding sequence, then verify them all in one pass."""
        t0 = time.perf_counter()
        fl = self.launch_drafts(seqs, asynchronous=False)
        fl.resolve()
        t1 = time.perf_counter()
        self.observe_drafting(fl)
        drafts = self.set_aside_shadows(seqs, fl.drafts, fl.shadow)
        self.verify(seqs, drafts, fl.probs, fl.group_s, [t1 - t0] * len(seqs), outputs, fl.parents)
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
            if s.req.draft == AUTO_DRAFT and s.flight is None and s.beam is None:
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
        fl = launch(seqs, gammas, self.drafters, self.hidden_buf, asynchronous, trees, self.feature_cols, shadow)
        if asynchronous:
            for s in seqs:
                s.flight = fl
        return fl

    def observe_drafting(self, fl: Flight) -> None:
        """Tell the policy what each drafter's call cost (shadow drafts included: their cost is
        what the policy budgets): per drafted position of a chain, per row of a token tree (a
        call that drafted any tree counts as a tree call)."""
        if self.policy is not None:
            for name, rows, sec in fl.group_s:
                tree_rows = [b for b in rows if b in fl.parents]
                if tree_rows:
                    nodes = max(len(fl.drafts[b]) for b in tree_rows)
                    self.policy.observe_tree_time(name, nodes, len(tree_rows), sec)
                    continue
                self.policy.observe_draft_time(name, max((len(fl.drafts[b]) for b in rows), default=0), sec)
                if fl.shadow and all(fl.shadow[b] for b in rows):
                    self.policy.observe_shadow_time(name, sec)

    def set_aside_shadows(self, seqs: list[Sequence], drafts: list[list[int]], shadow: list[bool]) -> list[list[int]]:
        """Shadow drafts are not verified: each is kept on its sequence, to be compared with the
        tokens the target commits next (`_resolve_shadow`). Returns the drafts to verify."""
        out = []
        for s, d, sh in zip(seqs, drafts, shadow):
            if sh and d:
                s.shadow = (len(s.tokens), d)
            out.append([] if sh else d)
        return out

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
            s.draft, s.draft_keep, s.hid_sent, s.shadow = new, 0, 0, None

    def _room(self, s: Sequence) -> int:
        """Draft no further than the tokens the request may still emit."""
        return max(0, s.req.sampling.max_tokens - len(s.output) - 1)

    # ---- verification -------------------------------------------------------------------------
    def verify(self, seqs: list[Sequence], drafts: list[list[int]], draft_probs: dict[int, torch.Tensor],
               group_s: list[tuple[str, list[int], float]], draft_s: list[float],
               outputs: dict[int, Delta], parents: dict[int, list[int]] | None = None) -> None:
        """One batched target pass over every row's drafts, acceptance, rollback, commit.
        draft_probs: row -> [k, V] draft distribution (sampled rows of stochastic drafters);
        group_s: (drafter, rows, seconds) for the policy; draft_s: seconds per row;
        parents: row -> tree parents of its drafts (see Proposal.parents; absent: a chain)."""
        B = len(seqs)
        parents = parents or {}
        t1 = time.perf_counter()
        G = max(len(d) for d in drafts)
        # One host-to-device copy: [last committed token, drafts..., padding] and each row's draft count.
        host = torch.tensor([[s.tokens[-1], *d] + [0] * (G - len(d)) + [len(d)] for s, d in zip(seqs, drafts)])
        host = host.to(self.device, non_blocking=True)  # [B, G+2]
        feed, num_draft = host[:, :G + 1], host[:, G + 1]  # [B, G+1], [B]
        draft_t = feed[:, 1:]  # [B, G]
        tree = None
        if parents:  # some rows are token trees: one tree mask, chains as one-child-per-node trees
            tree = TreeMask.from_parents([parents.get(b, list(range(len(drafts[b])))) for b in range(B)], G + 1,
                                         self.device)
        starts = [self.cache.lengths[s.slot] for s in seqs]
        hidden, feats = self._forward([s.slot for s in seqs], feed, [len(d) + 1 for d in drafts],
                                      tree=tree)  # [B, G+1, E]
        logits = self.target.logits(hidden).float()  # [B, G+1, V]

        # Chains: accept the longest acceptable prefix (`sampling` rules).
        n_acc, out = verify_greedy(logits, draft_t, num_draft)  # [B], [B, G+1]
        lossy = [b for b, s in enumerate(seqs) if s.req.acceptance_rule[0] != "lossless" and b not in parents
                 and s.beam is None]
        coupled = [b for b, s in enumerate(seqs) if s.req.coupled and b not in lossy]
        if coupled:  # seeded: exact matching on log p + g (the tokens depend on seed and position only)
            depth = tree.depth[coupled] if tree is not None else None
            scores = self._coupled_scores(logits[coupled], [seqs[b] for b in coupled], G + 1, depth)  # [Bc, G+1, V]
            n_acc[coupled], out[coupled] = verify_greedy(scores, draft_t[coupled], num_draft[coupled])
        sampled = [b for b, s in enumerate(seqs) if not s.req.sampling.greedy and not s.req.coupled
                   and b not in parents and b not in lossy]
        if sampled:
            self._verify_sampled(seqs, sampled, logits, drafts, draft_t, num_draft, draft_probs, n_acc, out)
        if lossy:
            self._verify_lossy(seqs, lossy, logits, draft_t, num_draft, n_acc, out)
        ent_rows = [b for b, s in enumerate(seqs) if s.beam is None and (
            s.req.speculation.entropy_gate is not None or (self.entropy_log is not None and drafts[b]))]
        entropy = _entropy(logits[ent_rows]) if ent_rows else None  # [Be, G+1] nats
        # Trees: each node's choice (argmax, or the coupled sample at its depth) for the walk below.
        choice = logits.argmax(-1)  # [B, G+1]
        if tree is not None and coupled:
            choice[coupled] = scores.argmax(-1)
        t2 = time.perf_counter()

        # The pass's one device-to-host transfer: accepted counts, chain tokens, tree choices.
        res = self._to_host(torch.cat([n_acc[:, None], out] + ([choice] if tree is not None else []), 1))
        paths, commits = [], []
        for b, r in enumerate(res):
            if seqs[b].beam is not None:  # beam rows: `_beam_advance` below
                paths.append([])
                commits.append([])
            elif b not in parents:
                a = r[0]
                paths.append(list(range(1, a + 1)))
                commits.append(r[1:a + 2])
            elif seqs[b].req.sampling.greedy or seqs[b].req.coupled:
                path, bonus = _walk(drafts[b], parents[b], r[G + 2:])
                paths.append(path)
                commits.append([drafts[b][i - 1] for i in path] + [bonus])
            else:
                path, bonus = self._walk_sampled(seqs[b], logits[b], drafts[b], parents[b])
                paths.append(path)
                commits.append([drafts[b][i - 1] for i in path] + [bonus])

        if entropy is not None:  # opt-in (entropy gate, entropy log): a second, small transfer
            self._observe_entropy(seqs, ent_rows, entropy.tolist(), drafts, paths, parents)
        if self.policy is not None:
            self.policy.observe_pass(B, G + 1, t2 - t1)
            for name, rows, _ in group_s:
                for is_tree in (False, True):
                    sub = [b for b in rows if drafts[b] and (b in parents) == is_tree and seqs[b].beam is None]
                    if sub:
                        self.policy.observe_verified(name, [len(drafts[b]) for b in sub],
                                                     [len(paths[b]) for b in sub], tree=is_tree)
        groups: dict[int, BeamGroup] = {}
        for b, s in enumerate(seqs):
            if s.beam is not None:
                groups[id(s.beam)] = s.beam
                continue
            path = paths[b]
            a = len(path)
            # KV now holds [.., last, d_1..d_k] (in feed order); keep [.., last, the accepted path].
            self.cache.compact(s.slot, starts[b], [0] + path)
            self.cache.truncate(s.slot, starts[b] + 1 + a)
            if feats is not None:
                self._keep_hidden(s, feats[b, [0] + path])
            if drafts[b] and b not in parents:
                s.draft_keep += a  # drafter view: committed + k drafts, of which a survive
            depth = max(_depths(parents[b])) if b in parents else None
            s.stats.record(len(drafts[b]), a, depth)
            if drafts[b] and s.req.draft == AUTO_DRAFT:
                self.selector.observe(s.key, s.draft, a)
                s.draft_steps[s.draft] = s.draft_steps.get(s.draft, 0) + 1
            s.stats.draft_s += draft_s[b]
            s.stats.verify_s += t2 - t1
            self._commit(s, commits[b], outputs)
        if groups:
            row = {id(s): b for b, s in enumerate(seqs)}
            for g in groups.values():
                self._beam_advance(g, [row[id(m)] for m in g.members], logits, feats, starts, drafts, parents,
                                   outputs)
                g.leader.stats.draft_s += max(draft_s[row[id(m)]] for m in g.members)
                g.leader.stats.verify_s += t2 - t1
        self.stats.verify_s += t2 - t1
        self.batcher.target_passes += 1
        self.batcher.rows_verified += B
        t3 = time.perf_counter()
        self.batcher.verify_s += t3 - t1
        if self.policy is not None:  # what the policy's last choice realized: committed tokens per second
            self.policy.observe_step(sum(len(p) + 1 for p in paths), t3 - t1 + max(draft_s, default=0.0))

    def _verify_lossy(self, seqs, rows, logits, draft_t, num_draft, n_acc, out) -> None:
        """Lossy acceptance, only for sampled requests that ask for it (chains): "topk:K" accepts a
        draft token among the target's K likeliest; "typical:ε" accepts one whose target probability
        is at least min(ε, √ε·exp(-H)) (Medusa's typical acceptance, H the target's entropy there).
        The token after the accepted prefix is drawn from the target's distribution. The output
        distribution then deviates from the target's: `specd lab` measures by how much."""
        G = draft_t.shape[1]
        for b in rows:
            s = seqs[b]
            kind, val = s.req.acceptance_rule
            p = self._process(logits[b:b + 1], [s])[0]  # [G+1, V]
            k = int(num_draft[b])
            px = p[:G].gather(-1, draft_t[b, :, None])[:, 0]  # [G]
            if kind == "topk":
                ok = (p[:G] > px[:, None]).sum(-1) < val  # rank of the draft token < K
            else:
                ent = -(p[:G] * torch.log(p[:G].clamp_min(1e-30))).sum(-1)
                ok = px >= torch.minimum(torch.full_like(ent, val), val ** 0.5 * torch.exp(-ent))
            a = 0
            for j in range(k):  # (a host loop: lossy rows are an opt-in)
                if not bool(ok[j]):
                    break
                a += 1
            if self.tv_log is not None:  # the rule's deviation at each position it decided, exactly:
                # an accepted draft x is emitted with probability 1 where the target has p(x), so
                # TV(emitted, p) = 1 - p(x); the token after the accepted prefix is drawn from p: TV 0.
                for j in range(a + 1):
                    self.tv_log.append((s.key, len(s.tokens) + j, 1.0 - float(px[j]) if j < a else 0.0))
            n_acc[b] = a
            out[b] = -1
            out[b, :a] = draft_t[b, :a]
            out[b, a] = sample(p[a][None], [s.gen])[0]

    def _observe_entropy(self, seqs, rows, ent, drafts, paths, parents) -> None:
        """The target's entropy at the committed positions (the entropy gate's EMA), and, when the
        log is on, per drafted chain position: (entropy, accepted, context of the position)."""
        for i, b in enumerate(rows):
            s, a = seqs[b], len(paths[b])
            for j in [0] + paths[b]:  # the distributions that produced this step's committed tokens
                s.entropy = ent[i][j] if s.entropy is None else 0.7 * s.entropy + 0.3 * ent[i][j]
            if self.entropy_log is not None and b not in parents:
                prev = [s.tokens[-1]] + drafts[b]  # (not committed yet: the last token is the root)
                for j in range(len(drafts[b])):
                    self.entropy_log.append((ent[i][j], j < a, self._context(prev[j], drafts[b][j])))

    def _context(self, prev: int, tok: int) -> str:
        """Where a drafted token stands: after a sentence end, after other punctuation, inside a
        word (no leading space), or at a word start."""
        if self.tokenizer is None:
            return "word start"
        p, t = self.tokenizer.decode([prev]), self.tokenizer.decode([tok])
        if p.rstrip(" ").endswith((".", "!", "?", "\n")) or p.endswith("\n"):
            return "sentence start"
        if p.rstrip(" ").endswith((",", ";", ":", ")", "(", '"', "'")):
            return "after punctuation"
        return "inside word" if t[:1].isalnum() and p[-1:].isalnum() else "word start"

    def _walk_sampled(self, s: Sequence, logits: torch.Tensor, drafts: list[int],
                      parents: list[int]) -> tuple[list[int], int]:
        """Rejection sampling down a tree of deterministic drafts (unseeded rows): at a node, test
        its children in order, each accepted with probability p'(x), where p' is the target's
        distribution with the children already rejected removed and renormalised (SpecInfer's
        multi-draft rule with one-hot drafts); the first accepted child is the next node; when
        none is, a token is drawn from what is left of p'. Every committed token is then
        distributed as the target's p: this is sampling from p by first offering candidates."""
        kids = _children(parents)
        path, cur = [], 0
        while True:
            p = self._process(logits[cur][None], [s])[0]  # [V]
            for node in kids.get(cur, []):
                x = drafts[node - 1]
                if float(torch.rand((), generator=s.gen, device=p.device)) * float(p.sum()) < float(p[x]):
                    path.append(node)
                    cur = node
                    break
                p[x] = 0.0
            else:
                return path, int(sample(p[None], [s.gen])[0])

    @staticmethod
    def _to_host(t: torch.Tensor) -> list:
        """A pass's one device-to-host transfer (its results: tokens and accepted counts). Nothing
        else in a step reads a device tensor on the host."""
        return t.tolist()

    def _coupled_scores(self, logits: torch.Tensor, seqs: list[Sequence], width: int,
                        depth: torch.Tensor | None = None) -> torch.Tensor:
        """logits [Bc, W, V] -> log p + g, the noise g at each row's next positions: feed index i
        of a chain is position len(tokens) + i; a tree node's is len(tokens) + its depth."""
        p = self._process(logits, seqs)  # [Bc, W, V]
        noise = torch.stack([gumbel_noise(s.seed, range(len(s.tokens), len(s.tokens) + width), p.shape[-1],
                                          p.device, self._noise_gen) for s in seqs])  # [Bc, W, V]
        if depth is not None:  # [Bc, W]
            noise = noise.gather(1, depth[:, :, None].expand(-1, -1, noise.shape[-1]))
        return coupled_scores(p, noise)

    def _verify_sampled(self, seqs, rows, logits, drafts, draft_t, num_draft, draft_probs, n_acc, out) -> None:
        """Rejection sampling for the sampled rows, written into n_acc [B] and out [B, G+1]."""
        G, V = draft_t.shape[1], logits.shape[-1]
        sub = [seqs[b] for b in rows]
        p_target = self._process(logits[rows], sub)  # [Bs, G+1, V]
        q = None
        if any(b in draft_probs for b in rows):
            q = torch.zeros(len(rows), G, V, device=logits.device)  # [Bs, G, V]
            for i, b in enumerate(rows):
                k = len(drafts[b])
                if b in draft_probs:
                    q[i, :k] = draft_probs[b].to(q.device)
                elif k:  # a deterministic drafter in a mixed batch: one-hot q
                    q[i, :k].scatter_(-1, draft_t[b, :k, None], 1.0)
        # Verify each row at its own draft length, so its random draws (k uniforms + one
        # sample per step) do not depend on the rest of the batch: a seed reproduces the output.
        by_len: dict[int, list[int]] = {}
        for i, b in enumerate(rows):
            by_len.setdefault(len(drafts[b]), []).append(i)
        for g, idx in by_len.items():
            rb = [rows[i] for i in idx]
            s_acc, s_out = verify_sampled(p_target[idx, :g + 1], None if q is None else q[idx, :g],
                                          draft_t[rb, :g], num_draft[rb], [sub[i].gen for i in idx])
            n_acc[rb] = s_acc
            out[rb] = -1
            out[rb, :g + 1] = s_out

    def _forward(self, slots: list[int], feed: torch.Tensor, nums: list[int], tree=None):
        """The target pass: (final hidden states [B, T, E], the drafters' features [B, T, F * E]
        or None when no drafter reads any)."""
        if not self.features:
            return self.target.forward(self.cache, slots, feed, nums, tree=tree), None
        return self.target.forward(self.cache, slots, feed, nums, tree=tree, features=self.features)

    def _keep_hidden(self, s: Sequence, h: torch.Tensor) -> None:
        """Append the target's features [n, F * E] of newly committed tokens (all but the last one)."""
        self.hidden_buf[s.slot, s.hid_len:s.hid_len + len(h)] = h
        s.hid_len += len(h)

    # ---- beam search ---------------------------------------------------------------------------
    def _beam_start(self, g: BeamGroup, logits: torch.Tensor, outputs: dict[int, Delta]) -> None:
        """The prompt is prefilled in the leader's slot: take the first beam step from its last
        logits [V], and give every member the prompt's KV (copy-on-fork)."""
        lead = g.leader
        lp = torch.log_softmax(logits.float(), -1)
        adv = advance(g.search, lambda i, node: lp, [{} for _ in g.members])
        n = self.cache.lengths[lead.slot]  # the prompt
        for m, a in zip(g.members, adv):
            if m is not lead:
                self.cache.fork(lead.slot, m.slot, n, [])
                if self.hidden_buf is not None:
                    self.hidden_buf[m.slot, :n] = self.hidden_buf[lead.slot, :n]
                m.prefilled, m.hid_len = m.num_prompt, lead.hid_len
            m.tokens = list(m.req.prompt_ids) + a.tokens
        lead.stats.record(0, 0)
        if g.search.done:
            self._beam_finish(g, outputs)

    def _beam_advance(self, g: BeamGroup, rows: list[int], logits: torch.Tensor, feats: torch.Tensor | None,
                      starts: list[int], drafts: list[list[int]], parents: dict[int, list[int]],
                      outputs: dict[int, Delta]) -> None:
        """After a pass: take every beam step the drafts allow (`beam.advance`), then rebuild each
        member's KV, hidden states, tokens and drafter rollback point for the beam it now carries.
        rows[i]: member i's row in the pass."""
        lp = torch.log_softmax(logits[rows], -1)  # [B, G+1, V]
        kids = []
        for b in rows:
            ch: dict[int, dict[int, int]] = {}
            for i, (par, tok) in enumerate(zip(parents.get(b, range(len(drafts[b]))), drafts[b]), start=1):
                ch.setdefault(par, {}).setdefault(tok, i)
            kids.append(ch)
        adv = advance(g.search, lambda i, node: lp[i, node], kids)
        # A new beam continues in its origin's slot if it is the origin's first child; the others
        # take the slots of beams that died.
        owner: list[int | None] = [None] * len(adv)
        taken: set[int] = set()
        for j, a in enumerate(adv):
            if a.origin not in taken:
                owner[j] = a.origin
                taken.add(a.origin)
        spare = [i for i in range(len(adv)) if i not in taken]
        owner = [o if o is not None else spare.pop() for o in owner]
        mem, old = g.members, [list(m.tokens) for m in g.members]
        for j, a in enumerate(adv):  # forks first: they read the origins' KV before it is compacted
            if owner[j] != a.origin:
                src, dst = mem[a.origin], mem[owner[j]]
                n = starts[rows[a.origin]]
                self.cache.fork(src.slot, dst.slot, n, [0] + a.nodes)
                if self.hidden_buf is not None:
                    self.hidden_buf[dst.slot, :n] = self.hidden_buf[src.slot, :n]
                dst.hid_len = n
        for j, a in enumerate(adv):
            if owner[j] == a.origin:
                m, n = mem[a.origin], starts[rows[a.origin]]
                self.cache.compact(m.slot, n, [0] + a.nodes)
                self.cache.truncate(m.slot, n + 1 + len(a.nodes))
        for j, a in enumerate(adv):
            m, b = mem[owner[j]], rows[owner[j]]
            if feats is not None:
                self._keep_hidden(m, feats[rows[a.origin], [0] + a.nodes])
            new = old[a.origin] + a.tokens
            chain = drafts[b] if b not in parents else []  # the drafter's view of m: old + its chain
            m.draft_keep = min(m.draft_keep + len(chain), common_prefix(old[owner[j]] + chain, new))
            m.hid_sent = min(m.hid_sent, common_prefix(old[owner[j]], new))
            m.tokens = new
        g.members = [mem[o] for o in owner]
        steps = len(adv[0].tokens)
        depth = max((max(_depths(parents[b])) if b in parents else len(drafts[b]) for b in rows), default=0)
        # one beam's drafts (the widest): acceptance reads as "beam steps taken from drafts per draft"
        g.leader.stats.record(max(len(drafts[b]) for b in rows), steps - 1, depth)
        if g.search.done:
            self._beam_finish(g, outputs)

    def _beam_finish(self, g: BeamGroup, outputs: dict[int, Delta]) -> None:
        """The search is over: the request's one delta is the best finished hypothesis."""
        lead, best = g.leader, g.search.result()
        lead.tokens = list(lead.req.prompt_ids) + best.tokens  # (`output` is what the request returns)
        reason = "stop" if best.tokens and best.tokens[-1] in g.search.eos else "length"
        text = ""
        if lead.text is not None:
            lead.text.push(best.tokens)
            text = lead.text.take(final=True)
        outputs[lead.key] = Delta(lead.req.request_id, list(best.tokens), text, finish_reason=reason,
                                  prompt_tokens=lead.num_prompt, completion_tokens=len(best.tokens),
                                  stats=lead.stats)
        self._finish(lead, reason)

    # ---- committing ---------------------------------------------------------------------------
    def _commit(self, s: Sequence, new: list[int], outputs: dict[int, Delta]) -> None:
        p = s.req.sampling
        emitted: list[int] = []
        reason = None
        stops = s.text is not None and bool(p.stop)
        for tok in new:
            s.tokens.append(tok)
            emitted.append(tok)
            if not p.ignore_eos and tok in self.eos:
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
        d = outputs.get(s.key)
        if d is None:
            outputs[s.key] = d = Delta(s.req.request_id, [], "")
        d.token_ids += emitted
        d.text += text
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
        for m in s.beam.members if s.beam is not None else [s]:  # a beam request frees every member
            self.cache.free(m.slot)
            self.free_slots.append(m.slot)
            if m.draft is not None:
                self.drafters[m.draft].release(m.key)
        self.free_slots.sort()
        if s.req.draft == AUTO_DRAFT:
            self.selector.release(s.key)
        self.stats.add(s.stats, times=False)  # engine times are wall time, counted per step


def _children(parents: list[int]) -> dict[int, list[int]]:
    """Feed index -> its children's feed indices, in proposal order (node i has feed index i)."""
    kids: dict[int, list[int]] = {}
    for i, p in enumerate(parents, start=1):
        kids.setdefault(p, []).append(i)
    return kids


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _depths(parents: list[int]) -> list[int]:
    depth = [0]
    for p in parents:
        depth.append(depth[p] + 1)
    return depth[1:]


def _walk(drafts: list[int], parents: list[int], choice: list[int]) -> tuple[list[int], int]:
    """Greedy (or coupled) acceptance down a token tree: from the root, follow the child whose
    token is the target's choice at the current node; stop where no child matches. Returns the
    accepted path (feed indices) and the target's choice there (the bonus or correction)."""
    kids = _children(parents)
    path, cur = [], 0
    while True:
        nxt = next((i for i in kids.get(cur, []) if drafts[i - 1] == choice[cur]), None)
        if nxt is None:
            return path, choice[cur]
        path.append(nxt)
        cur = nxt


def _entropy(logits: torch.Tensor) -> torch.Tensor:
    """[..., V] logits -> [...] entropy (nats) of the target's distribution (temperature 1)."""
    logp = torch.log_softmax(logits.float(), -1)
    return -(logp.exp() * logp).sum(-1)
