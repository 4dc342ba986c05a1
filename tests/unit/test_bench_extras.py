"""Benchmarks that compare with an optional install stop at once with how to install it when it is
missing (`--peer llama-cpp`: llama-cpp-python; `--grammar-engines`: xgrammar), before loading a model;
and `--peer` is refused for a model without a GGUF. The installs are stood in for by an import that
fails, whether or not this machine has them."""
from __future__ import annotations

import sys

import pytest

from specd.bench import grammar_engines, peer


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
