"""Cluster configuration: the single source of truth for local runs, Serve and Kubernetes.

One YAML file (validated here with pydantic) describes the target, the drafts, each
deployment's placement and autoscaling, and the router's limits. `specd serve`
reads it, `cluster.app:app_builder` turns it into a Serve application (so
`serve run` / `serve deploy` accept it), and the KubeRay manifest embeds it.

Placement: on real clusters a deployment asks for `num_gpus` and an
`accelerator_type` (e.g. L4 for drafts, H100 for verifiers). Locally, custom
resources stand for the accelerator pools: `small_accel` and `large_accel`,
declared when `specd serve` starts Ray.
"""
from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

import yaml
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator

from actors.schema import KV_BLOCK, MAX_GAMMA, RESERVED_DRAFTS, Limits

LOCAL_CONFIG = Path(__file__).parent / "configs" / "local.yaml"  # one machine: `specd serve`, `make demo`

# Every replica's environment, unless a deployment's `env_vars` replaces it.
# glibc malloc: few arenas (a replica's gRPC, asyncio, batcher and overlap threads each get one
# otherwise, and keep what they freed) and a fixed mmap threshold (glibc raises it after freeing a
# large block, so later tensors come from the heap and stay in RSS); in `make soak` this cut a
# verifier's RSS by about 250 MB and the draft replica's by about 400 MB.
# oneDNN's primitive cache and ideep's (PyTorch's CPU bf16/int8 matmuls): one entry per matmul
# shape, about 0.5 MB each with AMX kernels, up to 1024 per cache by default. The linears pad
# their rows to a fixed set of buckets and warm them at start (`actors.llama.linear`), so a
# replica's caches fill before its first request (~320 shapes in a verifier serving SmolLM2 and
# its head, ~290 MB) and stay so; 512 bounds them should a path the buckets miss meet new shapes.
# Serve's handles between replicas (router -> verifier, verifier -> draft) over gRPC rather than Ray
# actor calls: one of Ray Serve's own throughput settings (`RAY_SERVE_THROUGHPUT_OPTIMIZED` turns it on
# with others); `specd bench --serve` measured 16 concurrent streams at 236 -> 315 tok/s with it on a
# 2-core Xeon, and the other settings of that mode gained nothing measurable there. `cluster.serve`
# sets it for a local cluster's proxy too, k8s/Dockerfile for every KubeRay pod.
# A replica's gRPC server then takes what the Serve proxy takes (2 GiB; gRPC's default would be 4 MB),
# so an oversized request still reaches the router and gets INVALID_ARGUMENT naming its limit.
SERVE_ENV = {"RAY_SERVE_USE_GRPC_BY_DEFAULT": "1", "RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH": str(2**31 - 1)}
REPLICA_ENV = {**SERVE_ENV, "MALLOC_ARENA_MAX": "2", "MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "131072",
               "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "512", "LRU_CACHE_CAPACITY": "512"}


QuantMode = Literal["none", "int8-weight", "int8-dynamic", "mixed"]  # actors.schema.QUANT_MODES (a test checks)
PrepackChoice = Literal["auto", "on", "off"]  # actors.schema.PREPACK_CHOICES (the same test)


def _yaml_switch(v):
    """YAML 1.1 reads a plain on/off (and yes/no) as a boolean: take it as the switch it spelled."""
    return ("on" if v else "off") if isinstance(v, bool) else v


PrepackSwitch = Annotated[PrepackChoice, BeforeValidator(_yaml_switch)]  # `prepack: off` in YAML arrives as False


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Resources(_Strict):
    """What one replica asks Ray for."""
    num_cpus: float = Field(0, ge=0, description="logical CPUs; 0 lets replicas share a small machine")
    num_gpus: float = Field(0, ge=0)
    accelerator_type: str | None = Field(None, description="e.g. 'L4' (drafts) or 'H100' (verifiers)")
    custom: dict[str, float] = Field(default_factory=dict, description="e.g. {'large_accel': 1}")

    def bundle(self) -> dict:
        """The same as a placement group bundle (one per tensor-parallel rank)."""
        b = {**({"CPU": self.num_cpus} if self.num_cpus else {}), **({"GPU": self.num_gpus} if self.num_gpus else {}),
             **self.custom}
        if self.accelerator_type:
            b[f"accelerator_type:{self.accelerator_type}"] = 0.001
        return b or {"CPU": 0.001}  # a bundle asks for something

    def ray_actor_options(self) -> dict:
        opts: dict = {"num_cpus": self.num_cpus}
        if self.num_gpus:
            opts["num_gpus"] = self.num_gpus
        if self.accelerator_type:
            opts["accelerator_type"] = self.accelerator_type
        if self.custom:
            opts["resources"] = dict(self.custom)
        return opts


class Autoscaling(_Strict):
    """Ray Serve autoscaling_config for one deployment (drafts and verifiers scale independently)."""
    min_replicas: int = Field(1, ge=0)
    max_replicas: int = Field(1, ge=1)
    initial_replicas: int | None = Field(None, ge=0)
    target_ongoing_requests: float = Field(4, gt=0, description="per replica; above it Serve scales up")
    upscale_delay_s: float = Field(10, ge=0)
    downscale_delay_s: float = Field(60, ge=0)
    metrics_interval_s: float = Field(2, gt=0)
    look_back_period_s: float = Field(10, gt=0)

    @model_validator(mode="after")
    def _bounds(self):
        if self.max_replicas < self.min_replicas:
            raise ValueError(f"max_replicas ({self.max_replicas}) < min_replicas ({self.min_replicas})")
        if self.initial_replicas is not None and not self.min_replicas <= self.initial_replicas <= self.max_replicas:
            raise ValueError(f"initial_replicas ({self.initial_replicas}) must be within "
                             f"[min_replicas, max_replicas] = [{self.min_replicas}, {self.max_replicas}]")
        if self.look_back_period_s <= self.metrics_interval_s:
            raise ValueError(f"look_back_period_s ({self.look_back_period_s}) must exceed "
                             f"metrics_interval_s ({self.metrics_interval_s})")
        return self

    def serve(self) -> dict:
        return self.model_dump(exclude_none=True)


class DeploymentSpec(_Strict):
    resources: Resources = Field(default_factory=Resources)
    autoscaling: Autoscaling = Field(default_factory=Autoscaling)
    torch_threads: int = Field(1, ge=1, description="intra-op threads per replica (cores are shared)")
    graceful_shutdown_timeout_s: float = Field(30, ge=0, description="scale-down drains in-flight work")
    env_vars: dict[str, str] = Field(default_factory=lambda: dict(REPLICA_ENV),
                                     description="environment of each replica's process (Ray runtime_env); "
                                                 "the default tunes glibc malloc and bounds oneDNN's kernel "
                                                 "caches so RSS stays flat under load")


class DraftConfig(DeploymentSpec):
    """One draft. `spec` uses the engine's draft names (`actors.build`): ngram[:N] or ngram:MIN-MAX,
    suffix[:K=V,...] (scope=per_token is added when `auth` is on and the spec names no scope), truncated:K, `default` (the head shipped for the target; n-gram where none ships), or a draft
    model's or an EAGLE head's directory or hub id. `placement` says where it runs:
      colocated  inside each verifier replica, on its device: no hop. Right for n-gram (a hop
                 costs more than the lookup) and feature heads (they read the target's hidden
                 states, which would otherwise cross the network every step).
      remote     its own deployment on the small-accelerator pool (`resources`, `autoscaling`
                 apply): right for a draft model large enough to be worth its own accelerator;
                 it drafts ahead for the likely verdicts while the target verifies (`overlap`)."""
    name: str
    spec: str
    placement: Literal["colocated", "remote"] = "colocated"
    default_gamma: int | Literal["auto"] = Field("auto", description="γ when a request leaves it unset: "
                                                  "'auto' (the speculation policy) or a fixed 0..16")
    max_batch: int = Field(16, ge=1, description="sequences with draft KV per replica")
    lease_s: float = Field(600, gt=0, description="draft state nobody asked about for this long expires "
                           "(its verifier died); a live sequence that returns is re-synced")
    overlap: bool = Field(True, description="remote: draft the next block for the likeliest verdicts while "
                          "the target verifies (token-level model drafts; feature heads run colocated)")
    overlap_branches: int = Field(3, ge=1, le=16, description="verdicts prepared per block when overlapping")
    quant: QuantMode = Field("none", description="int8 mode of the draft's weights (actors/quant.py); lossless: "
                             "the target verifies every token. 'none' keeps a `specd distill --qat` head's own mode")
    grammar_masking: bool = Field(True, description="colocated model drafts: mask each chain draft step to what a "
                                  "request's grammar allows (fewer wasted proposals). The target masks its own "
                                  "logits either way, so output never depends on it")

    @property
    def remote(self) -> bool:
        return self.placement == "remote"

    @property
    def model_free(self) -> bool:
        """n-gram or suffix: drafts copied from text, no model behind them."""
        return self.spec.partition(":")[0] in ("ngram", "suffix")

    @model_validator(mode="after")
    def _gamma(self):
        if self.default_gamma != "auto" and not 0 <= self.default_gamma <= MAX_GAMMA:
            raise ValueError(f"default_gamma must be 'auto' or in [0, {MAX_GAMMA}], got {self.default_gamma}")
        if self.remote and self.model_free:
            raise ValueError(f"draft {self.name!r}: a model-free draft (n-gram, suffix) runs colocated "
                             "(a hop costs more than it saves)")
        return self


class VerifierConfig(DeploymentSpec):
    max_batch: int = Field(8, ge=1, le=256, description="sequences verified together (KV slots: cheap handles; the "
                           "KV itself is blocks from the kv_memory pool)")
    kv_block: int | None = Field(KV_BLOCK, ge=1, description="positions per KV block of the target's paged cache "
                                 "(actors/kv.py); null: one block of max_len per slot (the slotted cache)")
    tensor_parallel_size: int = Field(1, ge=1, le=64, description="processes one replica's target is split over "
                                      "(actors/tp.py): the replica is rank 0, ranks 1..N-1 are Ray actors, each "
                                      "in its own bundle of the replica's placement group (one bundle per rank, "
                                      "`resources` each); needs an explicit dtype and dense weights")
    placement_strategy: Literal["PACK", "STRICT_PACK", "SPREAD"] = Field(
        "PACK", description="the placement group's strategy with tensor_parallel_size > 1 (STRICT_PACK: one node)")
    kv_memory: float | None = Field(None, gt=0, description="the target's KV pool: bytes (> 1), or a fraction (0, 1] "
                                    "of the memory free once the weights are loaded; null: max_batch x max_len "
                                    "positions. Requests are admitted while blocks allow, the youngest preempted "
                                    "(and recomputed later) when a running batch runs out")
    pipeline: bool = Field(False, description="split sequences with remote drafts into two micro-batches and "
                           "verify one while the draft replicas propose for the other (greedy output unchanged; "
                           "VerifierServer.set_pipeline toggles it at run time)")
    compile: bool = Field(False, description="torch.compile the target's layer math (cached on disk; opt-in)")
    quant: QuantMode = Field("none", description="int8 mode of the target's weights (actors/quant.py). LOSSY: the "
                             "output differs from the unquantized target's; `specd quant` measures by how much")
    routing: Literal["prefix", "power_of_two"] = Field("prefix", description="which replica a generation goes to: "
                                                      "'prefix' (where its tenant's prompt prefix went before, while "
                                                      "loads allow: cluster.routing.PrefixRouter) or Serve's "
                                                      "power-of-two choices (also whenever autoscaling.max_replicas "
                                                      "is 1: nothing to choose)")
    prefix_imbalance: int = Field(4, ge=0, description="prefix routing: follow the prefix only while the replicas' "
                                  "queues differ by at most this many requests; else the less loaded of two")
    prefix_cache: bool = Field(True, description="keep finished sequences' KV slots on an LRU: a prompt that shares "
                               "a prefix with one starts from its KV (actors/prefix_cache.py); greedy output unchanged")
    prefill_chunk: int = Field(512, ge=1, description="prompt tokens prefilled per batcher step (chunked "
                               "prefill: running streams keep decoding while a long prompt is admitted)")
    tune_profile: str | None = Field(None, description="a `specd tune` profile file (or a directory of them) "
                                     "for this pool's accelerator: where one matches the replica's hardware, "
                                     "target, dtype and a draft, gamma 'auto' starts from its acceptance and pass "
                                     "costs instead of the load-time calibration (else the calibration is used)")


class RouterConfig(DeploymentSpec):
    max_queue: int = Field(64, ge=1, description="requests admitted (running + waiting); beyond: RESOURCE_EXHAUSTED")
    max_tokens: int = Field(512, ge=1, description="largest max_tokens a request may ask for")
    default_max_tokens: int = Field(128, ge=1)
    coalesce: bool = Field(True, description="identical in-flight requests share one generation")
    default_draft: str = Field("none", description="draft used when a request names none ('auto': the "
                               "engine picks per request among the drafts)")
    default_threshold: float = Field(0.0, ge=0, le=1, description="confidence threshold τ when a request sets "
                                     "none: drafting stops below it (0: never)")
    request_timeout_s: float | None = Field(None, gt=0, description="seconds a request may run when its caller "
                                            "gives no deadline (gRPC's deadline, HTTP's X-Request-Timeout "
                                            "header); past it the stream ends with DEADLINE_EXCEEDED (HTTP 504); "
                                            "unset: no limit")


class AuthConfig(_Strict):
    """Optional bearer-token authentication of every RPC but the health check. The tokens (one
    per line, or comma-separated; blank lines and lines starting with '#' ignored) come from a
    file or from an environment variable of the router's process; neither set = no
    authentication. Any accepted token may call every RPC; a digest of it is the caller's tenant
    (`Request.tenant`), which scopes a suffix draft's cache and coalescing."""
    tokens_file: str | None = Field(None, description="file holding the accepted tokens")
    tokens_env: str | None = Field(None, description="environment variable holding the accepted tokens")

    def tokens(self) -> list[str]:
        """The accepted tokens; ValueError when a named source is missing or holds none."""
        import os

        if self.tokens_file is None and self.tokens_env is None:
            return []
        raw = ""
        if self.tokens_file is not None:
            raw += Path(self.tokens_file).read_text() + "\n"
        if self.tokens_env is not None:
            if self.tokens_env not in os.environ:
                raise ValueError(f"auth.tokens_env: environment variable {self.tokens_env!r} is not set")
            raw += os.environ[self.tokens_env]
        toks = [t.strip() for line in raw.splitlines() if not line.strip().startswith("#")
                for t in line.split(",") if t.strip()]
        if not toks:
            raise ValueError("auth: the configured token source holds no token")
        return toks


class VllmSpeculativeConfig(_Strict):
    """vLLM's `speculative_config` (`vllm serve --speculative-config JSON`), accepted as it is and
    mapped onto one draft of this product (`draft`):

      method       draft spec                            γ (default_gamma)
      ngram        ngram:MIN-MAX (prompt_lookup_min,     num_speculative_tokens, else auto
                   _max; unset: 1 and 3)
      eagle        the head at `model` (EAGLE-1/2)       the same
      eagle3       the head at `model` (EAGLE-3)         the same
      draft_model  the draft model at `model`            the same
      mtp,         the target's own MTP layer (`--draft     the same
      deepseek_mtp mtp`, actors/drafters/mtp.py); `model`,
                   where given, is the target (vLLM's
                   older name for DeepSeek)

    The draft is named after the method and runs colocated; it becomes router.default_draft
    unless the config names another. Other vLLM keys are refused by name."""
    method: Literal["ngram", "eagle", "eagle3", "draft_model", "mtp", "deepseek_mtp"]
    model: str | None = Field(None, description="the draft's directory or hub id (every method but ngram)")
    num_speculative_tokens: int | None = Field(None, ge=0, le=MAX_GAMMA)
    prompt_lookup_max: int | None = Field(None, ge=1)
    prompt_lookup_min: int | None = Field(None, ge=1)

    @model_validator(mode="after")
    def _fields(self):
        if self.method in ("mtp", "deepseek_mtp"):
            if self.prompt_lookup_max is not None or self.prompt_lookup_min is not None:
                raise ValueError("speculative_config: prompt_lookup_min/max apply to method 'ngram' only")
        elif self.method == "ngram":
            if self.model is not None:
                raise ValueError("speculative_config: method 'ngram' takes no model")
            if self.min_n > self.max_n:
                raise ValueError(f"speculative_config: prompt_lookup_min ({self.min_n}) exceeds "
                                 f"prompt_lookup_max ({self.max_n})")
        else:
            if self.model is None:
                raise ValueError(f"speculative_config: method {self.method!r} needs a model (its path or hub id)")
            if self.prompt_lookup_max is not None or self.prompt_lookup_min is not None:
                raise ValueError("speculative_config: prompt_lookup_min/max apply to method 'ngram' only")
        return self

    @property
    def min_n(self) -> int:
        return self.prompt_lookup_min or 1

    @property
    def max_n(self) -> int:
        return self.prompt_lookup_max or max(3, self.min_n)

    def draft(self) -> dict:
        """The draft this maps to, as a `drafts:` entry."""
        mtp = self.method in ("mtp", "deepseek_mtp")
        spec = f"ngram:{self.min_n}-{self.max_n}" if self.method == "ngram" else "mtp" if mtp else self.model
        gamma = "auto" if self.num_speculative_tokens is None else self.num_speculative_tokens
        return {"name": "mtp" if mtp else self.method, "spec": spec, "placement": "colocated", "default_gamma": gamma}


class ClusterConfig(_Strict):
    app_name: str = "specd"
    route_prefix: str = Field("/", description="where Serve's HTTP proxy mounts the app: the OpenAI API at "
                              "{prefix}/v1, /health, /ping and /version under it")
    model: str = Field("smollm2", description="target: 'smollm2', 'tiny[:SEED]', a Hugging Face model directory or "
                       "a hub id 'org/name[@revision]' (from the local hub cache; HF_HUB_OFFLINE, HF_TOKEN honoured)")
    served_model_name: str | None = Field(None, description="the model's name to clients: /v1/models, ListModels "
                                          "and the metrics' model_name label (default: the hub id or the "
                                          "directory's name)")
    device: str = Field("auto", pattern=r"^(auto|cpu|cuda(:\d+)?)$",
                        description="where models run: 'auto' (a GPU when the replica sees one), 'cpu', 'cuda', "
                                    "'cuda:N'")
    dtype: Literal["auto", "bf16", "fp32"] = Field("auto", description="the target's dtype; 'auto': with exact "
                                                   "passes (exact, the default) chosen by rule from what this "
                                                   "hardware runs (actors.build.exact_option), else measured at load "
                                                   "and the faster at the verifier's max_batch kept (never a "
                                                   "quantized target)")
    prepack: PrepackSwitch = Field("auto", description="CPU: hold weights in oneDNN's prepacked layout "
                            "(actors.build.load_target); 'auto': where this CPU runs it (actors/cpu.py) and "
                            "the load-time measurement finds it faster; 'on' fails at load where it cannot run")
    weights: Literal["auto", "native", "dense"] = Field(
        "auto", description="a GGUF-born target's weights (the embedded model): 'native' keeps its own 4-bit "
        "blocks in ATen's int4 CPU layout (actors/native.py), 'dense' dequantised; 'auto' measures both at load "
        "where this CPU runs the int4 kernel (actors/cpu.py) and keeps the faster")
    exact: Literal["auto", "require", "off"] = Field(
        "auto", description="row-invariant target passes (actors/kernels, actors.build.with_exact): every row of a "
        "verify pass, a batch or a prefill chunk computes the bits its single-token pass computes, so speculation "
        "never changes greedy output and the dtype is chosen by rule, not by timing (the same numerics at any "
        "max_batch, as in-process). 'auto': where that costs little; 'require': always; 'off': never")
    max_len: int = Field(2048, ge=16, description="context (prompt + output) per sequence")
    grpc_port: int = Field(9000, ge=0, le=65535)
    http_port: int = Field(8000, ge=0, le=65535, description="Serve's HTTP proxy: the OpenAI-compatible API")
    metrics_port: int = Field(0, ge=0, le=65535, description="local `specd serve`: where Ray exports Prometheus "
                              "metrics (0: a free port, see cluster.serve.metrics_endpoints)")
    router: RouterConfig = Field(default_factory=RouterConfig)
    auth: AuthConfig = Field(default_factory=AuthConfig)
    verifier: VerifierConfig = Field(default_factory=lambda: VerifierConfig(
        resources=Resources(custom={"large_accel": 1})))
    drafts: list[DraftConfig] = Field(default_factory=lambda: [DraftConfig(name="ngram", spec="ngram")])

    @model_validator(mode="before")
    @classmethod
    def _vllm(cls, data):
        """`speculative_config:` (vLLM's) becomes a draft (`VllmSpeculativeConfig`), and the default
        draft unless router.default_draft names one; a config that also lists `drafts` keeps them."""
        if not isinstance(data, dict) or data.get("speculative_config") is None:
            return data
        data = dict(data)
        draft = VllmSpeculativeConfig.model_validate(data.pop("speculative_config")).draft()
        data["drafts"] = [*data.get("drafts", []), draft]
        router = dict(data.get("router") or {})
        router.setdefault("default_draft", draft["name"])
        data["router"] = router
        return data

    @model_validator(mode="after")
    def _check(self):
        names = [d.name for d in self.drafts]
        if len(set(names)) != len(names):
            raise ValueError(f"draft names must be unique, got {names}")
        for r in RESERVED_DRAFTS:
            if r in names:
                raise ValueError(f"draft name {r!r} is reserved")
        if self.router.default_draft not in (*RESERVED_DRAFTS, *names):
            raise ValueError(f"router.default_draft {self.router.default_draft!r} is not one of "
                             f"{[*RESERVED_DRAFTS, *names]}")
        if self.auth.tokens_file is not None or self.auth.tokens_env is not None:
            for d in self.drafts:  # one tenant's outputs never shape another's drafts unless asked
                if d.spec.partition(":")[0] == "suffix" and "scope=" not in d.spec:
                    d.spec += ("," if ":" in d.spec else ":") + "scope=per_token"
        if self.router.default_max_tokens > self.router.max_tokens:
            raise ValueError("router.default_max_tokens exceeds router.max_tokens")
        if self.router.max_tokens >= self.max_len:
            raise ValueError(f"router.max_tokens ({self.router.max_tokens}) must be below max_len ({self.max_len})")
        if self.weights == "native" and (self.verifier.quant != "none" or self.verifier.compile or self.dtype == "fp32"):
            raise ValueError("weights: native (4-bit GGUF blocks, bf16 activations) is not combined with "
                             "verifier.quant, verifier.compile or dtype: fp32")
        v = self.verifier
        if v.tensor_parallel_size > 1 and (self.dtype == "auto" or self.weights == "native" or v.quant != "none"
                                           or v.compile or self.prepack == "on"):
            raise ValueError(f"verifier.tensor_parallel_size {v.tensor_parallel_size} shards dense weights that every "
                             "rank loads alike: set dtype (bf16 or fp32), weights other than native, prepack other "
                             "than on, no verifier.quant or compile")
        return self

    @property
    def served_name(self) -> str:
        from actors.models import default_served_name

        return self.served_model_name or default_served_name(self.model)

    def limits(self) -> Limits:
        """What the router admits (the request schema's limits)."""
        names = {d.name for d in self.drafts}
        specs = [d.spec for d in self.drafts]
        return Limits(context=self.max_len, max_tokens=self.router.max_tokens,
                      drafts={d.name: d.default_gamma for d in self.drafts},
                      # a request may also name a draft by the spec it serves, where one draft serves it
                      aliases={d.spec: d.name for d in self.drafts if d.spec not in names
                               and d.spec not in RESERVED_DRAFTS and specs.count(d.spec) == 1},
                      default_draft=self.router.default_draft, default_max_tokens=self.router.default_max_tokens,
                      default_threshold=self.router.default_threshold, max_beams=self.verifier.max_batch)

    def draft(self, name: str) -> DraftConfig:
        for d in self.drafts:
            if d.name == name:
                return d
        raise KeyError(name)

    @classmethod
    def load(cls, path: str | Path | None) -> "ClusterConfig":
        if path is None:
            return cls()
        data = yaml.safe_load(Path(path).read_text()) or {}
        return cls.model_validate(data)

    def dump(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)


def draft_deployment_name(draft: str) -> str:
    """The Serve deployment of a remote draft, by the draft's name in the config."""
    return f"Draft-{draft.replace(':', '-').replace('/', '_')}"
