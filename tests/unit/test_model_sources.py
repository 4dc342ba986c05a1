"""Where a target comes from: a local directory, or a hub id resolved through the local Hugging Face
cache with the network off (HF_HUB_OFFLINE=1), as a cluster node with a mounted cache or a
pre-downloaded volume runs; and the name it is served under."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from actors.models import default_served_name, is_hub_id
from helpers import save_tiny_qwen3

ROOT = Path(__file__).resolve().parents[2]
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def hub_cache(root: Path, repo: str, model_dir: Path, commit: str = COMMIT) -> Path:
    """The layout huggingface_hub writes: models--org--name/{refs/main, snapshots/<commit>/...}
    (here with copies, where the hub links into blobs/)."""
    repo_dir = root / ("models--" + repo.replace("/", "--"))
    snap = repo_dir / "snapshots" / commit
    shutil.copytree(model_dir, snap)
    (repo_dir / "refs").mkdir(parents=True)
    (repo_dir / "refs" / "main").write_text(commit)
    return snap


def load_offline(specs: list[str], cache: Path) -> tuple[list[dict], str]:
    """Load each of `specs` in one fresh process whose environment sends the hub offline and at
    `cache` (huggingface_hub reads both when it is imported): per spec, what loaded, or the error;
    and what the process wrote to stderr."""
    code = ("import json, sys, torch\nfrom actors.models import load_model\n"
            "for spec in sys.argv[1:]:\n"
            "    try:\n"
            "        m = load_model(spec)\n"
            "    except Exception as e:\n"
            "        print(json.dumps({'error': f'{type(e).__name__}: {e}'}))\n"
            "        continue\n"
            "    with torch.inference_mode():\n"
            "        nxt = m.model(torch.tensor([[5, 6, 7, 8]])).logits[0, -1].argmax().item()\n"
            "    print(json.dumps({'name': m.name, 'type': m.model.config.model_type, 'next': nxt}))\n")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache), "PYTHONPATH": str(ROOT)}
    env.pop("HF_HOME", None)
    out = subprocess.run([sys.executable, "-c", code, *specs], env=env, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-2000:]
    return [json.loads(line) for line in out.stdout.strip().splitlines()[-len(specs):]], out.stderr


def test_hub_id_loads_offline_from_the_cache_layout(tmp_path):
    model = save_tiny_qwen3(tmp_path / "src", tokenizer=False)
    cache = tmp_path / "hub"
    hub_cache(cache, "acme/tiny-qwen3", tmp_path / "src")
    import torch

    with torch.inference_mode():
        want = model(torch.tensor([[5, 6, 7, 8]])).logits[0, -1].argmax().item()
    # the main ref, a pinned revision, and one offline and not in the cache: a clear error
    (main, pinned, missing), stderr = load_offline(["acme/tiny-qwen3", f"acme/tiny-qwen3@{COMMIT}", "acme/not-cached"],
                                                   cache)
    # a fresh process loads quietly: no torchao kernel-library or pytree warnings, no progress bar
    assert not any(noise in stderr for noise in ("Failed to load", "_pytree", "Loading weights")), stderr[-2000:]
    assert main == pinned == {"name": "acme/tiny-qwen3", "type": "qwen3", "next": want}
    assert "HF_HUB_OFFLINE=1 is set and the local hub cache" in missing["error"]
    assert "acme/not-cached" in missing["error"]


def test_specs_and_served_names(tmp_path):
    save_tiny_qwen3(tmp_path / "my-model", tokenizer=False)
    assert is_hub_id("meta-llama/Llama-3.1-8B-Instruct") and is_hub_id("Qwen/Qwen3-8B@main")
    assert not is_hub_id("smollm2") and not is_hub_id("/abs/path") and not is_hub_id(str(tmp_path / "my-model"))
    assert default_served_name("meta-llama/Llama-3.1-8B-Instruct@abc123") == "meta-llama/Llama-3.1-8B-Instruct"
    assert default_served_name(str(tmp_path / "my-model")) == "my-model"
    assert default_served_name("smollm2") == "smollm2"
    from cluster.config import ClusterConfig

    assert ClusterConfig(model=str(tmp_path / "my-model")).served_name == "my-model"
    assert ClusterConfig(model="smollm2", served_model_name="chat").served_name == "chat"
    from actors.models import load_model

    with pytest.raises(FileNotFoundError, match="holds no config.json"):
        load_model(str(tmp_path))
    with pytest.raises(FileNotFoundError, match="nor a hub id"):
        load_model("no such thing")
