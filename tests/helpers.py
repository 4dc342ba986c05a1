"""Helpers shared by the test modules (import as `helpers`; pytest puts tests/ on sys.path)."""
from __future__ import annotations

import torch

from actors.schema import Completion, Request, SamplingParams, SpeculationParams


def rand_tokens(n: int, seed: int, vocab: int = 512) -> list[int]:
    """n random token ids in [3, vocab) (0-2 are the tiny models' pad/bos/eos)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


def request(rid: str, prompt: list[int], draft: str | None = None, gamma: int = 0, **sampling) -> Request:
    """A request speculating with `draft` at `gamma` (None or gamma 0: speculation off)."""
    return Request(rid, list(prompt), SamplingParams(**sampling),
                   SpeculationParams(draft=draft if draft and gamma else "none", gamma=gamma if draft else 0))


def run(eng, reqs: list[Request]) -> dict[str, Completion]:
    """Run requests to completion in `eng`; their completions by request id."""
    return {r.request_id: c for r, c in zip(reqs, eng.generate(reqs))}


def chat_ids(tokenizer, content: str) -> list[int]:
    """The token ids of one user turn through the chat template, as Hugging Face renders it
    (the reference the router and the engine must agree with)."""
    ids = tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                        tokenize=True, return_dict=False)
    return list(ids)
