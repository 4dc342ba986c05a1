"""`specd bench --local --grammar-engines`: llguidance (the engine's grammar backend) against xgrammar
on this CPU, on the structured bench's three JSON schemas and the embedded model's tokenizer.

Per schema and engine: compile time (cold), the time of one next-token mask (median and p90 over the
tokens of a valid answer, 3 passes), and one verify step as the engine runs it under speculation
(consume the step's token and up to 4 following drafts, a mask after each, roll back). xgrammar is an
optional extra (`pip install --no-deps xgrammar apache-tvm-ffi`: its wheel's own requirements pull
triton and a CUDA torch onto a CPU machine); without it the command stops with that hint. Writes
out/grammar_engines.json and prints a table.
"""
from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

from .structured import SCHEMAS

# A valid answer per schema (the masks are timed along its tokens).
ANSWERS = {"flat record": {"name": "Alice", "age": 30, "city": "Paris", "email": "alice@example.com"},
           "nested": {"title": "Dune", "author": {"first": "Frank", "last": "Herbert"}, "year": 1965,
                      "tags": ["science fiction", "desert", "politics"]},
           "enums": {"color": "blue", "size": "L", "material": "cotton", "in_stock": True}}
HINT = ("--grammar-engines needs xgrammar: pip install --no-deps xgrammar apache-tvm-ffi (its declared "
        "requirements pull triton and a CUDA torch onto a CPU machine)")


class _Llg:
    name = "llguidance"

    def __init__(self, tok, vocab: int):
        import llguidance
        import llguidance.hf
        import llguidance.torch as lt

        self.llg, self.lt = llguidance, lt
        self.tok = llguidance.hf.from_tokenizer(tok, n_vocab=vocab)
        self.bitmask = lt.allocate_token_bitmask(1, vocab)

    def compile(self, schema: str):
        return self.llg.grammar_from("json_schema", schema)

    def matcher(self, compiled):
        return self.llg.LLMatcher(self.tok, compiled)

    def mask(self, m) -> None:
        self.lt.fill_next_token_bitmask(m, self.bitmask, 0)

    def accept(self, m, t: int) -> bool:
        return m.consume_token(t)


class _Xgr:
    name = "xgrammar"

    def __init__(self, tok, vocab: int):
        try:
            import xgrammar
        except ImportError:
            raise SystemExit(HINT) from None
        self.xgr = xgrammar
        self.compiler = xgrammar.GrammarCompiler(xgrammar.TokenizerInfo.from_huggingface(tok, vocab_size=vocab),
                                                 cache_enabled=False)
        self.bitmask = xgrammar.allocate_token_bitmask(1, vocab)

    def compile(self, schema: str):
        return self.compiler.compile_json_schema(schema)

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled, max_rollback_tokens=16)

    def mask(self, m) -> None:
        m.fill_next_token_bitmask(self.bitmask)

    def accept(self, m, t: int) -> bool:
        return m.accept_token(t)


def compare(model: str = "smollm2", passes: int = 3, drafts: int = 4) -> dict:
    from actors.models import load_tokenizer, model_vocab_size

    tok = load_tokenizer(model)
    vocab = model_vocab_size(model)
    engines = [_Xgr(tok, vocab), _Llg(tok, vocab)]  # xgrammar first: stop at once without it
    out = {}
    for name, schema, _ in SCHEMAS:
        ids = tok.encode(json.dumps(ANSWERS[name], indent=2), add_special_tokens=False)
        res: dict = {"tokens": len(ids)}
        for e in engines:
            t0 = time.perf_counter()
            compiled = e.compile(json.dumps(schema))
            e.matcher(compiled)
            compile_s = time.perf_counter() - t0
            masks, steps, rejected = [], [], None
            for _ in range(passes):
                m = e.matcher(compiled)
                for i, t in enumerate(ids):
                    t0 = time.perf_counter()
                    e.mask(m)
                    masks.append(time.perf_counter() - t0)
                    t0 = time.perf_counter()
                    k = 0
                    for a in ids[i:i + 1 + drafts]:
                        if not e.accept(m, a):
                            break
                        k += 1
                        e.mask(m)
                    m.rollback(k)
                    steps.append(time.perf_counter() - t0)
                    if not e.accept(m, t):
                        rejected = i
                        break
            res[e.name] = {"compile_ms": compile_s * 1e3, "mask_us_p50": statistics.median(masks) * 1e6,
                           "mask_us_p90": sorted(masks)[int(0.9 * len(masks))] * 1e6,
                           "verify_step_us_p50": statistics.median(steps) * 1e6, "rejected_at": rejected}
        out[name] = res
    return out


def render(rep: dict, hw_line: str) -> str:
    lines = [f"grammar engines on {hw_line}: one mask, one verify step (the token + 4 drafts, masked, rolled back)",
             f"{'schema':<12} {'engine':<11} {'compile ms':>10} {'mask µs p50':>11} {'p90':>7} {'verify µs':>9}"]
    for name, res in rep.items():
        for eng in ("llguidance", "xgrammar"):
            r = res[eng]
            bad = "" if r["rejected_at"] is None else f"  (refused token {r['rejected_at']})"
            lines.append(f"{name:<12} {eng:<11} {r['compile_ms']:10.1f} {r['mask_us_p50']:11.0f} {r['mask_us_p90']:7.0f} "
                         f"{r['verify_step_us_p50']:9.0f}{bad}")
    return "\n".join(lines)


def main(args) -> int:
    from actors.hardware import hardware, hardware_line

    rep = compare(args.model)
    out = Path(args.json_path or "out/grammar_engines.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"hardware": hardware("cpu"), "schemas": rep}, indent=1))
    print(render(rep, hardware_line(hardware("cpu"))))
    print(f"wrote {out}")
    return 0
