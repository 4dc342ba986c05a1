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
