"""Benchmarks that compare with an optional install stop at once with how to install it when it is
missing (`--peer llama-cpp`: llama-cpp-python; `--grammar-engines`: xgrammar), before loading a model;
and `--peer` is refused for a model without a GGUF. The installs are stood in for by an import that
fails, whether or not this machine has them. The structured bench's cluster (`--serve --structured`)
is the config's, with one verifier replica and an unmasked twin beside each colocated model draft."""
from __future__ import annotations

import os
import sys

import pytest

from cluster.config import LOCAL_CONFIG, ClusterConfig
from specd.bench import grammar_engines, peer, structured


def test_peer_llama_cpp_without_the_extra_stops_with_the_install_hint(monkeypatch):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import llama_cpp -> ImportError
    with pytest.raises(SystemExit, match=r"pip install 'specd\[llama-cpp\]'"):
        peer.make_peer("llama-cpp", "smollm2", 512, 1)
    with pytest.raises(ValueError, match="--peer llama-cpp runs the GGUF .* 'tiny' has none"):
        peer.make_peer("llama-cpp", "tiny", 512, 1)
    with pytest.raises(ValueError, match=r"--peer must be one of \['llama-cpp'\]"):
        peer.make_peer("vllm", "smollm2", 512, 1)


def test_grammar_engines_without_xgrammar_stops_with_the_install_hint(monkeypatch):
    monkeypatch.setitem(sys.modules, "xgrammar", None)
    with pytest.raises(SystemExit, match="pip install --no-deps xgrammar apache-tvm-ffi"):
        grammar_engines.compare("smollm2")


def test_the_structured_serve_bench_runs_the_configs_drafts_with_unmasked_twins():
    cfg = structured.serve_config(ClusterConfig.load(LOCAL_CONFIG), (), (1, 32))
    drafts = {d.name: d for d in cfg.drafts}
    # the shipped config: ngram, suffix, the EAGLE head (colocated) and truncated:4 (remote)
    assert set(drafts) == {"ngram", "suffix", "eagle", "truncated:4", "eagle-unmasked"}
    assert drafts["eagle-unmasked"].spec == drafts["eagle"].spec and not drafts["eagle-unmasked"].grammar_masking
    assert drafts["eagle"].grammar_masking
    assert cfg.verifier.max_batch == 32  # as wide as the top concurrency
    assert cfg.verifier.autoscaling.min_replicas == cfg.verifier.autoscaling.max_replicas == 1
    assert drafts["truncated:4"].autoscaling.max_replicas == 1
    assert (cfg.grpc_port, cfg.http_port) == (0, 0)
    only = structured.serve_config(ClusterConfig.load(LOCAL_CONFIG), ("ngram",), (1, 8))
    assert [d.name for d in only.drafts] == ["ngram"]
    with pytest.raises(ValueError, match=r"--draft \['nope'\]: the config serves"):
        structured.serve_config(ClusterConfig.load(LOCAL_CONFIG), ("nope",), (1, 8))


FAKE = '''
import os, signal
__version__ = "fake-0"

class Llama:
    def __init__(self, model_path, **kw):
        self.path = model_path

    def generate(self, ids, **kw):
        if ids[0] == 666:  # what a llama.cpp build for another CPU does on its first decode
            os.kill(os.getpid(), signal.SIGILL)
        for i in range(1000):
            yield ids[-1] + i + 1
'''


def test_the_peer_runs_in_its_own_process_and_a_crash_there_is_the_peers_failure(tmp_path, monkeypatch):
    """llama-cpp-python is not installed here (its build compiles llama.cpp for minutes): a stand-in
    module with its `Llama` interface plays it, in the peer's child process, and dies with SIGILL
    on one prompt as the AMX build does in a KVM guest. The bench's process survives, told why."""
    (tmp_path / "llama_cpp").mkdir()
    (tmp_path / "llama_cpp" / "__init__.py").write_text(FAKE)
    monkeypatch.syspath_prepend(str(tmp_path))  # the spawned child takes the parent's sys.path
    p = peer.make_peer("llama-cpp", "smollm2", 512, 1)
    try:
        assert p.version == "fake-0" and p.proc.pid != os.getpid()
        assert p.generate([5, 7], 3, eos=[]) == [8, 9, 10]
        assert p.generate([5, 7], 10, eos=[10]) == [8, 9, 10]
        with pytest.raises(peer.PeerFailed, match=r"llama.cpp died: SIGILL \(illegal instruction"):
            p.generate([666, 1], 3, eos=[])
        with pytest.raises(peer.PeerFailed):  # and stays failed
            p.generate([5], 3, eos=[])
    finally:
        p.close()


def test_llama_cpp_build_options_keep_amx_off_and_name_the_cpus_simd():
    args = peer.cmake_args({"avx", "avx2", "fma", "f16c", "avx512f", "avx512_vnni", "amx_tile", "amx_int8"})
    assert "-DGGML_NATIVE=OFF" in args and "-DGGML_AVX512_VNNI=ON" in args and "-DGGML_AVX512_BF16=OFF" in args
    assert all(f"-DGGML_AMX_{k}=OFF" in args for k in ("TILE", "INT8", "BF16"))
    assert "-DGGML_AVX2=OFF" in peer.cmake_args({"avx"})
