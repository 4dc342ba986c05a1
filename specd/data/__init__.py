"""The committed prompt sets.

  prompts.jsonl          the benchmark prompts (20 chat, 18 code); held out of every draft's training
  distill_prompts.jsonl  the distillation corpus (chat, code, math; `make_distill_corpus.py` rebuilds it)
  repetitive.jsonl       16 prompts whose answers repeat their input (code edits, quoting, reformatting):
                         where prompt lookup pays, so the speculation policy must turn it on
"""
from __future__ import annotations

import json
from pathlib import Path

HERE = Path(__file__).resolve().parent
PROMPTS = HERE / "prompts.jsonl"
DISTILL_CORPUS = HERE / "distill_prompts.jsonl"
REPETITIVE = HERE / "repetitive.jsonl"


def load_prompts(path: str | Path | None = None) -> list[dict]:
    """JSONL: one object per line with "prompt": str or "messages": [{"role", "content"}]."""
    path = Path(path or PROMPTS)
    out = []
    for i, line in enumerate(path.read_text().splitlines()):
        if not line.strip():
            continue
        obj = json.loads(line)
        if ("prompt" in obj) == ("messages" in obj):
            raise ValueError(f"{path}:{i + 1}: each line needs exactly one of 'prompt' or 'messages'")
        out.append(obj)
    if not out:
        raise ValueError(f"{path}: no prompts")
    return out


def mixed(prompts: list[dict], limit: int | None) -> list[dict]:
    """The first `limit` prompts taken in turn from each "kind" (chat, code, ...), so that a short
    run still mixes them; all prompts, in file order, without a limit."""
    if limit is None or limit >= len(prompts):
        return prompts
    kinds: dict[str, list[dict]] = {}
    for p in prompts:
        kinds.setdefault(p.get("kind", ""), []).append(p)
    out: list[dict] = []
    for i in range(max(map(len, kinds.values()))):
        out += [ps[i] for ps in kinds.values() if i < len(ps)]
    return out[:limit]
