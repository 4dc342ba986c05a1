"""`specd generate --local` end to end on the embedded model: the user-facing greedy contract.

Greedy output with every drafter must be token-identical to Hugging Face `generate` of the
target alone (fp32). The prompt is an ordinary question nobody tuned the engine to.
"""
import json

import pytest
import torch

from helpers import chat_ids
from specd.cli import main

PROMPT = "Name three rivers in Europe and one fact about each."


@pytest.fixture(scope="module")
def hf_reference(smollm2):
    ids = chat_ids(smollm2.tokenizer, PROMPT)
    out = smollm2.model.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False,
                                 eos_token_id=sorted(smollm2.eos_token_ids), pad_token_id=0)
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("draft", ["none", "ngram", "truncated:4", "truncated:30"])
def test_generate_local_greedy_matches_hf(draft, hf_reference, capsys):
    rc = main(["generate", "--local", "--dtype", "fp32", "--temperature", "0", "--max-tokens", "24",
               "--messages-json", json.dumps([{"role": "user", "content": PROMPT}]),
               "--draft", draft, "--gamma", "4", "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert out["token_ids"] == hf_reference
    assert set(out) >= {"token_ids", "text", "stats", "dtype", "prepacked", "dtype_reason", "cpu_paths"}
    # the choice it reports: fp32, prepacked only where this CPU runs it (and it measured faster)
    assert out["dtype"] == "fp32" and out["dtype_reason"].startswith("fp32+prepacked" if out["prepacked"] else "fp32")
    assert out["prepacked"] <= (out["cpu_paths"]["prepack-fp32"] == "ok")
    assert out["text"].strip()
    stats = out["stats"]
    if draft == "none":
        assert stats["draft_tokens"] == 0
    else:
        assert stats["accepted_tokens"] <= stats["draft_tokens"]
    if draft == "truncated:30":  # all 30 layers: the draft IS the target, so every draft is accepted
        assert stats["acceptance_rate"] == 1.0


def test_generate_local_sampling_is_reproducible_with_seed(capsys):
    args = ["generate", "--local", "--temperature", "0.8", "--top-p", "0.9", "--seed", "7", "--max-tokens", "12",
            "--prompt", "Once upon a time", "--draft", "truncated:4", "--json"]
    assert main(args) == 0
    first = json.loads(capsys.readouterr().out)["token_ids"]
    assert main(args) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == first
    assert main([a if a != "7" else "8" for a in args]) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] != first


@pytest.mark.parametrize("argv, field", [
    (["--max-tokens", "0"], "max_tokens"),
    (["--temperature", "-1"], "temperature"),
    (["--top-p", "1.5"], "top_p"),
    (["--gamma", "99", "--draft", "ngram"], "gamma"),
    (["--draft", "/nonexistent/draft"], "nonexistent"),
])
def test_generate_bad_arguments_exit_2_naming_the_field(argv, field, capsys):
    rc = main(["generate", "--local", "--prompt", "hi", "--json"] + argv)
    assert rc == 2
    assert field in capsys.readouterr().err
