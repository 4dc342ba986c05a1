"""Assemble an engine from specs: a target model spec, draft specs, dtype, sizes.

Draft specs (one name space for the CLI, the bench and, later, the cluster config):
  "none"           speculation off
  "ngram[:N]"      prompt lookup with n-grams of N (default 3) down to 1 tokens; "ngram:MIN-MAX" bounds both
  "truncated:K"    the target's first K layers + its final norm and LM head (shared weights)
  PATH             a separate draft model: any local Hugging Face llama-family directory, or a
                   checkpoint written by `specd distill` (EAGLE head, trained truncated or small model)
  "default"        the distilled draft shipped for the target (see DEFAULT_DRAFTS); n-gram, with a
                   logged line, for a target no draft ships for
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from .calibrate import TOKENS, PassCost, calibrated, choose_dtype, hardware
from .drafters import Drafter, ModelDrafter, NgramDrafter
from .drafters.base import KV_HEADROOM
from .engine import SpecEngine
from . import cpu
from .llama import PACKABLE, LlamaRunner
from .models import LoadedModel, check_draft_compatible, load_model, resolve_device, vocab_fingerprint
from .schema import PREPACK_CHOICES
from .tune_profile import matching

# Shipped distilled drafts, by target name (LoadedModel.name), inside this package.
DEFAULT_DRAFT_ROOT = Path(__file__).parent / "default_drafts"
DEFAULT_DRAFTS = {"SmolLM2-135M-Instruct": "smollm2-eagle3"}  # smollm2-eagle: the single-layer head before it
DRAFT_META = "specd_draft.json"
log = logging.getLogger("specd")


def resolve_draft(spec: str, target_name: str = "SmolLM2-135M-Instruct") -> str:
    """'default' -> the shipped draft directory for this target; other specs unchanged."""
    if spec != "default":
        return spec
    sub = DEFAULT_DRAFTS.get(target_name)
    if sub is None or not (DEFAULT_DRAFT_ROOT / sub / DRAFT_META).exists():
        raise ValueError(f"no default draft ships for target {target_name!r} "
                         f"(defaults exist for {sorted(DEFAULT_DRAFTS)}); train one with `specd distill`")
    return str(DEFAULT_DRAFT_ROOT / sub)


def draft_meta(spec: str) -> dict | None:
    """The metadata of a `specd distill` checkpoint, or None for other specs."""
    try:
        path = Path(resolve_draft(spec)) / DRAFT_META
    except ValueError:
        return None
    return json.loads(path.read_text()) if path.exists() else None


def draft_kind(spec: str) -> str:
    """"ngram", "truncated", "eagle" or "model": what a draft spec is, without loading it."""
    if spec == "ngram" or spec.startswith("ngram:"):
        return "ngram"
    if spec.startswith("truncated:"):
        return "truncated"
    meta = draft_meta(spec)
    return "eagle" if meta and meta.get("kind") == "eagle" else "model"


def draft_mode(spec: str, asked: str = "none") -> str:
    """The int8 mode a draft runs in: `asked`, else the one a `specd distill --qat` checkpoint
    was trained for, else "none"."""
    from .quant import check_mode

    check_mode(asked, "draft quant")
    return asked if asked != "none" else (draft_meta(spec) or {}).get("qat", "none")


def ready_drafter(drafter: Drafter | None, spec: str, quant: str = "none", prepack: str = "auto") -> Drafter | None:
    """A drafter as it serves: in its int8 mode (`draft_mode`), then, for whatever int8 left
    dense, in the prepacked layout (`with_prepack`). Drafters without weights pass through."""
    from .quant import quantize_drafter

    if drafter is None:
        return None
    drafter = quantize_drafter(drafter, draft_mode(spec, quant))
    if getattr(drafter, "runner", None) is not None:
        with_prepack(drafter.runner, prepack)
    return drafter


def spec_feature_layers(spec: str) -> tuple[int, ...]:
    """The target features a draft reads (`Drafter.feature_layers`): empty unless it is a
    feature-level head (single-layer heads from before fused features read the final state)."""
    meta = draft_meta(spec)
    if not (meta and meta.get("kind") == "eagle"):
        return ()
    return tuple(meta.get("feature_layers", [-1]))


def load_distilled(path: str, target: LoadedModel, max_batch: int, max_len: int) -> Drafter:
    """A drafter from a `specd distill` checkpoint, refused unless it was trained for this
    target's vocabulary."""
    from .drafters.eagle import EagleDrafter, EagleHead

    meta = json.loads((Path(path) / DRAFT_META).read_text())
    want, have = meta.get("vocab_fingerprint"), vocab_fingerprint(target)
    if want != have:
        raise ValueError(f"draft {path!r} was trained for a target with vocabulary {want}, this target "
                         f"{target.name!r} has {have}: a draft must share the target's tokenizer")
    if meta["kind"] == "eagle":
        head = EagleHead.load(path, target.model)
        if head.embed.shape[1] != target.model.config.hidden_size:
            raise ValueError(f"draft {path!r}: hidden size does not match the target's")
        return EagleDrafter(head, meta.get("name", path), max_batch=max_batch, max_len=max_len)
    if meta["kind"] == "model":
        from safetensors.torch import load_file

        draft = load_model(path, next(target.model.parameters()).dtype)
        vmap_file = Path(path) / "vocab_map.safetensors"
        vmap = load_file(str(vmap_file))["vocab_map"] if vmap_file.exists() else None
        if vmap is None:
            check_draft_compatible(target, draft)
        return ModelDrafter(LlamaRunner(draft.model), meta.get("name", path), max_batch=max_batch,
                            max_len=max_len, vocab_map=vmap, vocab_size=target.model.config.vocab_size)
    raise ValueError(f"draft {path!r}: unknown checkpoint kind {meta['kind']!r}")


def ngram_drafter(spec: str) -> NgramDrafter:
    """"ngram" (n-grams of 3 down to 1 tokens), "ngram:N" (N down to 1) or "ngram:MIN-MAX"."""
    arg = spec.partition(":")[2] or "3"
    lo, _, hi = arg.rpartition("-")
    try:
        return NgramDrafter(max_n=int(hi), min_n=int(lo) if lo else 1)
    except ValueError as e:
        raise ValueError(f"draft {spec!r}: expected ngram, ngram:N or ngram:MIN-MAX with 1 <= MIN <= MAX ({e})") \
            from None


def make_drafter(spec: str, target: LoadedModel, max_batch: int, max_len: int,
                 dtype: str | torch.dtype | None = None) -> Drafter | None:
    if spec in ("none", "", None):
        return None
    if spec == "ngram" or spec.startswith("ngram:"):
        return ngram_drafter(spec)
    if spec.startswith("truncated:"):
        try:
            k = int(spec.split(":", 1)[1])
        except ValueError:
            raise ValueError(f"draft {spec!r}: truncated:K needs an integer K") from None
        d = ModelDrafter.truncated(target.model, k, max_batch=max_batch, max_len=max_len)
        return d
    if spec == "default" and target.name not in DEFAULT_DRAFTS:  # e.g. the shipped config with another model
        log.warning("specd: no default draft ships for target %r: draft 'default' drafts n-grams instead "
                    "(train a head with `specd distill`)", target.name)
        return NgramDrafter()
    path = resolve_draft(spec, target.name)
    if (Path(path) / DRAFT_META).exists():
        return load_distilled(path, target, max_batch, max_len)
    draft = load_model(spec, dtype or next(target.model.parameters()).dtype)
    check_draft_compatible(target, draft)
    return ModelDrafter(LlamaRunner(draft.model), spec, max_batch=max_batch, max_len=max_len)


@dataclass
class Built:
    engine: SpecEngine
    target: LoadedModel
    drafters: dict[str, Drafter]
    dtype: str  # what the target runs in ("bf16" or "fp32"), chosen when "auto" was asked for
    dtype_reason: str


DTYPE_CHOICES = ("auto", "bf16", "fp32")
_TORCH_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
_DTYPE_NAMES = {v: k for k, v in _TORCH_DTYPES.items()}


def with_prepack(runner: LlamaRunner, prepack: str = "auto") -> LlamaRunner:
    """`runner` with its weights in oneDNN's prepacked layout (`LlamaRunner.prepack`): "on" (refused
    with `cpu.require`'s message where this CPU cannot run that layout in the runner's dtype);
    "off"; "auto": bf16 where the layout runs (it is bit-identical to F.linear there). fp32
    prepacked rounds differently from MKL in the last bits, so "auto" leaves it to `load_target`,
    which measures it."""
    if prepack not in PREPACK_CHOICES:
        raise ValueError(f"prepack must be one of {list(PREPACK_CHOICES)}, got {prepack!r}")
    if runner.device.type != "cpu" or prepack == "off":
        return runner
    if prepack == "on":
        if runner.dtype in _DTYPE_NAMES:
            _require_prepack(_DTYPE_NAMES[runner.dtype])
        runner.prepack()
    elif runner.dtype == torch.bfloat16:
        runner.prepack()  # keeps what this CPU cannot pack as it is
    return runner


@dataclass
class Target:
    """The target as `load_target` chose to run it."""
    model: LoadedModel
    cost: PassCost | None  # its calibrated pass cost, as it runs (None: not calibrated)
    dtype: str  # "bf16" or "fp32"
    prepack: str  # "on" or "off": the layout its runner and the model drafts take
    why: str  # the choice and the measurements behind it, and the CPU paths this machine lacks


def _layouts(dtype: str, prepack: str, on_cpu: bool) -> list[str]:
    """The weight layouts `load_target` may run a dtype in. Under "auto": bf16 prepacked wherever it
    runs (the kernel a plain bf16 matmul runs, minus the per-call reorder: bit-identical and never
    slower), fp32 both ways where prepacked fp32 runs (oneDNN's kernel against MKL's: measured)."""
    path = PACKABLE[_TORCH_DTYPES[dtype]]
    if not on_cpu or prepack == "off":
        return ["off"]
    if prepack == "on":
        _require_prepack(dtype)
        return ["on"]
    if not cpu.available(path):
        return ["off"]
    return ["on"] if dtype == "bf16" else ["on", "off"]


def _require_prepack(dtype: str) -> None:
    cpu.require(PACKABLE[_TORCH_DTYPES[dtype]], f"prepack: on (dtype {dtype})",
                "prepack: auto or off" + (", or dtype: fp32" if dtype == "bf16" else ""))


def load_target(model: str, dtype: str, max_batch: int, device: str = "cpu", calibrate: bool = True,
                decode_only: bool = False, prepack: str = "auto") -> Target:
    """The target in the dtype and weight layout it runs fastest in here, with its calibrated pass
    cost. Each (dtype, layout) this CPU can run (`cpu.probe`) and the settings allow is measured
    (cached per hardware and model, see calibrate.py); the one that decodes fastest per token at
    `max_batch` rows is kept. dtype "auto" weighs bf16 and fp32; prepack "auto" takes or weighs
    the prepacked layout (`_layouts`). Never a lossy (quantized) target. An explicit setting
    the CPU cannot run (dtype bf16, prepack on) fails here with a message naming what is missing.
    calibrate=False (a quantized target, calibrated as quantized by the caller): no measurement,
    the first option (bf16 before fp32, prepacked before plain). decode_only: time one-token passes
    only (a draft replica)."""
    tokens = (1,) if decode_only else TOKENS
    if dtype not in DTYPE_CHOICES:
        raise ValueError(f"dtype must be one of {list(DTYPE_CHOICES)}, got {dtype!r}")
    if prepack not in PREPACK_CHOICES:
        raise ValueError(f"prepack must be one of {list(PREPACK_CHOICES)}, got {prepack!r}")
    device = resolve_device(device)
    on_cpu = device == "cpu"
    missing = cpu.unavailable_line() if on_cpu else ""
    if dtype == "bf16" and on_cpu:
        cpu.require("bf16", "dtype: bf16", "dtype: auto or fp32")
    dtypes = [dtype] if dtype != "auto" else ["bf16", "fp32"] if not on_cpu or cpu.available("bf16") else ["fp32"]
    options = [(dt, lay) for dt in dtypes for lay in _layouts(dt, prepack, on_cpu)]
    note = f"; unavailable here: {missing}" if missing else ""
    if not calibrate:
        dt, lay = options[0]
        return Target(load_model(model, dt, device), None, dt, lay,
                      f"{_label((dt, lay))}: not measured (a quantized target is calibrated as it runs){note}")
    costs, loaded = {}, {}
    for dt, lay in options:
        if dt not in loaded:
            loaded[dt] = load_model(model, dt, device)
        t = loaded[dt]
        costs[dt, lay] = calibrated(with_prepack(LlamaRunner(t.model), lay), t.name, max_batch, device,
                                    tokens=tokens)
    if len(options) == 1:
        (dt, lay), = options
        why = f"{_label((dt, lay))}: " + ("as configured" if (dtype, prepack) == (dt, lay) else
                                          "the only option these settings leave here")
    else:
        (dt, lay), why = choose_dtype(costs, max_batch, _label)
    return Target(loaded[dt], costs[dt, lay], dt, lay, why + note)


def _label(option: tuple[str, str]) -> str:
    """(dtype, prepack) -> "fp32+prepacked", "bf16", ..."""
    dtype, prepack = option
    return f"{dtype}+prepacked" if prepack == "on" else dtype


def build_engine(model: str = "smollm2", drafts: list[str] | dict[str, str] = (), dtype: str = "auto",
                 max_batch: int = 8, max_len: int = 2048, device: str = "cpu",
                 extra_drafters: dict[str, Drafter] | None = None, seq_id_base: int = 0, pipeline: bool = False,
                 prefill_chunk: int = 512, default_gamma: dict[str, int | str] | None = None,
                 compile: bool = False, tune_profile: str | None = None, quant: str = "none",
                 draft_quant: str | dict[str, str] = "none", prepack: str = "auto") -> Built:
    """drafts: specs (each served under its own spec as name) or {name: spec}.
    extra_drafters: ready drafters by name (e.g. remote ones on draft replicas).
    dtype: "auto" (see `load_target`), "bf16" or "fp32"; device: "auto" (a GPU when there is
    one), "cpu", "cuda" or "cuda:N"; compile: torch.compile the target's layer math (opt-in).
    tune_profile: a `specd tune` profile file or directory, searched besides the profile store;
    where a profile matches this hardware, target, dtype and a draft spec, the speculation policy
    starts that drafter from its acceptance and draft cost and reads the pass cost from it
    instead of the load-time calibration (`tune_profile.py`).
    quant: the target's int8 mode (`actors/quant.py`; lossy: the output changes), calibrated
    as quantized; draft_quant: the model-backed drafts' mode, one for all or by draft name
    (lossless: the target verifies). A checkpoint trained with `specd distill --qat` runs in
    the mode it was trained for unless draft_quant names another. prepack: the target's and the
    model drafts' weights in oneDNN's prepacked CPU layout (`with_prepack`; not with compile).
    The rest as `SpecEngine` takes them."""
    from .quant import check_mode, quantize_runner

    device = resolve_device(device)
    check_mode(quant)
    named = dict(drafts) if isinstance(drafts, dict) else {spec: spec for spec in drafts}
    dq = draft_quant if isinstance(draft_quant, dict) else {name: draft_quant for name in named}
    prepack = "off" if compile else prepack
    chosen = load_target(model, dtype, max_batch, device, calibrate=quant == "none", prepack=prepack)
    target, cost, dt, prepack, why = chosen.model, chosen.cost, chosen.dtype, chosen.prepack, chosen.why
    max_len = min(max_len, int(getattr(target.model.config, "max_position_embeddings", max_len)) - KV_HEADROOM)
    drafters: dict[str, Drafter] = {}
    for name, spec in named.items():
        d = ready_drafter(make_drafter(spec, target, max_batch, max_len), spec, dq.get(name, "none"), prepack)
        if d is not None:
            drafters[name] = d
    drafters.update(extra_drafters or {})
    runner = with_prepack(quantize_runner(LlamaRunner(target.model), quant), prepack)
    if quant != "none":  # load_target measured the unquantized weights
        cost = calibrated(runner, target.name, max_batch, device)
    if compile:
        runner.compile()
    hw = hardware(device)
    profiles = matching(hw, target.name, dt, {n: s for n, s in named.items() if n in drafters}, tune_profile,
                        quant=quant)
    if profiles:
        cost = max(profiles.values(), key=lambda p: p.created_at).pass_cost
    engine = SpecEngine(runner, drafters, tokenizer=target.tokenizer,
                        eos_token_ids=target.eos_token_ids, max_batch=max_batch, max_len=max_len,
                        seq_id_base=seq_id_base, pipeline=pipeline, prefill_chunk=prefill_chunk,
                        default_gamma=default_gamma, pass_cost=cost)
    for name, prof in profiles.items():
        engine.policy.set_prior(name, prof.prior())
    engine.info.update(dtype=dt, dtype_reason=why, hardware=hw, quant=quant, prepacked=runner.prepacked,
                       cpu_paths={n: p.reason or "ok" for n, p in cpu.probes().items()} if device == "cpu"
                       else {},
                       draft_quant={n: getattr(getattr(d, "runner", None), "quant", "none")
                                    for n, d in drafters.items() if getattr(d, "runner", None) is not None},
                       tune_profiles={name: prof.path for name, prof in profiles.items()})
    engine.warm()
    return Built(engine, target, drafters, dt, why)
