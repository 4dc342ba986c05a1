"""Structured output: a request's grammar as a token-level matcher (llguidance), and the masks it
puts on the target's distribution in a verify pass.

A request may carry `SamplingParams.grammar = (kind, spec)`: "json_schema" (a JSON schema as JSON
text), "json_object" (any JSON object), "regex", "choice" (a JSON list of strings) or "grammar"
(Lark or GBNF). Each is compiled by llguidance (`LLMatcher`: consume, rollback, validate, a bitmask
of the allowed next tokens), which vLLM and SGLang also use. Measured against xgrammar on this
project's CPUs (`specd bench --local --grammar-engines`), xgrammar masks ~4x faster, but masks are
2-4% of a step either way, and its wheel's requirements pull triton and a CUDA torch onto a CPU
machine where llguidance's need nothing else: llguidance it is.

Semantics under speculation (`mask`): at every position of a row (a chain, or each node of a
token tree), the target's logits are masked to what the grammar allows after the committed tokens
and the drafts on the path to that position; acceptance then runs unchanged on the masked logits
(greedy argmax, rejection sampling, coupled noise, tree walks). A draft token the grammar forbids
has masked probability 0, so it is rejected where it is proposed and nothing below it is looked
at: the positions beyond keep their logits, which no verdict reads. The matcher consumes a row's
drafts only to compute the masks (a tree: down each branch, rolled back to the fork before the
next) and is rolled back at once; it consumes the tokens the engine commits (`Constraint.commit`).
So the output is the target's, constrained: greedy output is identical with and without
speculation, sampled output keeps the masked target's law, whatever the draft proposed.

Does not know: the engine, drafters or models; it needs the tokenizer (built once per engine).
"""
from __future__ import annotations

import json
from dataclasses import dataclass

import torch

from .acceptance import feed_paths
from .schema import AUTO_MAX_GAMMA
from .schema import GRAMMAR_KINDS as KINDS
from .sequence import common_prefix


def grammar_text(kind: str, spec: str) -> str:
    """The llguidance grammar for (kind, spec); ValueError naming what is wrong."""
    import llguidance

    if kind not in KINDS:
        raise ValueError(f"sampling.grammar kind must be one of {list(KINDS)}, got {kind!r}")
    try:
        if kind == "json_object":
            return llguidance.grammar_from("json_schema", json.dumps({"type": "object"}))
        if kind == "choice":
            choices = json.loads(spec)
            if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
                raise ValueError("a choice grammar is a JSON list of non-empty strings")
            return llguidance.grammar_from("choice", spec)
        return llguidance.grammar_from({"grammar": "grammar", "regex": "regex", "json_schema": "json_schema"}[kind],
                                       spec)
    except ValueError as e:  # (json.JSONDecodeError included)
        raise ValueError(f"sampling.grammar ({kind}) does not compile: {e}") from None


def compact_json(schema: str) -> str:
    """A JSON schema whose output has no optional whitespace (`{"a":1,"b":2}`): llguidance's
    `x-guidance` option, which a gRPC client may also set in its schema. Fewer tokens, and more of
    them forced by the grammar (keys, separators), which `forced_drafts` drafts for free."""
    try:
        obj = json.loads(schema)
    except ValueError:
        return schema  # the grammar's compiler names what is wrong
    if not isinstance(obj, dict):
        return schema
    options = obj.get("x-guidance") if isinstance(obj.get("x-guidance"), dict) else {}
    return json.dumps({**obj, "x-guidance": {**options, "whitespace_flexible": False}})


class Grammars:
    """Compiles requests' grammars against one tokenizer (llguidance's view of it, built on the
    first grammar, about 0.3 s; a model without a tokenizer refuses grammars)."""

    def __init__(self, tokenizer, vocab_size: int):
        self.hf_tokenizer, self.vocab_size, self._tokenizer = tokenizer, vocab_size, None

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            import llguidance.hf

            if self.hf_tokenizer is None:
                raise ValueError("sampling.grammar needs a model with a tokenizer")
            self._tokenizer = llguidance.hf.from_tokenizer(self.hf_tokenizer, n_vocab=self.vocab_size)
        return self._tokenizer

    def check(self, kind: str, spec: str) -> str:
        """The compiled grammar's text; ValueError with the compiler's message when it is invalid."""
        import llguidance

        text = grammar_text(kind, spec)
        err = llguidance.LLMatcher.validate_grammar(text, self.tokenizer)
        if err:
            raise ValueError(f"sampling.grammar ({kind}) does not compile: {err.strip()}")
        return text

    def constraint(self, kind: str, spec: str) -> "Constraint":
        import llguidance
        import llguidance.torch

        m = llguidance.LLMatcher(self.tokenizer, self.check(kind, spec))
        return Constraint(m, llguidance.torch.allocate_token_bitmask(1, self.vocab_size))


@dataclass(eq=False)
class Constraint:
    """One request's matcher: its state is the committed tokens."""
    matcher: object  # llguidance.LLMatcher
    bitmask: torch.Tensor  # [rows, ceil(V / 32)] int32, grown as needed

    def mask(self, logits: torch.Tensor, drafts: list[int], parents: list[int] | None = None) -> None:
        """logits [k+1, V] of a row (root, then its k drafts in feed order; parents: a token tree's,
        None for a chain), masked in place: position j by what the grammar allows after the
        committed tokens and the drafts on the path to j. A position whose path holds a draft the
        grammar forbids is left as it is (no verdict reaches it: see the module docstring)."""
        import llguidance.torch as lt

        k = len(drafts)
        if self.bitmask.shape[0] < k + 1:
            self.bitmask = lt.allocate_token_bitmask(k + 1, self.bitmask.shape[1] * 32)
        m, held = self.matcher, []  # held: the drafts the matcher has consumed, a path from the root
        for j, path in enumerate(feed_paths(k, parents)):
            c = common_prefix(held, path)
            if len(held) > c:  # back to the fork (a tree), never past the committed tokens
                m.rollback(len(held) - c)
                del held[c:]
            for i in path[c:]:
                if m.try_consume_tokens([drafts[i]]) != 1:
                    break
                held.append(i)
            if len(held) == len(path):
                lt.fill_next_token_bitmask(m, self.bitmask, j)
            else:
                self.bitmask[j].fill_(-1)  # every token allowed: an unreachable position
        if held:
            m.rollback(len(held))
        lt.apply_token_bitmask_inplace(logits[:k + 1], self.bitmask[:k + 1].to(logits.device))

    def commit(self, token: int) -> None:
        """The engine committed `token` (drawn from masked logits, so the grammar allows it)."""
        if not self.matcher.consume_token(token):
            raise RuntimeError(f"the grammar refused committed token {token}: {self.matcher.get_error()}")

    @property
    def done(self) -> bool:
        """The grammar is complete and allows nothing more (only an end-of-sequence token)."""
        return self.matcher.is_stopped()


JUMP_FORWARD = True  # `forced_drafts` on (the structured bench switches it off to measure what it buys)


def forced_drafts(rows: list, cost, limit: int = AUTO_MAX_GAMMA) -> None:
    """Jump-forward drafts: a speculating row that drafted nothing this step (the policy chose γ 0,
    or its drafter found nothing) and whose grammar forces its next tokens (the bytes every allowed
    continuation starts with, as llguidance tokenizes them: `compute_ff_tokens`) gets those
    tokens as a chain draft (`Row.forced`). They are verified like any draft (their q is one-hot,
    as an n-gram's), so the output is unchanged; the target may still prefer another tokenization
    of the same bytes. They cost nothing to draft, but a longer row widens the whole pass: rows are
    widened to the width W that maximizes (rows + forced tokens within W) / cost(rows, W + 1), the
    target's calibrated pass cost (without one, never past the pass's current width)."""
    if not JUMP_FORWARD:
        return
    forced = {}
    for b, r in enumerate(rows):
        s = r.seq
        if r.drafts or s.constraint is None or s.beam is not None or s.req.draft is None:
            continue
        room = s.req.sampling.max_tokens - len(s.output) - 1
        ff = s.constraint.matcher.compute_ff_tokens()[:max(0, min(room, limit))]
        if ff:
            forced[b] = ff
    if not forced:
        return
    B, width = len(rows), max(len(r.drafts) for r in rows)
    if cost is not None:
        gain = lambda w: (B + sum(min(len(ff), w) for ff in forced.values())) / cost(B, w + 1)  # noqa: E731
        width = max({width, *(len(ff) for ff in forced.values() if len(ff) > width)}, key=gain)
    for b, ff in forced.items():
        if width:  # a chain with a one-hot q (an empty tree's parents and probabilities go)
            rows[b].drafts, rows[b].parents, rows[b].probs, rows[b].forced = ff[:width], None, None, True


class DraftMasks:
    """Draft masking: the grammar rows of a model drafter's chain batch (`DraftSeq.grammar`, a copy
    of the request's matcher at its committed state), each draft step's logits masked to what the
    grammar allows after the row's drafts so far. A model draft then proposes only tokens the
    target can accept, instead of wasting the rest of its chain past a forbidden one. The target is
    masked on its own (`Constraint.mask`), so losslessness never depends on this. A row whose draft
    vocabulary (a restricted head) holds no allowed token, or whose draft the grammar refuses, is
    left unmasked from there on."""

    def __init__(self, rows: list[int], matchers: list, vocab_size: int):
        import llguidance.torch as lt

        self.rows, self.matchers, self.vocab_size = rows, matchers, vocab_size
        self.live = [True] * len(rows)
        self.bitmask = lt.allocate_token_bitmask(len(rows), vocab_size)

    @classmethod
    def of(cls, seqs, vocab_size: int) -> "DraftMasks | None":
        rows = [b for b, s in enumerate(seqs) if s.grammar is not None]
        return cls(rows, [seqs[b].grammar for b in rows], vocab_size) if rows else None

    def apply(self, logits: torch.Tensor, vocab_map: torch.Tensor | None = None) -> None:
        """logits [B, R] of the next drafts (R: the head's rows, vocab_map their target ids), masked
        in place on the grammar rows."""
        import llguidance.torch as lt

        for i, m in enumerate(self.matchers):
            if self.live[i]:
                lt.fill_next_token_bitmask(m, self.bitmask, i)
            else:
                self.bitmask[i].fill_(-1)
        bits = (self.bitmask[:, :, None] >> torch.arange(32, dtype=torch.int32)) & 1  # [N, W, 32]
        allowed = bits.view(len(self.rows), -1)[:, :self.vocab_size].bool().to(logits.device)  # [N, V]
        if vocab_map is not None:
            allowed = allowed[:, vocab_map]
        ok = allowed.any(-1).tolist()
        for i, b in enumerate(self.rows):
            if ok[i]:
                logits[b].masked_fill_(~allowed[i], float("-inf"))
            else:
                self.live[i] = False

    def drafted(self, tokens: torch.Tensor) -> None:
        """tokens [B]: each row's draft (target ids), consumed by its matcher."""
        for i, b in enumerate(self.rows):
            if self.live[i] and self.matchers[i].try_consume_tokens([int(tokens[b])]) != 1:
                self.live[i] = False