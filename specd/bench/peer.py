"""Peers for `specd bench --local --peer NAME`: another runtime on the same weights and prompts.

  llama-cpp   llama.cpp through `llama-cpp-python` (the optional extra `specd[llama-cpp]`, built on
              the user's machine for its CPU), on the very GGUF the embedded model was dequantised
              from; greedy, batch 1, as many threads as torch uses here. It is fed the engine's own
              prompt token ids (the same vocabulary), so both decode the same sequences.

A peer is one more configuration of the bench, interleaved with the others prompt by prompt; the
table then prints every configuration's tokens/s against the peer's at batch 1 ("× peer").
"""
from __future__ import annotations

PEERS = ("llama-cpp",)
INSTALL_HINT = ("--peer llama-cpp needs llama-cpp-python, built for this CPU: "
                "pip install 'specd[llama-cpp]' (or pip install llama-cpp-python; it compiles llama.cpp, "
                "a few minutes on 2 cores, and needs a C++ compiler and cmake)")


class LlamaCpp:
    """llama.cpp over a GGUF file: `generate(ids, max_tokens, eos)` -> greedy output token ids."""
    name = "llama.cpp"

    def __init__(self, gguf, n_ctx: int, threads: int):
        try:
            import llama_cpp
        except ImportError:
            raise SystemExit(INSTALL_HINT) from None
        self.version = getattr(llama_cpp, "__version__", "?")
        self.llm = llama_cpp.Llama(model_path=str(gguf), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                                   n_batch=512, verbose=False)

    def generate(self, ids: list[int], max_tokens: int, eos: list[int]) -> list[int]:
        out: list[int] = []
        for t in self.llm.generate(ids, temp=0.0, top_k=1, repeat_penalty=1.0, reset=True):
            out.append(int(t))
            if t in eos or len(out) >= max_tokens:
                break
        return out


def make_peer(name: str, model: str, n_ctx: int, threads: int):
    """The peer `name` for target `model` (a GGUF-born model: the peer loads the same file)."""
    from actors.models import gguf_source

    if name not in PEERS:
        raise ValueError(f"--peer must be one of {list(PEERS)}, got {name!r}")
    gguf = gguf_source(model)
    if gguf is None:
        raise ValueError(f"--peer {name} runs the GGUF a model was dequantised from; {model!r} has none")
    return LlamaCpp(gguf, n_ctx, threads)
