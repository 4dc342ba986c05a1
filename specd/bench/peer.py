"""Peers for `specd bench --local --peer NAME`: another runtime on the same weights and prompts.

  llama-cpp   llama.cpp through `llama-cpp-python` (the optional extra `specd[llama-cpp]`, built on
              the user's machine for its CPU; `make llama-cpp` builds it with the SIMD paths this CPU
              has and llama.cpp's AMX kernels off, which die with SIGILL in a KVM guest of an AMX Xeon),
              on the very GGUF the embedded model was dequantised from; greedy, batch 1, as many
              threads as torch uses here. It is fed the engine's own prompt token ids (the same
              vocabulary), so both decode the same sequences. It runs in a child process of its own:
              a crash there (an illegal instruction in a build for another CPU) is reported as the
              peer's failure (`PeerFailed`), and the bench goes on without it.

A peer is one more configuration of the bench, interleaved with the others prompt by prompt; the
table then prints every configuration's tokens/s against the peer's at batch 1 ("× peer").
"""
from __future__ import annotations

import importlib.util
import multiprocessing
import signal
import sys
from pathlib import Path

PEERS = ("llama-cpp",)
INSTALL_HINT = ("--peer llama-cpp needs llama-cpp-python, built for this CPU: `make llama-cpp` (or pip install "
                "'specd[llama-cpp]'; it compiles llama.cpp, a few minutes on 2 cores, and needs a C++ compiler "
                "and cmake)")


class PeerFailed(RuntimeError):
    """The peer's process died or raised: the bench reports it and goes on without the peer."""


class LlamaCpp:
    """llama.cpp over a GGUF file, in its own process: `generate(ids, max_tokens, eos)` -> greedy
    output token ids."""
    name = "llama.cpp"

    def __init__(self, gguf, n_ctx: int, threads: int):
        if importlib.util.find_spec("llama_cpp") is None:
            raise SystemExit(INSTALL_HINT)
        ctx = multiprocessing.get_context("spawn")  # no fork of a process holding torch's threads
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(child, str(gguf), n_ctx, threads), daemon=True,
                                name="specd-peer-llama.cpp")
        self.proc.start()
        child.close()
        self.version = self._reply()

    def generate(self, ids: list[int], max_tokens: int, eos: list[int]) -> list[int]:
        try:
            self.conn.send(("generate", list(ids), max_tokens, list(eos)))
        except (BrokenPipeError, OSError):
            pass  # the child is gone: _reply says how
        return self._reply()

    def _reply(self):
        try:
            kind, value = self.conn.recv()
        except (EOFError, OSError):
            self.proc.join(10)
            raise PeerFailed(f"{self.name} died: {exit_reason(self.proc.exitcode)}") from None
        if kind == "error":
            raise PeerFailed(f"{self.name} failed: {value}")
        return value

    def close(self) -> None:
        if self.proc.is_alive():
            try:
                self.conn.send(("stop",))
            except (BrokenPipeError, OSError):
                pass
            self.proc.join(10)
            if self.proc.is_alive():
                self.proc.kill()
        self.conn.close()


def exit_reason(code: int | None) -> str:
    """A child's exit code in words: 'SIGILL (illegal instruction: a build for another CPU)'."""
    if code is None:
        return "still running"
    if code < 0:
        sig = signal.Signals(-code)
        why = {signal.SIGILL: "illegal instruction: a build for another CPU, see `make llama-cpp`",
               signal.SIGSEGV: "segmentation fault", signal.SIGKILL: "killed, perhaps out of memory"}.get(sig)
        return f"{sig.name}" + (f" ({why})" if why else "")
    return f"exit code {code}"


def _serve(conn, gguf: str, n_ctx: int, threads: int) -> None:
    """The peer's process: load llama.cpp, then answer ("generate", ids, max_tokens, eos) requests."""
    try:
        import llama_cpp

        llm = llama_cpp.Llama(model_path=gguf, n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                              n_batch=512, verbose=False)
        conn.send(("ok", getattr(llama_cpp, "__version__", "?")))
    except Exception as e:  # noqa: BLE001 - reported to the bench as the peer's failure
        conn.send(("error", f"{type(e).__name__}: {e}"))
        return
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return
        if msg[0] == "stop":
            return
        _, ids, max_tokens, eos = msg
        try:
            out: list[int] = []
            for t in llm.generate(ids, temp=0.0, top_k=1, repeat_penalty=1.0, reset=True):
                out.append(int(t))
                if t in eos or len(out) >= max_tokens:
                    break
            conn.send(("ok", out))
        except Exception as e:  # noqa: BLE001
            conn.send(("error", f"{type(e).__name__}: {e}"))


def make_peer(name: str, model: str, n_ctx: int, threads: int):
    """The peer `name` for target `model` (a GGUF-born model: the peer loads the same file)."""
    from actors.models import gguf_source

    if name not in PEERS:
        raise ValueError(f"--peer must be one of {list(PEERS)}, got {name!r}")
    gguf = gguf_source(model)
    if gguf is None:
        raise ValueError(f"--peer {name} runs the GGUF a model was dequantised from; {model!r} has none")
    return LlamaCpp(gguf, n_ctx, threads)


def cmake_args(flags: set[str] | None = None) -> str:
    """llama.cpp's build options for this CPU (`make llama-cpp`): its SIMD paths where the CPU has
    them, not -march=native, and its AMX kernels off (they die with SIGILL in a KVM guest of an AMX
    Xeon, even after arch_prctl grants AMX; torch's AMX path runs there)."""
    if flags is None:
        flags = set()
        try:
            for line in Path("/proc/cpuinfo").read_text().splitlines():
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    break
        except OSError:
            pass
    has = {"AVX": "avx", "AVX2": "avx2", "FMA": "fma", "F16C": "f16c", "AVX512": "avx512f",
           "AVX512_VNNI": "avx512_vnni", "AVX512_BF16": "avx512_bf16", "AVX_VNNI": "avx_vnni"}
    opts = ["-DGGML_NATIVE=OFF"] + [f"-DGGML_{k}={'ON' if v in flags else 'OFF'}" for k, v in has.items()]
    return " ".join(opts + ["-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"])


if __name__ == "__main__" and sys.argv[1:] == ["--cmake-args"]:
    print(cmake_args())
