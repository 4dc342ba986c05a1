"""The drafter interface: what the engine asks of every way of proposing tokens.

A drafter keeps its own view of each sequence (tokens, and a KV cache if it has
one). Each step the engine tells it, per sequence, how many tokens of its
previous view are still valid (`keep`, the rollback target) and which committed
tokens follow them (`new_tokens`); the drafter rolls back, catches up and
proposes up to `gamma` tokens. Everything it needs crosses this boundary as
plain data, so a drafter can live in another process (a Ray draft replica) and
a lost one is rebuilt by sending keep=0 and all committed tokens.

Does not know: the target model, acceptance, or which tokens are final.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable

import torch

from ..schema import MAX_GAMMA

# Positions every KV cache keeps beyond its context limit: a batched pass pads each row to
# the batch's widest row (at most MAX_GAMMA + 1 tokens), and padding must never overflow.
KV_HEADROOM = MAX_GAMMA + 1


@dataclass
class DraftSeq:
    """One sequence's instructions for one propose call."""
    seq_id: int
    keep: int  # leading tokens of the drafter's previous view that are still valid
    new_tokens: list[int]  # committed tokens to append after them (>= 1 on every call)
    gamma: int  # propose at most this many tokens (>= 1)
    temperature: float = 0.0  # 0: greedy (argmax drafts, no probabilities needed)
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0  # seeds the drafter's own generator for this sequence on first contact
    # Coupled sampling (a seeded request): draft the token at view position i as
    # argmax(log q_i + gumbel_noise(seed, i)), the noise the target uses (see sampling.py).
    coupled: bool = False
    # The request's (presence, frequency, repetition) penalties (`actors.penalties`), and where its
    # output starts in the view (its prompt length): a model drafter penalises its chain logits as
    # the target will (better acceptance; losslessness never depends on it). None: none.
    penalties: tuple[float, float, float] | None = None
    output_start: int = 0
    # Who asked (`schema.Request.tenant`): a drafter that learns across requests (suffix) keeps
    # what one tenant generated from another's drafts when its scope says so.
    tenant: str = ""
    # Propose a token tree of at most `tree` nodes and depth `gamma` instead of a chain (0: a
    # chain). A drafter that cannot draft trees proposes a chain (Proposal.parents None).
    tree: int = 0
    # Stop proposing once the draft's probability for its next token (for a tree: a node's
    # cumulative path probability) falls below this (0: never).
    threshold: float = 0.0
    # A shadow call (the speculation policy has this drafter off): the proposal is only compared
    # with what the target commits, never verified, so a draft replica prepares no next block
    # for its verdicts (`cluster.draft_server.DraftServer`, overlap).
    shadow: bool = False
    # Target features for committed tokens, for feature-level drafters (EAGLE-style heads):
    # hidden[i] belongs to token view[hidden_start + i] and holds the layers the drafter names
    # in `feature_layers`, concatenated. Only filled for such drafters.
    hidden: torch.Tensor | None = None  # [n, len(feature_layers) * E]
    hidden_start: int = 0
    # Verifier-local: a copy of the request's grammar matcher (llguidance) at its committed state,
    # for a model drafter that masks its drafts to the grammar (`grammar.DraftMasks`; only where the
    # drafter sets `grammar_masking`). Never sent to a draft replica.
    grammar: object | None = None
    # Verifier-local: every committed token's hidden state so far (all but the last token), for
    # re-prefilling a feature-level drafter that lost its state. Never sent to a draft replica.
    hidden_history: torch.Tensor | None = None


@dataclass
class Proposal:
    tokens: torch.Tensor  # int64 [B, G], rows padded with 0 beyond num_draft[b]
    num_draft: list[int]  # [B], 0 <= num_draft[b] <= gamma_b
    # Draft distributions the tokens were sampled from, processed with the row's
    # temperature/top-k/top-p exactly as the target's will be; None for
    # deterministic drafters (q is one-hot at the drafted token). Rows that are greedy or
    # coupled need none (their verification is an exact match).
    probs: torch.Tensor | None = None  # float32 [B, G, V]
    # The draft's K likeliest tokens at each drafted position, when the drafter was asked
    # (Drafter.record_topk): a draft server uses them to guess the verifier's verdict.
    topk: torch.Tensor | None = None  # int64 [B, G, K]
    # Token trees: parents[b] lists, for each of row b's num_draft[b] proposed tokens (nodes in
    # feed order), the index of its parent among [root, node 1, node 2, ...] (0 = the root, the
    # last committed token). None, or a None entry: the row's tokens are a chain.
    parents: list[list[int] | None] | None = None

    def rows(self) -> list["RowDraft"]:
        """Each row's drafts on their own (one transfer of the tokens for all rows)."""
        tokens = self.tokens.tolist()
        return [RowDraft(tokens[i][:k], None if self.probs is None else self.probs[i, :k],
                         self.parents[i][:k] if self.parents is not None and self.parents[i] is not None and k
                         else None)
                for i, k in enumerate(self.num_draft)]

    @classmethod
    def stack(cls, rows: list["RowDraft"], width: int) -> "Proposal":
        """Rows (e.g. gathered from several proposals) as one proposal, padded to `width` drafts;
        probs wherever some row has them (zeros for a row without), no topk."""
        tokens = torch.zeros(len(rows), width, dtype=torch.long)
        vocab = next((r.probs.shape[-1] for r in rows if r.probs is not None), None)
        probs = None if vocab is None else torch.zeros(len(rows), width, vocab)
        for b, r in enumerate(rows):
            k = len(r.tokens)
            if k:
                tokens[b, :k] = torch.tensor(r.tokens, dtype=torch.long)
            if r.probs is not None:
                probs[b, :k] = r.probs
        parents = [r.parents for r in rows]
        return cls(tokens=tokens, num_draft=[len(r.tokens) for r in rows], probs=probs,
                   parents=parents if any(p is not None for p in parents) else None)


@dataclass
class RowDraft:
    """One row of a `Proposal`: its drafted tokens, their draft distributions [k, V] and, for a
    token tree, each node's parent (see `Proposal.parents`; None: a chain)."""
    tokens: list[int]
    probs: torch.Tensor | None = None
    parents: list[int] | None = None


class Drafter(ABC):
    """Proposes draft tokens for a batch of sequences.

    Optional capabilities, declared as class attributes:
      feature_layers the target features it reads for committed tokens (DraftSeq.hidden):
                    decoder layer outputs i >= 0 and the final hidden state -1, in this
                    order; empty for drafters that read tokens only (`wants_hidden` False)
      asynchronous  `propose_async` returns before the drafts exist (they are computed
                    elsewhere, e.g. on a draft replica), so the engine can overlap them with
                    a target pass; otherwise it proposes in the calling thread.
      free_drafting proposing costs next to nothing (n-gram lookup): the speculation policy
                    may shadow-draft with it on every step.
      tree_drafting it proposes token trees when DraftSeq.tree > 0 (Proposal.parents).
      grammar_masking it masks its chain drafts to a request's grammar (DraftSeq.grammar); an
                    instance may switch it off (a benchmark's "without draft masking").
      rebases_views it keeps KV behind each sequence's token view, which `set_view` can move to
                    another view (a prefix of it stays valid), and proposals carry the K
                    likeliest tokens per position when `record_topk` = K > 0: what a draft
                    server's overlap (drafting ahead for likely verdicts) needs.
    """

    name: str = "drafter"
    feature_layers: tuple[int, ...] = ()
    asynchronous: bool = False
    free_drafting: bool = False
    tree_drafting: bool = False
    grammar_masking: bool = False
    rebases_views: bool = False
    record_topk: int = 0  # > 0 (a drafter that rebases views): proposals carry Proposal.topk

    @property
    def wants_hidden(self) -> bool:
        """It reads the target's features of committed tokens (DraftSeq.hidden)."""
        return bool(self.feature_layers)

    @abstractmethod
    def propose(self, seqs: list[DraftSeq]) -> Proposal:
        """Roll each sequence back to `keep`, append `new_tokens`, propose up to `gamma` tokens."""

    def propose_async(self, seqs: list[DraftSeq]) -> Callable[[], Proposal]:
        """Start proposing; the returned function waits for and returns the proposal."""
        prop = self.propose(seqs)
        return lambda: prop

    @abstractmethod
    def release(self, seq_id: int) -> None:
        """Forget a finished or cancelled sequence and free its state (idempotent)."""

    def num_active(self) -> int:
        """Sequences currently holding state here (for tests and stats)."""
        return 0

    def warm(self) -> int:
        """Compile, before the first request, the kernels its model will run (see
        `llama.warm_linears`); returns the number of shapes warmed (0: nothing to warm)."""
        return 0

    def free_capacity(self) -> int | None:
        """How many more sequences it can take state for; None = no limit."""
        return None

    def set_view(self, seq_id: int, tokens: list[int], kv_valid: int) -> None:
        """Make `tokens` the sequence's view, its first `kv_valid` positions' KV still valid
        (drafters that rebase views only)."""
        raise NotImplementedError(f"{type(self).__name__} does not rebase views")

    def view_length(self, seq_id: int) -> int | None:
        """Tokens in this drafter's view of a sequence, or None if it holds no state for it
        (a new sequence, or one whose state lived on a lost replica)."""
        view = getattr(self, "views", {}).get(seq_id)
        return None if view is None else len(view)


def apply_view(view: list[int], keep: int, new_tokens: list[int]) -> list[int]:
    """The drafter-side rollback rule: keep a prefix, append the committed suffix."""
    if not 0 <= keep <= len(view):
        raise ValueError(f"keep={keep} outside the drafter's view of {len(view)} tokens "
                         "(a lost drafter must be re-sent keep=0 and every committed token)")
    del view[keep:]
    view.extend(new_tokens)
    return view
