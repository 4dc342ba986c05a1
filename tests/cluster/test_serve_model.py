"""`specd serve --model DIR` with no config file, as a user serving their own model runs it: a tiny
random Qwen3 directory (with a real tokenizer) is served by the CLI in its own process and its own
local Ray cluster; the printed addresses answer the `openai` client and the SDK, over real gRPC and
HTTP, with the target's own greedy output under speculation."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest
import torch

from helpers import chat_ids, save_tiny_qwen3
from specd_client import SpecdClient

ROOT = Path(__file__).resolve().parents[2]
QUESTION = "Name three colours."


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(gRPC address, HTTP base URL, the HF model, its tokenizer) of a running `specd serve --model`."""
    from transformers import AutoTokenizer

    model_dir = tmp_path_factory.mktemp("models") / "tiny-qwen3"
    model = save_tiny_qwen3(model_dir)
    tok = AutoTokenizer.from_pretrained(model_dir)
    cmd = [sys.executable, "-m", "specd.cli", "serve", "--model", str(model_dir), "--draft", "ngram",
           "--draft", "self=truncated:2", "--dtype", "fp32", "--grpc-port", "0", "--http-port", "0"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)}, start_new_session=True)
    lines: list[str] = []
    try:
        end = time.time() + 600
        while time.time() < end and not any(line.lstrip().startswith("metrics") for line in lines):
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
        out = "".join(lines)
        grpc_addr = re.search(r"gRPC\s+(\S+)", out)
        http = re.search(r"HTTP\s+(http://\S+)", out)
        assert grpc_addr and http and re.search(r"metrics\s+http://\S+/metrics", out), out[-3000:]
        yield grpc_addr.group(1), http.group(1), model, tok
    finally:
        os.killpg(proc.pid, signal.SIGINT)  # the CLI shuts its cluster down
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def greedy(model, ids: list[int], n: int) -> list[int]:
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(ids):].tolist()


def test_serve_a_model_directory_without_config_answers_the_sdk_and_openai(served):
    addr, base_url, model, tok = served
    ref = greedy(model, chat_ids(tok, QUESTION), 12)
    messages = [{"role": "user", "content": QUESTION}]
    with SpecdClient(addr, timeout=120) as client:
        models = client.list_models()
        assert models.target == "tiny-qwen3"
        assert {d.name for d in models.drafts} >= {"ngram", "self"}
        sdk = client.generate(messages=messages, max_tokens=12, temperature=0, draft="self", gamma=2)
    assert sdk.token_ids == ref
    assert sdk.spec_stats["draft_tokens"] > 0
    oa = openai.OpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=120)
    assert [m.id for m in oa.models.list().data] == ["tiny-qwen3"]
    r = oa.chat.completions.create(model="tiny-qwen3", messages=messages, max_tokens=12, temperature=0,
                                   extra_body={"draft": "ngram", "return_token_ids": True})
    assert r.choices[0].token_ids == ref
    assert r.choices[0].message.content == sdk.text


def readme_blocks(section: str) -> dict[str, list[str]]:
    """The fenced code blocks of a README section, by language."""
    text = (ROOT / "README.md").read_text()
    body = text.split(f"## {section}\n", 1)[1].split("\n## ", 1)[0]
    blocks: dict[str, list[str]] = {}
    for lang, code in re.findall(r"```(\w+)\n(.*?)```", body, re.S):
        blocks.setdefault(lang, []).append(code)
    return blocks


def test_the_readmes_serve_your_model_requests_run(served, capsys):
    """The README's curl and Python requests of "Serve your model", as printed there, against the
    served directory (its addresses and name substituted for the README's)."""
    import json
    import shutil
    import urllib.request

    addr, base_url, _, _ = served

    def local(code: str) -> str:
        return (code.replace("http://127.0.0.1:8000/v1", base_url).replace("127.0.0.1:9000", addr)
                .replace('"my-model"', '"tiny-qwen3"'))
    blocks = readme_blocks("Serve your model")
    curl = next(c for c in blocks["bash"] if c.lstrip().startswith("curl"))
    cmd = local(curl).replace("\\\n", " ")
    if shutil.which("curl"):
        out = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, timeout=120).stdout
    else:  # the same request without curl
        url = re.search(r"(http://\S+)", cmd).group(1)
        body = re.search(r"-d '(.*)'", cmd).group(1).encode()
        req = urllib.request.Request(url, body, {"Content-Type": "application/json"})
        out = urllib.request.urlopen(req, timeout=120).read().decode()
    r = json.loads(out)
    assert r["model"] == "tiny-qwen3" and r["choices"][0]["message"]["content"] is not None
    python, = blocks["python"]
    exec(compile(local(python), "README.md", "exec"), {})
    printed = capsys.readouterr().out
    assert printed.count("\n") >= 2 and r["choices"][0]["message"]["content"] in printed
