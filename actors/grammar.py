"""Structured output: a request's grammar as a token-level matcher (llguidance), and the masks it
puts on the target's distribution in a verify pass.

A request may carry `SamplingParams.grammar = (kind, spec)`: "json_schema" (a JSON schema as JSON
text), "json_object" (any JSON object), "regex", "choice" (a JSON list of strings) or "grammar"
(Lark or GBNF). Each is compiled by llguidance (`LLMatcher`: consume, rollback, validate, a bitmask
of the allowed next tokens), which vLLM and SGLang also use; it is chosen over xgrammar here
because its wheel needs nothing else, where xgrammar's pulls triton onto a CPU machine.

Semantics under speculation (`mask`): at every position of a row's chain, the target's logits are
masked to what the grammar allows after the committed tokens and the drafts before that position;
acceptance then runs unchanged on the masked logits (greedy argmax, rejection sampling, coupled
noise). A draft token the grammar forbids has masked probability 0, so it is rejected there and
nothing after it is looked at: the positions beyond keep their logits, which no verdict reads. The
matcher consumes a row's drafts only to compute the masks and is rolled back at once; it consumes
the tokens the engine commits (`Constraint.commit`). So the output is the target's, constrained:
greedy output is identical with and without speculation, sampled output keeps the masked target's
law, whatever the draft proposed. (Grammar rows draft chains: a token tree is not masked per node.)

Does not know: the engine, drafters or models; it needs the tokenizer (built once per engine).
"""
from __future__ import annotations

import json
from dataclasses import dataclass

import torch

from .schema import GRAMMAR_KINDS as KINDS


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

    def mask(self, logits: torch.Tensor, drafts: list[int]) -> None:
        """logits [k+1, V] of a chain (root, then k drafts), masked in place: position j by what the
        grammar allows after the committed tokens and drafts[:j], up to the first draft it forbids
        (see the module docstring)."""
        import llguidance.torch as lt

        if self.bitmask.shape[0] < len(drafts) + 1:
            self.bitmask = lt.allocate_token_bitmask(len(drafts) + 1, self.bitmask.shape[1] * 32)
        m, n = self.matcher, 0
        for j in range(len(drafts) + 1):
            lt.fill_next_token_bitmask(m, self.bitmask, j)
            if j == len(drafts) or m.try_consume_tokens([drafts[j]]) != 1:
                break
            n += 1
        if n:
            m.rollback(n)
        lt.apply_token_bitmask_inplace(logits[:n + 1], self.bitmask[:n + 1].to(logits.device))

    def commit(self, token: int) -> None:
        """The engine committed `token` (drawn from masked logits, so the grammar allows it)."""
        if not self.matcher.consume_token(token):
            raise RuntimeError(f"the grammar refused committed token {token}: {self.matcher.get_error()}")

    @property
    def done(self) -> bool:
        """The grammar is complete and allows nothing more (only an end-of-sequence token)."""
        return self.matcher.is_stopped()
