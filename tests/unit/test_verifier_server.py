"""The verifier replica's batcher thread (`cluster/verifier.py`), without Ray: an operation the
batcher runs for a caller (set_pipeline, abort_ids) that fails reaches that caller as its error,
and the batcher goes on serving."""
import asyncio

import pytest
import torch

from cluster.config import ClusterConfig
from cluster.verifier import VerifierServer


def test_a_failed_batcher_op_reaches_its_caller_and_the_batcher_goes_on(monkeypatch):
    cfg = ClusterConfig.model_validate({
        "model": "tiny", "dtype": "fp32", "device": "cpu", "max_len": 128,
        "router": {"max_tokens": 64, "default_max_tokens": 32},
        "verifier": {"max_batch": 2, "torch_threads": torch.get_num_threads()},
        "drafts": [{"name": "ngram", "spec": "ngram"}]})
    server = VerifierServer(cfg.model_dump())

    def broken(on: bool) -> None:
        raise RuntimeError("pipelining unavailable")

    monkeypatch.setattr(server.engine, "set_pipeline", broken)

    async def calls():
        with pytest.raises(RuntimeError, match="pipelining unavailable"):
            await asyncio.wait_for(server.set_pipeline(True), 30)  # before the fix: a NameError in the loop, a hang
        return await asyncio.wait_for(server.abort_ids(["nobody"]), 30)

    assert asyncio.run(calls()) == []


def test_grammar_masking_false_reaches_only_that_draft():
    """`drafts[].grammar_masking: false` (the structured bench's unmasked twin, or an operator who
    finds masking not worth its cost) switches masking off for that draft and no other."""
    cfg = ClusterConfig.model_validate({
        "model": "tiny", "dtype": "fp32", "device": "cpu", "max_len": 128,
        "router": {"max_tokens": 64, "default_max_tokens": 32},
        "verifier": {"max_batch": 2, "torch_threads": torch.get_num_threads()},
        "drafts": [{"name": "masked", "spec": "truncated:1"},
                   {"name": "unmasked", "spec": "truncated:1", "grammar_masking": False}]})
    drafters = VerifierServer(cfg.model_dump()).engine.drafters
    assert drafters["masked"].grammar_masking is True
    assert drafters["unmasked"].grammar_masking is False
    assert drafters["masked"] is not drafters["unmasked"]
