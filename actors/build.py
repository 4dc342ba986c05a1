"""Assemble an engine from specs: a target model spec, draft specs, dtype, sizes.

Draft specs (one name space for the CLI, the bench and, later, the cluster config):
  "none"           speculation off
  "ngram[:N]"      prompt lookup with n-grams of N (default 3) down to 1 tokens; "ngram:MIN-MAX" bounds both
  "suffix[:K=V,..]" suffix decoding over the request and past outputs (drafters/suffix.py); options
                   scope=global|per_token|per_request, depth, factor, offset, min_prob, requests, mb
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

from . import cpu, native
from .calibrate import TOKENS, PassCost, calibrated, choose_dtype
from .drafters import Drafter, ModelDrafter, NgramDrafter, SuffixDrafter
from .drafters.base import KV_HEADROOM
from .engine import SpecEngine
from .hardware import hardware
from .llama import FUSED_PREFIX, PACKABLE, LlamaRunner
from .models import (
    DRAFT_HUB_FILES,
    EMBEDDED_NAME,
    LoadedModel,
    check_draft_compatible,
    gguf_source,
    is_hub_id,
    load_model,
    resolve_device,
    resolve_model_path,
    vocab_fingerprint,
)
from .schema import EXACT_CHOICES, KV_BLOCK, PREPACK_CHOICES, WEIGHTS_CHOICES
from .tune_profile import matching

# Shipped distilled drafts, by target name (LoadedModel.name), inside this package.
DEFAULT_DRAFT_ROOT = Path(__file__).parent / "default_drafts"
DEFAULT_DRAFTS = {"SmolLM2-135M-Instruct": "smollm2-eagle3"}  # smollm2-eagle: the single-layer head before it
DRAFT_META = "specd_draft.json"
log = logging.getLogger("specd")


def resolve_draft(spec: str, target_name: str = EMBEDDED_NAME) -> str:
    """'default' -> the shipped draft directory for this target; a hub id -> its snapshot in the local
    hub cache (`models.resolve_model_path`); other specs unchanged."""
    if is_hub_id(spec):
        return str(resolve_model_path(spec, DRAFT_HUB_FILES))
    if spec != "default":
        return spec
    sub = DEFAULT_DRAFTS.get(target_name)
    if sub is None or not (DEFAULT_DRAFT_ROOT / sub / DRAFT_META).exists():
        raise ValueError(f"no default draft ships for target {target_name!r} "
                         f"(defaults exist for {sorted(DEFAULT_DRAFTS)}); train one with `specd distill`")
    return str(DEFAULT_DRAFT_ROOT / sub)


def for_target(spec: str, target_name: str) -> str:
    """The spec a draft serves beside this target: 'default' is the head shipped for it, or n-gram where
    none ships (`make_drafter` logs that); other specs unchanged."""
    if spec == "default" and target_name not in DEFAULT_DRAFTS:
        return "ngram"
    return spec


def draft_meta(spec: str, target_name: str = EMBEDDED_NAME) -> dict | None:
    """The metadata of a `specd distill` checkpoint or of a published EAGLE head (kind "eagle", its
    "format": `drafters.eagle_formats.published_meta`), or None for other specs (and for a hub id not in
    reach here: loading it names what is missing)."""
    from .drafters import mtp
    if spec == mtp.SPEC:  # the target's own MTP layer: a feature head reading its final hidden state
        return dict(mtp.META)
    try:
        path = Path(resolve_draft(for_target(spec, target_name), target_name)) / DRAFT_META
    except (ValueError, FileNotFoundError):
        return None
    if not path.exists():  # a published EAGLE head: {"kind": "eagle", "format": ..., "feature_layers": ...}
        from .drafters.eagle_formats import published_meta
        return published_meta(path.parent)
    return json.loads(path.read_text())


def draft_kind(spec: str, target_name: str = EMBEDDED_NAME) -> str:
    """"ngram", "suffix", "truncated", "eagle" or "model": what a draft spec is beside this target, without
    loading it."""
    spec = for_target(spec, target_name)
    if spec == "ngram" or spec.startswith("ngram:"):
        return "ngram"
    if is_suffix(spec):
        return "suffix"
    if spec.startswith("truncated:"):
        return "truncated"
    meta = draft_meta(spec, target_name)
    return "eagle" if meta and meta.get("kind") == "eagle" else "model"


def draft_mode(spec: str, asked: str = "none") -> str:
    """The int8 mode a draft runs in: `asked`, else the one a `specd distill --qat` checkpoint
    was trained for, else "none"."""
    from .quant import check_mode

    check_mode(asked, "draft quant")
    return asked if asked != "none" else (draft_meta(spec) or {}).get("qat", "none")


def ready_drafter(drafter: Drafter | None, spec: str, quant: str = "none", layout: str = "auto",
                  gguf: Path | None = None) -> Drafter | None:
    """A drafter as it serves: in its int8 mode (`draft_mode`), then, for whatever int8 left
    dense, in the target's layout: prepacked or not (`with_prepack`), or, beside a native target,
    native where its weights are the target's (a truncated self-draft: the same int4 matrices) and
    prepacked where this CPU runs it otherwise. Drafters without weights pass through."""
    from .quant import quantize_drafter

    if drafter is None:
        return None
    mode = draft_mode(spec, quant)
    drafter = quantize_drafter(drafter, mode)
    if getattr(drafter, "runner", None) is not None:
        if layout == "native" and spec.startswith("truncated:") and mode == "none":
            native.apply(drafter.runner, gguf)
        else:
            with_prepack(drafter.runner, "auto" if layout == "native" else layout)
    return drafter


def spec_feature_layers(spec: str, target_name: str = EMBEDDED_NAME) -> tuple[int, ...]:
    """The target features a draft reads beside this target (`Drafter.feature_layers`): empty unless
    it is a feature-level head (single-layer heads from before fused features read the final state)."""
    meta = draft_meta(spec, target_name)
    if not (meta and meta.get("kind") == "eagle"):
        return ()
    if meta.get("feature_layers", [-1]) is None:  # a published EAGLE-3 head reading the default layers
        raise ValueError(f"draft {spec!r}: its target layers depend on the target; pin them "
                         "(eagle_aux_hidden_state_layer_ids in its config.json) to serve it remotely")
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


def is_suffix(spec: str) -> bool:
    return spec == "suffix" or spec.startswith("suffix:")


SUFFIX_OPTIONS = {"scope": ("scope", str), "depth": ("max_depth", int), "factor": ("max_spec_factor", float),
                  "offset": ("max_spec_offset", float), "min_prob": ("min_token_prob", float),
                  "requests": ("max_cached_requests", int), "mb": ("max_cache_bytes", lambda v: int(float(v) * 2 ** 20))}


def suffix_drafter(spec: str) -> SuffixDrafter:
    """"suffix" or "suffix:K=V,...", K among SUFFIX_OPTIONS (e.g. "suffix:scope=per_token,factor=2,mb=32")."""
    kw = {}
    for item in filter(None, spec.partition(":")[2].split(",")):
        k, eq, v = item.partition("=")
        if not eq or k not in SUFFIX_OPTIONS:
            raise ValueError(f"draft {spec!r}: options are K=V with K one of {sorted(SUFFIX_OPTIONS)}, got {item!r}")
        name, conv = SUFFIX_OPTIONS[k]
        try:
            kw[name] = conv(v)
        except ValueError:
            raise ValueError(f"draft {spec!r}: {k} needs a number, got {v!r}") from None
    return SuffixDrafter(**kw)


def make_drafter(spec: str, target: LoadedModel, max_batch: int, max_len: int,
                 dtype: str | torch.dtype | None = None) -> Drafter | None:
    if spec in ("none", "", None):
        return None
    if spec == "ngram" or spec.startswith("ngram:"):
        return ngram_drafter(spec)
    if is_suffix(spec):
        return suffix_drafter(spec)
    if spec.startswith("truncated:"):
        try:
            k = int(spec.split(":", 1)[1])
        except ValueError:
            raise ValueError(f"draft {spec!r}: truncated:K needs an integer K") from None
        d = ModelDrafter.truncated(target.model, k, max_batch=max_batch, max_len=max_len)
        return d
    if spec == "mtp":
        from .drafters.mtp import load_mtp
        return load_mtp(target, max_batch, max_len)
    if for_target(spec, target.name) != spec:  # 'default' where no head ships: e.g. the shipped config, another model
        log.warning("specd: no default draft ships for target %r: draft 'default' drafts n-grams instead "
                    "(train a head with `specd distill`)", target.name)
        return NgramDrafter()
    path = resolve_draft(spec, target.name)
    if (Path(path) / DRAFT_META).exists():
        return load_distilled(path, target, max_batch, max_len)
    from .drafters.eagle_formats import load_published, published_format
    if published_format(path):
        return load_published(path, target, max_batch, max_len)
    draft = load_model(spec, dtype or next(target.model.parameters()).dtype)
    check_draft_compatible(target, draft)
    return ModelDrafter(LlamaRunner(draft.model), spec, max_batch=max_batch, max_len=max_len)


def tensor_bytes(tensors, seen: set) -> int:
    """Bytes held by `tensors` not in `seen` (storages counted once: a fused weight and the views of
    it, a truncated draft's layers shared with the target; a torchao weight by its inner tensors)."""
    total = 0
    for t in tensors:
        if isinstance(t, native.NativeWeight):
            total += tensor_bytes(t.tensors(), seen)
            continue
        if not isinstance(t, torch.Tensor):
            continue
        if type(t) is not torch.Tensor and hasattr(t, "__tensor_flatten__"):
            names, _ = t.__tensor_flatten__()
            total += tensor_bytes([getattr(t, n) for n in names], seen)
            continue
        key = id(t) if t.is_mkldnn or t.device.type == "meta" else t.untyped_storage().data_ptr()
        if key in seen:
            continue
        seen.add(key)
        total += t.numel() * t.element_size() if t.is_mkldnn else t.untyped_storage().nbytes()
    return total


def _runner_tensors(runner: LlamaRunner) -> list:
    """Every tensor a runner holds (MoE experts and MLA projections through `weights`: gpt-oss's experts
    and prepacked ones are copies of the model's)."""
    return [runner.embed, runner.norm, runner.lm_head] + [v for w in runner.layers for v in vars(w).values()] + \
        [t for wb in runner.weights() for t in wb if t is not None]


def kv_budget(kv_memory: int | float | None, device) -> int | None:
    """KV bytes from a setting: bytes as given (an int, or a float above 1), or a fraction (0, 1] of the
    memory free now: the device's on a GPU, the machine's available memory on a CPU."""
    if kv_memory is None or kv_memory > 1:
        return None if kv_memory is None else int(kv_memory)
    if kv_memory <= 0:
        raise ValueError(f"kv_memory must be bytes or a fraction in (0, 1], got {kv_memory}")
    device = torch.device(device)
    if device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0]
    else:
        import psutil

        free = psutil.virtual_memory().available
    return int(free * kv_memory)


def memory_report(hf_model, runner: LlamaRunner, cache, drafters: dict[str, Drafter]) -> dict[str, dict[str, int]]:
    """Bytes per part: the target's weights (its model's parameters and any prepacked copies) and KV
    cache; each draft's own weights (what it does not share with the target), its KV cache and
    other state (e.g. a feature head's buffer of target features)."""
    seen: set = set()
    out = {"target": {"weights": tensor_bytes([*hf_model.parameters(), *_runner_tensors(runner)], seen),
                      "kv": tensor_bytes([cache.k, cache.v], seen)}}
    for name, d in drafters.items():
        r = getattr(d, "runner", None)
        c = getattr(d, "cache", None)
        weights = tensor_bytes(_runner_tensors(r), seen) if isinstance(r, LlamaRunner) else 0
        kv = tensor_bytes([c.k, c.v], seen) if c is not None and hasattr(c, "k") else 0
        other = tensor_bytes(vars(d).values(), seen)
        out[name] = {"weights": weights, "kv": kv, "other": other}
    return out


def memory_line(report: dict[str, dict[str, int]]) -> str:
    mb = lambda n: f"{n / 2**20:.1f} MiB"  # noqa: E731
    return "; ".join(f"{part}: " + ", ".join(f"{k} {mb(v)}" for k, v in sizes.items() if v or k != "other")
                     for part, sizes in report.items())


@dataclass
class Built:
    engine: SpecEngine
    target: LoadedModel
    drafters: dict[str, Drafter]
    dtype: str  # what the target runs in ("bf16" or "fp32"), chosen when "auto" was asked for
    dtype_reason: str


DTYPE_CHOICES = ("auto", "bf16", "fp32")
_TORCH_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}  # fp16: a GPU without bf16
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


def with_layout(runner: LlamaRunner, layout: str, gguf: Path | None = None) -> LlamaRunner:
    """`runner` in a layout `load_target` chose: "native" (the GGUF's own blocks, `native.apply`;
    `gguf` is the file), else the prepack setting (`with_prepack`)."""
    if layout == "native":
        return native.apply(runner, gguf)
    return with_prepack(runner, layout)


@dataclass
class Target:
    """The target as `load_target` chose to run it."""
    model: LoadedModel
    cost: PassCost | None  # its calibrated pass cost, as it runs (None: not calibrated)
    dtype: str  # "bf16" or "fp32"
    layout: str  # "on" or "off" (prepacked or not), or "native": what its runner and the model drafts take
    why: str  # the choice and the measurements behind it, and the CPU paths this machine lacks
    gguf: Path | None = None  # the file native weights come from (a GGUF-born target)
    # the runner the cost was measured on: held so that its native int4 matrices (`native._BUILT`, weakly
    # cached) are still there when `build_engine` lays out its own runner over the same weights
    runner: LlamaRunner | None = None


def _layouts(dtype: str, prepack: str, on_cpu: bool, native_ok: bool = False) -> list[str]:
    """The weight layouts `load_target` may run a dtype in. Under "auto": bf16 prepacked wherever it
    runs (the kernel a plain bf16 matmul runs, minus the per-call reorder: bit-identical and never
    slower), fp32 both ways where prepacked fp32 runs (oneDNN's kernel against MKL's: measured);
    with native_ok, bf16 native too (measured against them)."""
    native = ["native"] if native_ok and dtype == "bf16" else []
    if not on_cpu or prepack == "off":
        return ["off"] + native
    path = PACKABLE[_TORCH_DTYPES[dtype]]
    if prepack == "on":
        _require_prepack(dtype)
        return ["on"] + native
    if not cpu.available(path):
        return ["off"] + native
    return (["on"] if dtype == "bf16" else ["on", "off"]) + native


def _native_weights(weights: str, model: str, dtype: str, on_cpu: bool) -> Path | None:
    """The GGUF file native weights would come from, where the `weights` setting and this machine
    allow them (`native.py`): a GGUF-born model on a CPU that runs ATen's int4 kernel, in bf16.
    weights "native" is refused here, naming why, where they cannot run."""
    if weights not in WEIGHTS_CHOICES:
        raise ValueError(f"weights must be one of {list(WEIGHTS_CHOICES)}, got {weights!r}")
    if weights == "dense":
        return None
    gguf = gguf_source(model)
    if weights == "native":
        if gguf is None:
            raise ValueError(f"weights: native needs a GGUF-born model; {model!r} was not loaded from GGUF blocks. "
                             f"Set weights: auto or dense instead.")
        if not on_cpu:
            raise ValueError("weights: native runs CPU kernels (the block kernel or ATen's int4); set weights: auto or dense on a GPU")
        if dtype == "fp32":
            raise ValueError("weights: native computes with bf16 activations; set dtype: auto or bf16 with it")
        if not native.runs_here():
            cpu.require("block-kernel", "weights: native", "weights: auto or dense")  # names why not
        return gguf
    return gguf if on_cpu and dtype != "fp32" and native.runs_here() else None


def _require_prepack(dtype: str) -> None:
    cpu.require(PACKABLE[_TORCH_DTYPES[dtype]], f"prepack: on (dtype {dtype})",
                "prepack: auto or off" + (", or dtype: fp32" if dtype == "bf16" else ""))


def with_exact(runner: LlamaRunner, exact: str = "auto") -> LlamaRunner:
    """The runner with row-invariant passes (`LlamaRunner.make_exact`) as the `exact` setting says:
    "require" always (a linear whose rows agree only one at a time is then called one row at a
    time); "auto" where that costs little: not on a GPU (no row-invariant attention kernel there yet:
    one SDPA call per query row would be the price), not with torch.compile, and not where a
    linear's probe leaves row-by-row calls; "off" never. `runner.exact_why` says which, and why."""
    if exact not in EXACT_CHOICES:
        raise ValueError(f"exact must be one of {list(EXACT_CHOICES)}, got {exact!r}")
    if exact == "off":
        runner.exact_why = "exact: off (the kernels' own order; greedy output may part at near-ties)"
        return runner
    if runner.compiled:
        if exact == "require":
            raise ValueError("exact: require is not combined with compile (Inductor's kernels choose their own order)")
        runner.exact_why = "compile: Inductor's kernels choose their own reduction order"
        return runner
    if runner.device.type != "cpu" and exact == "auto":
        runner.exact_why = (f"{runner.device.type}: no row-invariant attention kernel for this device yet "
                            f"(exact: require runs one SDPA call per query row)")
        return runner
    runner.make_exact()
    costly = sorted({f"{tuple(k[3])} {p.label()}" for k, p in runner.plans.items() if not p.cheap})
    if costly and exact == "auto":
        runner.exact = False
        runner.exact_why = (f"auto: these linears' rows agree with the row alone only one row per call here "
                            f"({'; '.join(costly)}); exact: require pays that")
        return runner
    attn = "the attention kernel" if cpu.available("attn-kernel") and runner.device.type == "cpu" else \
        f"one SDPA call per query row ({cpu.probe('attn-kernel').reason or 'not a CPU'})"
    runner.exact_why = f"exact ({exact}): {attn}; linears " + ", ".join(
        sorted({p.label() for p in runner.plans.values()}))
    return runner


def exact_info(runner: LlamaRunner) -> dict:
    """What `engine.info["exact"]`, GetStats and `specd generate --json` report."""
    return {"exact": runner.exact, "why": runner.exact_why,
            "linears": {f"{k[2]} {tuple(k[3])}".replace("torch.", ""): p.label() for k, p in runner.plans.items()}}


def exact_option(options: list[tuple[str, str]]) -> tuple[tuple[str, str], str]:
    """The (dtype, layout) exact passes run, chosen by rule from what this CPU runs, never by a
    timing: timings change with the batch, the threads and the machine's load, and numerics must
    not (the same greedy request gets the same tokens in-process and served). Native GGUF blocks
    where offered (fewest bytes per token); else bf16 where this CPU has oneDNN's bf16 kernels;
    else fp32; prepacked before plain."""
    def first(dt: str):
        return next((o for o in options if o[0] == dt and o[1] == "on"), None) or \
            next((o for o in options if o[0] == dt), None)
    if ("bf16", "native") in options:
        return ("bf16", "native"), "native GGUF blocks"
    if first("bf16") and (cpu.onednn_bf16() or not first("fp32")):
        return first("bf16"), "bf16 runs oneDNN's kernels here" if cpu.onednn_bf16() else "the only dtype offered"
    o = first("fp32") or options[0]
    return o, "this CPU has no oneDNN bf16 kernels" if first("bf16") else "the only dtype offered"


def load_target(model: str, dtype: str, max_batch: int, device: str = "cpu", calibrate: bool = True,
                decode_only: bool = False, prepack: str = "auto", weights: str = "auto",
                exact: str = "auto") -> Target:
    """The target in the dtype and weight layout it runs fastest in here, with its calibrated pass
    cost. Each (dtype, layout) this CPU can run (`cpu.probe`) and the settings allow is measured
    (cached per hardware and model, see calibrate.py); the one that decodes fastest per token at
    `max_batch` rows is kept. dtype "auto" weighs bf16 and fp32 on a CPU (on a GPU it is bf16, or
    fp16 where bf16 is not supported, unmeasured); prepack "auto" takes or weighs the prepacked
    layout (`_layouts`). The full model is loaded once: options are timed on slices of it
    (`_slice_costs`), and the choice alone is calibrated in full. Never an int8 (torchao) target;
    native weights are the GGUF's own blocks, rounded as bf16 is (`native.py`).
    weights "auto" weighs a GGUF-born model's native weights too (`_native_weights`), "native"
    takes them, "dense" never. With exact passes (`with_exact`; exact not "off") nothing is weighed:
    `exact_option` chooses, so that the numerics never depend on max_batch, threads or load.
    An explicit setting the CPU cannot run (dtype bf16, prepack on, weights native) fails here with
    a message naming what is missing. calibrate=False (a quantized target, calibrated as quantized
    by the caller): no measurement, the first option (bf16 before fp32, prepacked before plain).
    decode_only: time one-token passes only (a draft replica)."""
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
    dtypes = [dtype] if dtype != "auto" else auto_dtypes(on_cpu)
    gguf = _native_weights(weights, model, dtype, on_cpu) if calibrate or weights == "native" else None
    options = [(dt, lay) for dt in dtypes for lay in _layouts(dt, prepack, on_cpu, gguf is not None)]
    if weights == "native":
        options = [("bf16", "native")]
    note = f"; unavailable here: {missing}" if missing else ""
    if not calibrate:
        dt, lay = options[0]
        return Target(load_model(model, dt, device), None, dt, lay,
                      f"{_label((dt, lay))}: not measured (a quantized target is calibrated as it runs){note}", gguf)
    if len(options) == 1:
        (dt, lay), = options
        t = load_model(model, dt, device)
        why = f"{_label((dt, lay))}: " + ("as configured" if (dtype, prepack) == (dt, lay) or weights == "native"
                                          else "on a GPU, auto is bf16 (fp16 where bf16 is not supported)"
                                          if not on_cpu else "the only option these settings leave here")
    elif exact != "off":
        (dt, lay), rule = exact_option(options)
        t = load_model(model, dt, device)
        why = f"{_label((dt, lay))}: chosen by rule for exact passes ({rule}), not by timing"
    else:
        # Loaded in the dtype its checkpoint holds where that is an option (exact either way: a bf16
        # checkpoint upcasts exactly, an fp32 one rounds as loading it in bf16 would), else fp32.
        base = _stored_dtype(model)
        t = load_model(model, base if base in dtypes else "fp32", device)
        costs = _slice_costs(t, options, max_batch, device, tokens, gguf)
        (dt, lay), why = choose_dtype(costs, max_batch, _label)
        if len(t.model.model.layers) > SLICE_LAYERS[-1]:
            why += f" (extrapolated from {SLICE_LAYERS[0]}- and {SLICE_LAYERS[-1]}-layer slices)"
        if _TORCH_DTYPES[dt] != next(t.model.parameters()).dtype:
            with torch.no_grad():  # in place, parameters only (RoPE's inv_freq buffers stay fp32, as loaded)
                for p in t.model.parameters():
                    p.data = p.data.to(_TORCH_DTYPES[dt])
            for m in t.model.modules():  # the slices' runners fused some layers' weights in the old dtype
                for key in [k for k in m.__dict__ if k.startswith(FUSED_PREFIX)]:
                    del m.__dict__[key]
    runner = with_exact(with_layout(LlamaRunner(t.model), lay, gguf), exact)
    cost = calibrated(runner, t.name, max_batch, device, tokens=tokens)
    return Target(t, cost, dt, lay, why + note, gguf, runner)


def auto_dtypes(on_cpu: bool) -> list[str]:
    """What dtype "auto" weighs: bf16 and fp32 on a CPU (fp32 alone where bf16 does not run); on a
    GPU bf16 alone, or fp16 where the GPU has no bf16 (no fp32 copy is ever loaded there)."""
    if not on_cpu:
        return ["bf16" if torch.cuda.is_bf16_supported() else "fp16"]
    return ["bf16", "fp32"] if cpu.available("bf16") else ["fp32"]


SLICE_LAYERS = (2, 4)  # `_slice_costs` times these many first layers (+ embedding, final norm, LM head)


def _slice_costs(t: LoadedModel, options: list[tuple[str, str]], max_batch: int, device: str,
                 tokens: tuple[int, ...], gguf: Path | None = None) -> dict[tuple[str, str], PassCost]:
    """Each (dtype, layout)'s pass cost of the whole model, estimated without a second full copy:
    runners over its first 2 and 4 layers (and its LM head), in the option's dtype (a copy of those
    layers alone where it is not the loaded one), extrapolated per point by the cost of a layer
    (half the 4-layer minus the 2-layer cost). A model of at most 4 layers is timed whole."""
    lo, hi = SLICE_LAYERS
    n_layers = len(t.model.model.layers)
    loaded = next(t.model.parameters()).dtype
    costs = {}
    for dt, lay in options:
        if n_layers <= hi:
            src = t.model if _TORCH_DTYPES[dt] == loaded else _slice(t.model, n_layers, _TORCH_DTYPES[dt])
            costs[dt, lay] = calibrated(with_layout(LlamaRunner(src), lay, gguf), t.name, max_batch, device,
                                        tokens=tokens)
            continue
        src = t.model if _TORCH_DTYPES[dt] == loaded else _slice(t.model, hi, _TORCH_DTYPES[dt])
        c_lo, c_hi = (calibrated(with_layout(LlamaRunner(src, num_layers=k), lay, gguf), t.name, max_batch,
                                 device, tokens=tokens) for k in (lo, hi))
        per_layer = {k: max(c_hi.points[k] - c_lo.points[k], 0.0) / (hi - lo) for k in c_hi.points}
        costs[dt, lay] = PassCost({k: c_hi.points[k] + (n_layers - hi) * per_layer[k] for k in c_hi.points},
                                  c_hi.dtype, {"slices": [c_lo.meta, c_hi.meta], "layers": n_layers})
    return costs


def _slice(model, layers: int, dtype: torch.dtype):
    """A copy of `model`'s first `layers` decoder layers, embedding, final norm and LM head in
    `dtype` (a model of the same class; its buffers, e.g. RoPE tables, shared)."""
    import copy

    cfg = copy.deepcopy(model.config)
    cfg.num_hidden_layers = layers
    if getattr(cfg, "layer_types", None):
        cfg.layer_types = cfg.layer_types[:layers]
    with torch.device("meta"):
        part = type(model)(cfg)
    keep = {f"model.layers.{i}." for i in range(layers)}
    state = {k: v.to(dtype) for k, v in model.state_dict().items()
             if not k.startswith("model.layers.") or any(k.startswith(p) for p in keep)}
    part.load_state_dict(state, assign=True, strict=False)
    for name, buf in model.named_buffers():
        owner, _, leaf = name.rpartition(".")
        if not name.startswith("model.layers.") or any(name.startswith(p) for p in keep):
            part.get_submodule(owner)._buffers[leaf] = buf
    return part.eval()


def _stored_dtype(spec: str) -> str:
    """"bf16" where the model's checkpoint holds bf16 weights (its config says so), else "fp32"."""
    from transformers import AutoConfig

    from .models import EMBEDDED, META_FILES

    if spec == EMBEDDED or spec.startswith("tiny"):
        return "fp32"  # the dequantised embedded model, random test models
    cfg = AutoConfig.from_pretrained(resolve_model_path(spec, META_FILES))
    stored = getattr(cfg, "dtype", None) or getattr(cfg, "torch_dtype", None)
    return "bf16" if str(stored).replace("torch.", "") in ("bfloat16", "bf16") else "fp32"


def _label(option: tuple[str, str]) -> str:
    """(dtype, layout) -> "fp32+prepacked", "bf16", "bf16+native", ..."""
    dtype, layout = option
    return {"on": f"{dtype}+prepacked", "native": f"{dtype}+native"}.get(layout, dtype)


def build_engine(model: str = "smollm2", drafts: list[str] | dict[str, str] = (), dtype: str = "auto",
                 max_batch: int = 8, max_len: int = 2048, device: str = "cpu",
                 extra_drafters: dict[str, Drafter] | None = None, seq_id_base: int = 0, pipeline: bool = False,
                 prefill_chunk: int = 512, default_gamma: dict[str, int | str] | None = None,
                 compile: bool = False, tune_profile: str | None = None, quant: str = "none",
                 draft_quant: str | dict[str, str] = "none", prepack: str = "auto", weights: str = "auto",
                 exact: str = "auto", kv_block: int | None = KV_BLOCK, kv_memory: int | float | None = None,
                 tp=None) -> Built:
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
    weights: a GGUF-born target's own 4-bit blocks ("native", `actors/native.py`), "dense", or
    "auto" (measured; not with quant or compile). exact: row-invariant target passes (`with_exact`:
    "auto", "require" or "off"); where on, the dtype and layout are chosen by rule (`exact_option`).
    kv_memory: the KV pool in bytes, or a fraction of the memory free once the weights are loaded
    (`kv_budget`). tp: this process's `actors.tp.Group` as rank 0 of a tensor-parallel target (its
    other ranks started, running `actors.tp.follow`): the target is this rank's shard, in dense weights
    of the given dtype, no prepacked layout. The rest as `SpecEngine` takes them."""
    from .quant import check_mode, quantize_runner

    device = resolve_device(device)
    check_mode(quant)
    named = dict(drafts) if isinstance(drafts, dict) else {spec: spec for spec in drafts}
    dq = draft_quant if isinstance(draft_quant, dict) else {name: draft_quant for name in named}
    prepack = "off" if compile else prepack
    if weights == "native" and (quant != "none" or compile):
        raise ValueError("weights: native is not combined with quant or compile (native weights are "
                         "already 4-bit, in ATen's int4 kernels)")
    weights = "dense" if compile else weights
    if exact == "require" and compile:
        raise ValueError("exact: require is not combined with compile (Inductor's kernels choose their own order)")
    if tp is not None:
        if dtype == "auto" or compile or quant != "none":
            raise ValueError("a tensor-parallel target takes an explicit dtype (every rank loads it so), "
                             "and neither compile nor quant")
        prepack, weights = "off", "dense"
    chosen = load_target(model, dtype, max_batch, device, calibrate=quant == "none", prepack=prepack,
                         weights=weights, exact="off" if compile else exact)
    target, cost, dt, layout, why = chosen.model, chosen.cost, chosen.dtype, chosen.layout, chosen.why
    runner = LlamaRunner(target.model)  # a longrope model serves fewer positions than its config says
    if tp is not None:
        from .tp import shard

        runner = shard(runner, tp)
        why += f"; tensor-parallel rank 0 of {tp.world}"
    max_len = min(max_len, runner.max_position - KV_HEADROOM)
    drafters: dict[str, Drafter] = {}
    for name, spec in named.items():
        d = ready_drafter(make_drafter(spec, target, max_batch, max_len), spec, dq.get(name, "none"), layout,
                          chosen.gguf)
        if d is not None:
            drafters[name] = d
    drafters.update(extra_drafters or {})
    runner = with_layout(quantize_runner(runner, quant), layout, chosen.gguf)
    if compile:
        runner.compile()
    runner = with_exact(runner, exact)
    if quant != "none":  # load_target measured the unquantized weights
        cost = calibrated(runner, target.name, max_batch, device)
    hw = hardware(device)
    profiles = matching(hw, target.name, dt, {n: s for n, s in named.items() if n in drafters}, tune_profile,
                        quant=quant)
    if profiles:
        cost = max(profiles.values(), key=lambda p: p.created_at).pass_cost
    engine = SpecEngine(runner, drafters, tokenizer=target.tokenizer,
                        eos_token_ids=target.eos_token_ids, max_batch=max_batch, max_len=max_len,
                        seq_id_base=seq_id_base, pipeline=pipeline, prefill_chunk=prefill_chunk,
                        default_gamma=default_gamma, pass_cost=cost, kv_block=kv_block,
                        kv_memory=kv_budget(kv_memory, device))
    for name, prof in profiles.items():
        engine.policy.set_prior(name, prof.prior())
    engine.info.update(dtype=dt, dtype_reason=why, hardware=hw, quant=quant, prepacked=runner.prepacked,
                       exact=exact_info(runner),
                       weights="native" if runner.native else "dense",
                       cpu_paths={n: p.reason or "ok" for n, p in cpu.probes().items()} if device == "cpu"
                       else {},
                       draft_quant={n: getattr(getattr(d, "runner", None), "quant", "none")
                                    for n, d in drafters.items() if getattr(d, "runner", None) is not None},
                       tune_profiles={name: prof.path for name, prof in profiles.items()})
    engine.info["memory"] = memory_report(target.model, runner, engine.cache, drafters)
    log.info("specd: %s in %s, memory: %s", target.name, _label((dt, layout)), memory_line(engine.info["memory"]))
    engine.warm()
    return Built(engine, target, drafters, dt, why)
