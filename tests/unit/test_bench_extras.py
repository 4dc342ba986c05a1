"""Benchmarks that compare with an optional install stop at once with how to install it when it is
missing (`--peer llama-cpp`: llama-cpp-python; `--grammar-engines`: xgrammar), before loading a model;
and `--peer` is refused for a model without a GGUF. The installs are stood in for by an import that
fails, whether or not this machine has them. The structured bench's cluster (`--serve --structured`)
is the config's, with one verifier replica and an unmasked twin beside each colocated model draft."""
from __future__ import annotations

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
