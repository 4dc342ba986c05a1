"""The engine's step keeps its tensors on the model's device and never waits on it, checked
without a GPU.

The target runs on PyTorch's meta device: tensors there have shapes, dtypes and a device but
no data, so anything that reads a value on the host (`.item()`, `bool(t)`, `int(t)`,
`.tolist()`: a host synchronisation on a GPU) raises, and so does mixing in a tensor left on
the CPU (an implicit transfer). A TorchDispatchMode records every op of the prefill and verify
passes with the device of each output: all must be on the model's device, except host data
entering (`torch.tensor(list)`: the token feed, copied once to the device). Each pass's one permitted
transfer back (`SpecEngine._to_host`: accepted counts and tokens) is counted and answered with
placeholder values, the only thing the test stands in for. The batch mixes a greedy row, a
seeded (coupled) sampled row and an unseeded (rejection-sampled) row, with n-gram drafts.
"""
from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import LlamaForCausalLM

import actors.acceptance as acceptance_mod
from actors.calibrate import PassCost, grid
from actors.drafters import NgramDrafter
from actors.engine import SpecEngine
from actors.llama import LlamaRunner
from actors.models import tiny_config
from helpers import request


class Record(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.outputs: list[tuple[str, torch.device]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in (out if isinstance(out, (tuple, list)) else [out]):
            if isinstance(t, torch.Tensor):
                self.outputs.append((str(func), t.device))
        return out


@pytest.fixture
def meta_engine(monkeypatch):
    with torch.device("meta"):
        model = LlamaForCausalLM(tiny_config()).eval()
    runner = LlamaRunner(model)
    assert runner.device.type == "meta"
    cost = PassCost({(b, t): 0.01 * (1 + 0.02 * (t - 1)) for b, t in grid(4)})  # speculation pays
    eng = SpecEngine(runner, {"ngram": NgramDrafter()}, max_batch=4, max_len=64, pass_cost=cost)
    rec, transfers = Record(), []

    def to_host(t: torch.Tensor) -> list:  # the one transfer: placeholder values of the right shape
        transfers.append(tuple(t.shape))
        return [0] * t.shape[0] if t.dim() == 1 else [[0] * t.shape[1] for _ in range(t.shape[0])]

    def recorded(fn):
        def run(*a, **kw):
            with rec:
                return fn(*a, **kw)
        return run
    monkeypatch.setattr(acceptance_mod, "to_host", to_host)
    monkeypatch.setattr(eng, "_prefill", recorded(eng._prefill))
    monkeypatch.setattr(eng, "verify", recorded(eng.verify))
    return eng, rec, transfers


def test_one_step_stays_on_the_device_with_one_transfer_per_pass(meta_engine):
    eng, rec, transfers = meta_engine
    repetitive = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7]
    eng.add_request(request("greedy", repetitive, "ngram", 3, max_tokens=10))
    eng.add_request(request("coupled", repetitive, "ngram", 3, max_tokens=10, temperature=0.7, seed=3))
    eng.add_request(request("rejection", repetitive, "ngram", 2, max_tokens=10, temperature=0.9, top_k=5,
                            top_p=0.9))
    eng.step()  # prefill + first token, then one verify pass with drafts
    eng.step()  # a verify pass
    # One transfer per pass: [B] first tokens after the prefill, then [B, 1 + (G+1)] per verify pass
    # (accepted count + tokens), with drafts in at least one of them (G > 0).
    assert len(transfers) == 3 and transfers[0] == (3,) and all(t[0] == 3 for t in transfers[1:])
    assert max(t[1] for t in transfers[1:]) > 2
    assert rec.outputs, "nothing recorded"
    host_data = {"aten.lift_fresh.default", "aten.detach_.default"}  # what torch.tensor(list) dispatches
    off = {(op, str(d)) for op, d in rec.outputs if d.type != "meta" and op not in host_data}
    assert not off, f"ops whose output left the model's device: {sorted(off)}"
    assert eng.batcher.target_passes == 2 and eng.stats.draft_tokens == 0  # (finished requests only)


def test_a_host_read_inside_the_step_fails_the_check(meta_engine, monkeypatch):
    """The check can fail: an acceptance rule that reads a value on the host (a planted
    `bool(...)` precondition, as sampling.py had) raises on the meta device."""
    eng, _, _ = meta_engine
    real = acceptance_mod.verify_greedy

    def syncing(logits, draft, num):
        assert bool((num >= 0).all())  # a host synchronisation per call
        return real(logits, draft, num)
    monkeypatch.setattr(acceptance_mod, "verify_greedy", syncing)
    eng.add_request(request("greedy", [5, 6, 7, 8, 5, 6, 7], "ngram", 3, max_tokens=10))
    with pytest.raises(RuntimeError, match="meta"):
        eng.step()  # the first verify pass already reads on the host


def test_kv_cache_dtype_follows_the_device(tiny):
    runner = LlamaRunner(tiny.model)
    assert runner.new_cache(1, 16).k.dtype == torch.float32  # CPU: fp32 KV (faster attention here)
    with torch.device("meta"):
        m = LlamaForCausalLM(tiny_config()).to(torch.bfloat16).eval()
    assert LlamaRunner(m).new_cache(1, 16).k.dtype == torch.bfloat16  # an accelerator: the model's dtype
