"""Assemble an engine from specs: a target model spec, draft specs, dtype, sizes.

Draft specs (one name space for the CLI, the bench and, later, the cluster config):
  "none"           speculation off
  "ngram[:N]"      prompt lookup with n-grams up to N (default 3)
  "truncated:K"    the target's first K layers + its final norm and LM head (shared weights)
  PATH             a separate draft model: any local Hugging Face llama-family directory

Also owns prompt encoding (plain text, or chat messages through the chat template).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .drafters import Drafter, ModelDrafter, NgramDrafter
from .drafters.base import KV_HEADROOM
from .engine import SpecEngine
from .llama import LlamaRunner
from .models import LoadedModel, check_draft_compatible, load_model

ROLES = ("system", "user", "assistant", "tool")


def make_drafter(spec: str, target: LoadedModel, max_batch: int, max_len: int,
                 dtype: str | torch.dtype | None = None) -> Drafter | None:
    if spec in ("none", "", None):
        return None
    if spec == "ngram" or spec.startswith("ngram:"):
        n = int(spec.split(":", 1)[1]) if ":" in spec else 3
        return NgramDrafter(max_n=n)
    if spec.startswith("truncated:"):
        try:
            k = int(spec.split(":", 1)[1])
        except ValueError:
            raise ValueError(f"draft {spec!r}: truncated:K needs an integer K") from None
        d = ModelDrafter.truncated(target.model, k, max_batch=max_batch, max_len=max_len)
        return d
    draft = load_model(spec, dtype or next(target.model.parameters()).dtype)
    check_draft_compatible(target, draft)
    return ModelDrafter(LlamaRunner(draft.model), spec, max_batch=max_batch, max_len=max_len)


@dataclass
class Built:
    engine: SpecEngine
    target: LoadedModel
    drafters: dict[str, Drafter]


def build_engine(model: str = "smollm2", drafts: list[str] = (), dtype: str = "bf16",
                 max_batch: int = 8, max_len: int = 2048, device: str = "cpu",
                 adaptive_gamma: bool = False) -> Built:
    target = load_model(model, dtype, device)
    max_len = min(max_len, int(getattr(target.model.config, "max_position_embeddings", max_len)) - KV_HEADROOM)
    drafters = {}
    for spec in drafts:
        d = make_drafter(spec, target, max_batch, max_len)
        if d is not None:
            drafters[spec] = d
    engine = SpecEngine(LlamaRunner(target.model), drafters, tokenizer=target.tokenizer,
                        eos_token_ids=target.eos_token_ids, max_batch=max_batch, max_len=max_len,
                        adaptive_gamma=adaptive_gamma)
    return Built(engine, target, drafters)


def encode_prompt(tokenizer, prompt: str | None = None, messages: list[dict] | None = None) -> list[int]:
    """Token ids for a plain prompt, or for chat messages with the generation prompt appended."""
    if (prompt is None) == (messages is None):
        raise ValueError("give exactly one of prompt or messages")
    if tokenizer is None:
        raise ValueError("this model has no tokenizer: pass token ids")
    if messages is not None:
        if not messages:
            raise ValueError("messages must not be empty")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
                raise ValueError(f"messages[{i}].role must be one of {list(ROLES)} with string content, got {m!r}")
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return list(ids)
    if not prompt:
        raise ValueError("prompt must not be empty")
    return tokenizer.encode(prompt, add_special_tokens=False)
