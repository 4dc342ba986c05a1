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


def save_tiny_qwen3(path, seed: int = 0, tokenizer: bool = True, **config):
    """A tiny random Qwen3 causal LM saved as a Hugging Face directory at `path` (the shape a user's
    own model has on disk). tokenizer: with the embedded SmolLM2's tokenizer files (and its
    vocabulary size), so text and chat requests work; else vocabulary 512, token-id prompts only."""
    from pathlib import Path

    from transformers import Qwen3Config, Qwen3ForCausalLM

    from actors.models import ensure_embedded

    path = Path(path)
    tok = None
    if tokenizer:
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(ensure_embedded(verbose=False))
    cfg = dict(vocab_size=len(tok) if tok is not None else 512, hidden_size=64, intermediate_size=128,
               num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
               max_position_embeddings=1024, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
               pad_token_id=0)
    if tok is not None:
        cfg.update(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(Qwen3Config(**{**cfg, **config}))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.08)
    model.eval().save_pretrained(path)
    if tok is not None:
        tok.save_pretrained(path)
    return model
