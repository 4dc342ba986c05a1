"""`specd`: the command line.

  specd setup                       dequantise and cache the embedded model (once)
  specd generate --local ...        decode in-process (no Ray), streaming text or --json
  specd bench --local ...           side-by-side benchmark (see specd/bench/local.py)
  specd bench --address H:P ...     benchmark a running cluster vs the in-process engine and HF
                                    (see specd/bench/cluster.py; --serve starts one first)
  specd demo                        start the cluster (local.yaml), stream a few answers through the SDK,
                                    tokens/s and α per draft, shut down (--local: in-process, no Ray)
  specd serve [--config FILE]       start Ray + the Serve app (gRPC), until Ctrl-C
  specd generate --address H:P ...  generate through a running cluster with the client SDK
  specd distill ...                 train a draft from the target (see specd/distill.py)
  specd lab [--quick]               measure the seed's claims on your target and drafts (out/lab/report.md)
  specd cost BENCH.json --rps R --tokens N
                                    $/1M tokens, J/token, replicas and latency per option and accelerator
  specd tune [--draft D ...]        measure this machine, predict the best γ per batch size, check it with a
                                    sweep, store a profile that gamma 'auto' uses (see specd/tune.py)
  specd soak [--minutes 10]         a bounded soak of a local cluster: mixed load, cancellations, deadlines;
                                    statuses, latency and replica RSS over time, KV at the end (specd/soak.py)
  specd quant [--qat-draft DIR]     int8 target and draft (torchao): pass costs, draft cost, tokens/s, α,
                                    agreement with and NLL under the unquantized target (specd/quant.py)
Commands that talk to a cluster send $SPECD_TOKEN as the bearer token when it is set.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import uuid
from pathlib import Path

from actors.schema import EXACT_CHOICES, PREPACK_CHOICES, QUANT_MODES, WEIGHTS_CHOICES
from specd.bench.peer import PEERS


def gamma_arg(value: str) -> int | str:
    """--gamma: an integer, or "auto" (the speculation policy chooses per step)."""
    if value == "auto":
        return value
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer or 'auto', got {value!r}") from None


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2", help="target: 'smollm2' (embedded), 'tiny', or a HF model dir")
    p.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp32"],
                   help="auto: measure both on this hardware at load (cached) and keep the faster")
    p.add_argument("--device", default="auto", help="auto (a GPU when there is one), cpu, cuda or cuda:N")
    p.add_argument("--compile", action="store_true", help="torch.compile the target's layer math (opt-in)")
    p.add_argument("--max-len", type=int, default=2048, help="KV cache positions per sequence")
    p.add_argument("--prepack", default="auto", choices=PREPACK_CHOICES,
                   help="CPU: weights in oneDNN's prepacked layout (auto: where this CPU runs it and it measures "
                        "faster; on: fails where it cannot run; see actors/cpu.py and SPECD_DISABLE)")
    p.add_argument("--weights", default="auto", choices=WEIGHTS_CHOICES,
                   help="a GGUF-born target (the embedded model): native keeps its own 4-bit blocks in ATen's int4 "
                        "CPU kernels, dense dequantises; auto measures both at load where this CPU runs int4")
    p.add_argument("--exact", default="auto", choices=EXACT_CHOICES,
                   help="row-invariant target passes, so that speculation never changes greedy output (bit for "
                        "bit, in every dtype): auto where they cost little, require (refuse nothing, pay what it "
                        "costs), off (the kernels' own order)")
    p.add_argument("--quant", default="none", choices=QUANT_MODES,
                   help="the target's int8 mode (torchao). LOSSY: output differs from the unquantized target")
    p.add_argument("--draft-quant", default="none", choices=QUANT_MODES,
                   help="the draft's int8 mode (lossless: the target verifies); none keeps a --qat head's own")


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="specd", description="speculative-decoding serving")
    sub = ap.add_subparsers(dest="cmd", required=True)

    sub.add_parser("setup", help="cache the embedded model as safetensors").set_defaults(func=_setup)

    g = sub.add_parser("generate", help="generate text")
    g.set_defaults(func=_generate)
    g.add_argument("--local", action="store_true", help="run the engine in-process, without Ray")
    g.add_argument("--address", help="HOST:PORT of a running `specd serve` (gRPC)")
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt")
    src.add_argument("--messages-json", help='chat messages, e.g. \'[{"role":"user","content":"hi"}]\'')
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--num-beams", type=int, default=1,
                   help="beam search with N beams (temperature 0): the output equals the target's own beam search")
    g.add_argument("--length-penalty", type=float, default=1.0, help="beam search: score / length ** this")
    g.add_argument("--early-stopping", action="store_true", help="beam search: stop once N hypotheses finished")
    g.add_argument("--draft", default="ngram", help="none | ngram[:N] | truncated:K | default | PATH")
    g.add_argument("--gamma", type=gamma_arg, default="auto",
                   help="draft tokens per step, or auto: the speculation policy chooses per step, and switches "
                        "speculation off where it does not pay (ignored with --draft none)")
    g.add_argument("--tree", type=int, default=None,
                   help="draft a token tree of at most N nodes (depth <= gamma); 0: chains; default: the policy decides")
    g.add_argument("--threshold", type=float, default=None,
                   help="confidence threshold τ: the draft stops below this probability (lossless)")
    g.add_argument("--entropy-gate", type=float, default=None,
                   help="no drafting while the target's recent entropy exceeds this many nats (lossless)")
    g.add_argument("--acceptance", default="lossless",
                   help="lossless | topk:K | typical:EPS (lossy; sampled requests only)")
    g.add_argument("--json", action="store_true", help="print one JSON object: token_ids, text, stats")
    _add_model_args(g)

    b = sub.add_parser("bench", help="benchmark speculative vs plain decoding and Hugging Face")
    b.set_defaults(func=_bench)
    b.add_argument("--local", action="store_true", help="benchmark the in-process engine")
    b.add_argument("--address", default=None,
                   help="HOST:PORT of a running cluster: benchmark it through the SDK (specd/bench/cluster.py)")
    b.add_argument("--serve", action="store_true",
                   help="start a local cluster from --config, benchmark it as with --address, shut it down")
    b.add_argument("--profile", action="store_true",
                   help="--serve: also the served profile (specd/bench/served.py): the verifier loop's time per "
                        "step and each process's CPU per token, per point, beside the in-process engine's")
    b.add_argument("--config", default=None,
                   help="cluster YAML (--serve starts it; --address reads dtype, threads and draft specs from it; "
                        "default cluster/configs/local.yaml)")
    b.add_argument("--concurrency", default=None,
                   help="--address: concurrent requests per point (default 1,4,16; --pipeline-compare: 4,8)")
    b.add_argument("--rounds", type=int, default=None,
                   help="--address: repeats of each concurrency > 1 (default 1; --pipeline-compare: 3); --local: "
                        "repeats of the whole interleaved run, tokens/s the median round's (default 1)")
    b.add_argument("--peer", default=None, choices=PEERS,
                   help="--local: also run llama.cpp (llama-cpp-python, an optional extra built on this machine) on "
                        "the same GGUF and prompts at batch 1, interleaved, and print every row × llama.cpp")
    b.add_argument("--pipeline-compare", action="store_true",
                   help="--serve/--address: pipelining on against off on one cluster and remote draft (default "
                        "truncated:4), toggled through the Verifier's Serve handle between interleaved rounds; "
                        "defaults 8 prompts, 48 tokens; writes out/bench_pipeline.json")
    b.add_argument("--overlap-compare", action="store_true",
                   help="--serve: a remote model draft (default truncated:4) overlapped, not overlapped and "
                        "co-located, against speculation off, at concurrency 1 and a fixed γ (default 4), "
                        "interleaved per prompt; defaults 8 prompts, 48 tokens, 2 rounds; writes "
                        "out/bench_overlap.json (specd/bench/overlap.py)")
    b.add_argument("--no-inprocess", action="store_true",
                   help="--address: skip the in-process engine comparison at concurrency 1")
    b.add_argument("--no-match-niceness", action="store_true",
                   help="--address on this machine: keep this process's niceness (default: match Ray's workers)")
    b.add_argument("--json", dest="json_path", default=None,
                   help="default out/bench.json (--local) or out/bench_cluster.json (--address/--serve)")
    b.add_argument("--plot", default=None, help="write a PNG bar chart here")
    b.add_argument("--prompts", default=None, help="JSONL with 'prompt' or 'messages' per line")
    b.add_argument("--max-tokens", type=int, default=None, help="default 64 (--pipeline-compare: 48)")
    b.add_argument("--draft", action="append", default=None,
                   help="drafter to compare (repeatable); default: ngram and truncated:4")
    b.add_argument("--gamma", type=int, default=None,
                   help="fixed γ of the fixed-γ configurations (default 4, --local), or the γ sent to a cluster "
                        "(default: the draft's default, auto)")
    b.add_argument("--batch-sizes", default="1,8")
    b.add_argument("--tree-budgets", default="16",
                   help="--local: also run each tree-capable draft as a token tree of these node budgets "
                        "(depth <= 6); empty: chains only")
    b.add_argument("--limit", type=int, default=None,
                   help="use only N prompts (--local: taken in turn from each kind, chat and code; else the first N)")
    b.add_argument("--no-hf", action="store_true", help="skip the Hugging Face baselines")
    b.add_argument("--no-adaptive", action="store_true", help="skip the γ=auto configurations")
    b.add_argument("--beams", default=None,
                   help="--local: only benchmark beam search at these widths (e.g. 2,4): HF beam search, this "
                        "engine's with speculation off, and with each --draft (default ngram, default); "
                        "fp32 unless --dtype; writes out/bench_beams.json")
    b.add_argument("--structured", action="store_true",
                   help="--local: only the structured-output workload (three JSON schemas, greedy) with and without "
                        "its grammar, speculation off and on per --draft (default ngram, default), at --batch-sizes; "
                        "writes out/bench_structured.json. --serve: the same through a local cluster from --config "
                        "(every draft it serves, or --draft, at --concurrency, default 1,8); writes "
                        "out/bench_structured_serve.json (specd/bench/structured.py)")
    b.add_argument("--compact-json", action="store_true",
                   help="--local --structured: the schemas without optional whitespace (vLLM's disable_any_whitespace; "
                        "more tokens forced by the grammar, drafted for free)")
    b.add_argument("--grammar-engines", action="store_true",
                   help="--local: only llguidance (the grammar backend) against xgrammar (an optional install) on the "
                        "structured workload's schemas: compile time, mask and verify-step time; writes "
                        "out/grammar_engines.json (specd/bench/grammar_engines.py)")
    b.add_argument("--agent", action="store_true",
                   help="--local: only suffix decoding against n-gram and speculation off (--draft, default ngram "
                        "and suffix; γ auto) on the agent-like multi-turn sessions, the repetitive and the chat "
                        "prompts at --batch-sizes, and the prefix cache's TTFT on long later turns; median of "
                        "--rounds (default 3); writes out/bench_agent.json (specd/bench/agent.py)")
    b.add_argument("--routing", action="store_true",
                   help="--serve: prefix-aware routing against Serve's power-of-two choices on a local cluster "
                        "with two verifier replicas (a fresh one per routing and round), the agent-like sessions at "
                        "--concurrency (default 4,16), draft --draft (default suffix); median of --rounds (default "
                        "3); writes out/bench_routing.json (specd/bench/routing.py)")
    b.add_argument("--agreement", action="store_true",
                   help="--local: only what exact passes promise: greedy output of every draft configuration (chains, "
                        "γ auto, trees, beams) against draft none and inside a batch, on --limit prompts (default 16) "
                        "× --max-tokens (default 128), and the cost of exactness against --exact off at --batch-sizes, "
                        "interleaved, best of --rounds (default 3); writes out/bench_exact.json "
                        "(specd/bench/exact.py)")
    b.add_argument("--moe", action="store_true",
                   help="--local: only a tiny mixture-of-experts target (Qwen3-MoE, 16 experts, 2 per token) beside "
                        "its dense twin: verify-pass curves at 1 and 8 rows × 1-16 tokens, and n-gram and truncated "
                        "self-drafts at γ 4 and γ auto against γ 0, median of --rounds (default 3); writes "
                        "out/bench_moe.json (specd/bench/moe.py)")
    b.add_argument("--paged", action="store_true",
                   help="--local: only the paged KV cache against the slotted one: decode at batch 1 and 8 per block "
                        "size, a mixed-length workload (64 requests, prompts 100-4,000 tokens) at equal KV memory, "
                        "and the prefix cache's TTFT on the agent sessions; median of --rounds (default 3); writes "
                        "out/bench_paged.json (specd/bench/paged.py)")
    b.add_argument("--tp", type=int, default=0, metavar="N",
                   help="--local: only the target split over N processes (tensor parallelism over gloo, ranks as Ray "
                        "actors) against one process: decode pass time at batch 1 and 8 and the share of the group's "
                        "pass spent in collectives; median of --rounds (default 3); writes out/bench_tp.json "
                        "(specd/bench/tp.py)")
    b.add_argument("--head-of-line", action="store_true",
                   help="--local: only measure the inter-token latency of 4 running streams while a 1500-token "
                        "prompt is admitted, unchunked against chunked prefill")
    _add_model_args(b)

    sv = sub.add_parser("serve", help="start the cluster (Ray Serve + gRPC and HTTP) from a config, or for a "
                                      "model with no config (--model)")
    sv.set_defaults(func=_serve)
    sv.add_argument("--config", default=None, help="cluster YAML (default: cluster/configs/local.yaml, or the "
                                                   "defaults with --model)")
    sv.add_argument("--address", default=None, help="join a running Ray cluster instead of starting one")
    sv.add_argument("--model", default=None, help="the target: a model directory, a hub id 'org/name[@revision]', "
                                                  "'smollm2' or 'tiny' (overrides the config's)")
    sv.add_argument("--draft", action="append", default=None, metavar="NAME=SPEC",
                    help="a colocated draft (repeatable; replaces the config's drafts): SPEC is ngram[:N], suffix[:K=V,..], "
                         "truncated:K, default, a directory or hub id (a draft model or an EAGLE head); NAME= "
                         "may be left out (the spec names it)")
    sv.add_argument("--speculative-config", default=None, metavar="JSON",
                    help="vLLM's speculative config, e.g. '{\"method\": \"eagle3\", \"model\": \"...\", "
                         "\"num_speculative_tokens\": 3}' (see the README's table)")
    sv.add_argument("--dtype", default=None, choices=["auto", "bf16", "fp32"])
    sv.add_argument("--device", default=None, help="auto, cpu, cuda or cuda:N")
    sv.add_argument("--served-model-name", default=None, help="the model's name to clients (default: the hub id "
                                                              "or the directory's name)")
    sv.add_argument("--grpc-port", type=int, default=None)
    sv.add_argument("--http-port", type=int, default=None)

    d = sub.add_parser("demo", help="start the cluster, stream a few answers through the SDK, print tokens/s "
                                    "and acceptance, shut down (--local: the in-process engine instead)")
    d.set_defaults(func=_demo)
    d.add_argument("--local", action="store_true", help="run the engine in-process, without Ray")
    d.add_argument("--config", default=None, help="cluster YAML (default: cluster/configs/local.yaml)")
    d.add_argument("--draft", default=None, help="draft for the streamed answers (default: the config's default "
                                                  "draft; ngram with --local)")
    d.add_argument("--gamma", type=gamma_arg, default=None,
                   help="draft tokens per step (default: each draft's default_gamma from the config; auto locally)")
    d.add_argument("--max-tokens", type=int, default=80)
    _add_model_args(d)
    from .cost import add_parser as add_cost
    from .distill import add_parser as add_distill
    from .lab import add_parser as add_lab
    from .quant import add_parser as add_quant
    from .soak import add_parser as add_soak
    from .tune import add_parser as add_tune
    add_distill(sub)
    add_cost(sub)
    add_lab(sub)
    add_tune(sub)
    add_soak(sub)
    add_quant(sub)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"specd: error: {e}", file=sys.stderr)
        return 2


def _setup(args) -> int:
    from actors import cpu
    from actors.models import ensure_embedded

    print(ensure_embedded())
    # the CPU kernels, built once for this machine (actors/kernels); without a compiler exact passes run one
    # SDPA call per query row and native weights ATen's int4 kernel instead, and this says why
    from actors import kernels

    for path, what in (("attn-kernel", "attention kernel"), ("block-kernel", "block kernel")):
        p = cpu.probe(path)
        isa = f" ({kernels.ISAS[kernels.isa_path()]})" if p.ok and path == "block-kernel" else ""
        print(f"[specd] {what}: {'built' + isa if p.ok else 'unavailable (' + p.reason + ')'}")
    return 0


def serve_config(args):
    """The cluster config `specd serve` runs: --config (else the shipped local.yaml, or with --model
    the defaults), then the flags over it. --draft replaces the drafts (colocated); the first
    becomes the default draft, or "auto" (the engine picks per request) when there are several."""
    import yaml

    from cluster.config import LOCAL_CONFIG, ClusterConfig

    path = args.config or (None if args.model else LOCAL_CONFIG)
    data = (yaml.safe_load(Path(path).read_text()) or {}) if path else {}
    for key, value in (("model", args.model), ("dtype", args.dtype), ("device", args.device),
                       ("served_model_name", args.served_model_name), ("grpc_port", args.grpc_port),
                       ("http_port", args.http_port)):
        if value is not None:
            data[key] = value
    router = data.setdefault("router", {})
    if args.draft:
        drafts = []
        for item in args.draft:
            name, _, spec = item.rpartition("=")
            drafts.append({"name": name or spec, "spec": spec, "placement": "colocated"})
        data["drafts"] = drafts
        router["default_draft"] = drafts[0]["name"] if len(drafts) == 1 else "auto"
    elif path is None and args.speculative_config is None:
        router.setdefault("default_draft", "ngram")  # the defaults' one draft
    if args.speculative_config:
        data["speculative_config"] = json.loads(args.speculative_config)
        if args.draft is None:
            data["drafts"] = []  # vLLM's config names the one draft
            router.pop("default_draft", None)
    return ClusterConfig.model_validate(data)


def _serve(args) -> int:
    from cluster import serve as S
    from specd_client import SpecdClient

    cfg = serve_config(args)
    import signal

    def _stop(*_):
        raise KeyboardInterrupt
    signal.signal(signal.SIGINT, _stop)  # also when started in the background, where SIGINT is ignored
    signal.signal(signal.SIGTERM, _stop)
    print(f"specd: starting {cfg.served_name} ({cfg.model}), drafts "
          f"{', '.join(f'{d.name}={d.spec}' for d in cfg.drafts) or 'none'} ...", flush=True)
    try:
        addr = S.start(cfg, address=args.address)
        with SpecdClient(addr, timeout=60, token=os.environ.get("SPECD_TOKEN")) as client:
            S.wait_serving(client, timeout=1800, poll=0.5)  # a large model loads for minutes
        print(f"specd serving {cfg.served_name} (application {cfg.app_name!r}); Ctrl-C stops\n"
              f"  gRPC     {addr}\n"
              f"  HTTP     http://{S.http_address()}{cfg.route_prefix.rstrip('/')}/v1  (OpenAI-compatible)\n"
              f"  metrics  {' '.join(S.metrics_endpoints())}", flush=True)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        print("shutting down ...", flush=True)
    finally:
        S.stop()
    return 0


def _generate_remote(args) -> int:
    from specd_client import SpecdClient
    from specd_client.errors import SpecdError

    messages = json.loads(args.messages_json) if args.messages_json else None
    with SpecdClient(args.address, token=os.environ.get("SPECD_TOKEN")) as client:
        kw = dict(prompt=args.prompt, messages=messages, max_tokens=args.max_tokens,
                  temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                  stop=args.stop or None, num_beams=args.num_beams, length_penalty=args.length_penalty,
                  early_stopping=args.early_stopping, draft=args.draft, gamma=0 if args.draft == "none" else args.gamma,
                  tree=args.tree, threshold=args.threshold, entropy_gate=args.entropy_gate,
                  acceptance=args.acceptance)
        try:
            if args.json:
                r = client.generate(**kw)
                print(json.dumps({"token_ids": r.token_ids, "text": r.text, "finish_reason": r.finish_reason,
                                  "stats": r.spec_stats, "coalesced": r.coalesced}))
            else:
                for chunk in client.stream(**kw):
                    print(chunk.text, end="", flush=True)
                print()
        except SpecdError as e:
            raise ValueError(str(e)) from None
    return 0


def _generate(args) -> int:
    if args.address:
        return _generate_remote(args)
    if not args.local:
        raise ValueError("give --local (in-process engine) or --address HOST:PORT (a running `specd serve`)")
    from actors.build import build_engine
    from actors.schema import Completion, Request, SamplingParams, SpeculationParams
    from actors.text import encode_prompt

    messages = json.loads(args.messages_json) if args.messages_json else None
    built = build_engine(args.model, [args.draft], args.dtype, max_batch=args.num_beams, max_len=args.max_len,
                         device=args.device, compile=args.compile, quant=args.quant, draft_quant=args.draft_quant,
                         prepack=args.prepack, weights=args.weights, exact=args.exact)
    ids = encode_prompt(built.target.tokenizer, prompt=args.prompt, messages=messages)
    if not args.json:
        print(f"[specd] target {built.dtype_reason}", file=sys.stderr)
    req = Request(uuid.uuid4().hex, ids,
                  SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                 top_k=args.top_k, seed=args.seed, stop=tuple(args.stop), num_beams=args.num_beams,
                                 length_penalty=args.length_penalty, early_stopping=args.early_stopping),
                  SpeculationParams(draft=args.draft, gamma=args.gamma if args.draft != "none" else 0, tree=args.tree,
                                    threshold=args.threshold, entropy_gate=args.entropy_gate,
                                    acceptance=args.acceptance))
    eng = built.engine
    key = eng.add_request(req)
    t0 = time.perf_counter()
    deltas = []
    while eng.has_work():
        d = eng.step().get(key)
        if d is not None:
            deltas.append(d)
            if not args.json:
                print(d.text, end="", flush=True)
    dt = time.perf_counter() - t0
    done = Completion.join(deltas)
    stats = done.stats.to_dict() | {"tokens": len(done.token_ids), "seconds": dt,
                                    "tokens_per_s": len(done.token_ids) / dt, "finish_reason": done.finish_reason}
    if args.json:
        print(json.dumps({"token_ids": done.token_ids, "text": done.text, "stats": stats, "dtype": built.dtype,
                          "prepacked": built.engine.info["prepacked"], "dtype_reason": built.dtype_reason,
                          "cpu_paths": built.engine.info["cpu_paths"], "exact": built.engine.info["exact"]}))
    else:
        print(f"\n[{stats['tokens']} tokens, {stats['tokens_per_s']:.1f} tok/s, "
              f"α={stats['acceptance_rate']:.2f}, mean accepted length {stats['mean_accepted_length']:.2f}]",
              file=sys.stderr)
    return 0


def _bench(args) -> int:
    if args.serve and args.routing:
        from .bench import routing

        return routing.main(args)
    if args.serve and args.structured:
        from .bench import structured

        return structured.main(args)
    if args.profile and not args.serve:
        raise ValueError("--profile needs --serve: it reads this machine's processes and the verifier's own "
                         "accounting through Ray")
    if args.address or args.serve:
        from .bench import cluster as bench_cluster

        args.json_path = args.json_path or ("out/bench_pipeline.json" if args.pipeline_compare else
                                            "out/bench_overlap.json" if args.overlap_compare else
                                            "out/bench_cluster.json")
        if args.overlap_compare:
            from .bench import overlap

            return overlap.main(args)
        return bench_cluster.main(args)
    if not args.local:
        raise ValueError("give --local (in-process engine), --address HOST:PORT (a running cluster) "
                         "or --serve (start one from --config)")
    from pathlib import Path

    if args.structured:
        from .bench import structured

        return structured.main(args)
    if args.grammar_engines:
        from .bench import grammar_engines

        return grammar_engines.main(args)
    if args.agent:
        from .bench import agent

        return agent.main(args)
    if args.agreement:
        from .bench import exact

        return exact.main(args)
    if args.moe:
        from .bench import moe

        return moe.main(args)
    if args.paged:
        from .bench import paged

        return paged.main(args)
    if args.tp:
        from .bench import tp

        return tp.main(args)
    args.json_path = args.json_path or "out/bench.json"
    args.gamma = 4 if args.gamma is None else args.gamma
    args.max_tokens = 64 if args.max_tokens is None else args.max_tokens

    from actors.build import draft_meta

    from .bench import local as bench

    if args.beams:
        from .bench import beams as bench_beams

        rep = bench_beams.run_beams(args.model, tuple(int(x) for x in args.beams.split(",")),
                                    tuple(args.draft or ["ngram", "default"]), args.gamma,
                                    tuple(int(x) for x in args.tree_budgets.split(",") if x),
                                    "fp32" if args.dtype == "auto" else args.dtype, args.max_tokens,
                                    args.prompts, args.limit or 8, args.device)
        text = bench_beams.render(rep)
        print(text)
        out = Path(args.json_path).with_name("bench_beams.json")
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(rep, indent=2))
        out.with_suffix(".txt").write_text(text)
        print(f"wrote {out}")
        return 0
    if args.head_of_line:
        rep = bench.head_of_line(args.model, args.dtype)
        print(json.dumps(rep, indent=2))
        Path(args.json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_path).with_name("bench_hol.json").write_text(json.dumps(rep, indent=2))
        return 0
    # Defaults: n-gram, the untrained self-draft, and the shipped distilled draft side by side.
    drafts = args.draft or ["ngram", "truncated:4"] + (["default"] if draft_meta("default") else [])
    report = bench.run_local(args.model, drafts, args.gamma, args.dtype, args.max_tokens,
                             tuple(int(x) for x in args.batch_sizes.split(",")), args.prompts, args.limit,
                             hf_baselines=not args.no_hf, adaptive=not args.no_adaptive, device=args.device,
                             trees=tuple(int(x) for x in args.tree_budgets.split(",") if x),
                             quant=args.quant, draft_quant=args.draft_quant, prepack=args.prepack,
                             weights=args.weights, peer=args.peer, rounds=args.rounds or 1, exact=args.exact)
    text = bench.render(report)
    Path(args.json_path).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json_path).write_text(json.dumps(report, indent=2))
    Path(args.json_path).with_suffix(".txt").write_text(text)
    if args.plot:
        bench.plot(report, args.plot)
    print(f"wrote {args.json_path}" + (f" and {args.plot}" if args.plot else ""))
    return 0


DEMO_QUESTIONS = [
    "What is the capital of France? Answer in one sentence.",
    "Write a Python function that returns the squares of a list of numbers.",
    "Give me two tips for staying focused while studying.",
]


def _demo(args) -> int:
    return _demo_local(args) if args.local else _demo_cluster(args)


def memory_summary(r, idle_rss: int) -> str:
    """A verifier's memory: resident bytes idle and now, against weights + its KV pool + 1 GiB."""
    gib = lambda n: f"{n / 2**30:.2f} GiB"  # noqa: E731
    bound = r.weights_bytes + r.kv_bytes_reserved + 2**30
    return (f"verifier {r.replica_id.split('#')[-1]} memory: RSS {gib(idle_rss)} idle, {gib(r.rss_bytes)} now; weights "
            f"{gib(r.weights_bytes)}, KV pool {gib(r.kv_bytes_reserved)} ({r.kv_blocks_total} blocks of "
            f"{r.kv_block_size}), KV held {gib(r.kv_bytes_used)}, {r.preemptions} preemptions; idle RSS "
            f"{'within' if idle_rss <= bound else 'ABOVE'} weights + KV pool + 1 GiB ({gib(bound)})")


def _demo_cluster(args) -> int:
    """Start the cluster from the config, stream answers through the SDK, time every draft against
    none (interleaved), one concurrent burst, then shut the cluster down."""
    import concurrent.futures as cf
    import signal

    from cluster import serve as S
    from cluster.config import LOCAL_CONFIG, ClusterConfig
    from specd_client import SpecdClient

    path = args.config or LOCAL_CONFIG
    cfg = ClusterConfig.load(path).model_copy(update={"grpc_port": 0, "http_port": 0})  # free ports: self-contained
    args.draft = args.draft or cfg.router.default_draft
    if args.draft != "none" and args.draft not in [d.name for d in cfg.drafts]:
        raise ValueError(f"--draft {args.draft!r}: {path} serves {['none', *[d.name for d in cfg.drafts]]}")

    def _stop(*_):
        raise KeyboardInterrupt
    signal.signal(signal.SIGTERM, _stop)
    print(f"[specd demo] starting the cluster from {path}: {cfg.model} ({cfg.dtype}), drafts "
          f"{', '.join(d.name for d in cfg.drafts)} ...", flush=True)
    t0 = time.perf_counter()
    try:
        addr = S.start(cfg)
        with SpecdClient(addr, timeout=300, token=os.environ.get("SPECD_TOKEN")) as client:
            S.wait_serving(client, timeout=300, poll=0.5)
            reps = client.stats().replicas
            roles = [f"{r.role} {r.replica_id.split('#')[-1]}" for r in reps]
            print(f"[specd demo] serving on grpc://{addr} after {time.perf_counter() - t0:.0f} s "
                  f"(replicas: {', '.join(roles)})", flush=True)
            idle_rss = {}
            for r in reps:
                if r.role == "verifier":
                    print(f"[specd demo] verifier on {r.hardware}\n[specd demo] target {r.dtype_reason}",
                          flush=True)
                    idle_rss[r.replica_id] = r.rss_bytes
            msgs = [[{"role": "user", "content": q}] for q in DEMO_QUESTIONS]

            gammas = {d.name: d.default_gamma for d in cfg.drafts}

            def gamma_of(draft: str) -> int | None:  # None: unset, the draft's default (auto in the config)
                g = args.gamma if args.gamma is not None else gammas.get(draft, "auto")
                return None if g == "auto" else g

            def one(i: int, draft: str, show: bool = False) -> tuple[int, float, dict | None]:
                n, stats = 0, None
                t = time.perf_counter()
                for chunk in client.stream(messages=msgs[i], max_tokens=args.max_tokens, draft=draft,
                                           gamma=0 if draft == "none" else gamma_of(draft)):
                    n += len(chunk.token_ids)
                    stats = chunk.spec_stats or stats
                    if show:
                        print(chunk.text, end="", flush=True)
                return n, time.perf_counter() - t, stats

            for i, q in enumerate(DEMO_QUESTIONS):
                print(f"\n>>> {q}\n", flush=True)
                n, dt, st = one(i, args.draft, show=True)
                acc = f", α={st['acceptance_rate']:.2f}" if st and st.get("draft_tokens") else ""
                print(f"\n[{n} tokens in {dt:.1f} s, {n / dt:.1f} tok/s, draft {args.draft}{acc}]", flush=True)

            drafts = ["none"] + [d.name for d in cfg.drafts]
            dtype = next((r.dtype for r in reps if r.role == "verifier" and r.dtype), cfg.dtype)
            import torch

            from specd.bench.cluster import InProcess
            torch.set_num_threads(cfg.verifier.torch_threads)  # this process only streams besides
            local = InProcess(cfg.model, {d.name: d.spec for d in cfg.drafts}, dtype, cfg.max_len, device=cfg.device,
                              prepack=cfg.prepack, weights=cfg.weights, exact=cfg.exact)
            local.built.engine.prefix.on = cfg.verifier.prefix_cache
            local_ids = [local.encode({"messages": m}) for m in msgs]
            local.request(local_ids[0], args.max_tokens, None, 0)  # warm-up
            print(f"\n[specd demo] timing the questions through the cluster with drafts {', '.join(drafts)}, "
                  f"and each on the same engine in this process ({cfg.verifier.torch_threads} thread, as the "
                  "verifier), interleaved ...", flush=True)
            tot = {d: [0, 0.0, 0, 0, 0] for d in drafts}  # tokens, seconds, drafted, accepted, draft steps
            here = {d: [0, 0.0] for d in drafts}  # in-process: tokens, seconds
            for i in range(len(DEMO_QUESTIONS)):
                for d in (drafts if i % 2 == 0 else drafts[::-1]):
                    n, dt, st = one(i, d)
                    st = st or {}
                    for k, v in enumerate((n, dt, st.get("draft_tokens", 0), st.get("accepted_tokens", 0),
                                           st.get("drafts", 0))):
                        tot[d][k] += v
                    g = gamma_of(d)
                    rec = local.request(local_ids[i], args.max_tokens, None if d == "none" else d,
                                        "auto" if g is None else g)
                    here[d][0] += rec["tokens"]
                    here[d][1] += rec["end"] - rec["start"]
            base = tot["none"][0] / tot["none"][1]
            placement = {d.name: d.placement for d in cfg.drafts}
            policy: dict[str, dict] = {}
            for r in client.stats().replicas:
                for name, st in r.policy.items():
                    policy.setdefault(name, st)
            for d in drafts:
                n, dt, drafted, acc, steps = tot[d]
                line = (f"  {d:>12} {placement.get(d, ''):>9}: {n / dt:6.1f} tok/s  ({n / dt / base:.2f}× no draft, "
                        f"{n / dt / (here[d][0] / here[d][1]):.2f}× in-process)")
                if d in policy:
                    line += f"  policy speculated on {policy[d]['speculated_share']:.0%} of steps"
                if drafted:
                    line += f", α={acc / drafted:.2f}, mean accepted length {1 + acc / steps:.2f}"
                print(line, flush=True)
            t = time.perf_counter()
            with cf.ThreadPoolExecutor(len(DEMO_QUESTIONS)) as ex:
                burst = list(ex.map(lambda i: one(i, args.draft), range(len(DEMO_QUESTIONS))))
            dt = time.perf_counter() - t
            n = sum(b[0] for b in burst)
            print(f"  all {len(burst)} questions at once ({args.draft}): {n / dt:.1f} tok/s in total "
                  f"(continuous batching in the verifier)", flush=True)
            for r in client.stats().replicas:
                if r.role == "verifier":
                    print("  " + memory_summary(r, idle_rss[r.replica_id]), flush=True)
    except KeyboardInterrupt:
        print("\n[specd demo] interrupted", flush=True)
    finally:
        print("[specd demo] shutting the cluster down ...", flush=True)
        S.stop()
    print("[specd demo] done", flush=True)
    return 0


def _demo_local(args) -> int:
    args.draft = args.draft or "ngram"
    from actors.build import build_engine
    from actors.schema import Request, SamplingParams, SpecStats, SpeculationParams
    from actors.text import encode_prompt

    built = build_engine(args.model, [args.draft], args.dtype, max_batch=len(DEMO_QUESTIONS), max_len=args.max_len,
                         device=args.device, compile=args.compile, quant=args.quant, draft_quant=args.draft_quant,
                         prepack=args.prepack, weights=args.weights, exact=args.exact)
    eng, tok = built.engine, built.target.tokenizer
    ids = [encode_prompt(tok, messages=[{"role": "user", "content": q}]) for q in DEMO_QUESTIONS]
    spec = None if args.draft == "none" else args.draft
    gamma = ("auto" if args.gamma is None else args.gamma) if spec else 0

    def one(i: int, draft, g: int, show: bool):
        key = eng.add_request(Request(f"demo-{i}-{g}", ids[i], SamplingParams(max_tokens=args.max_tokens),
                                      SpeculationParams(draft=draft or "none", gamma=g)))
        t0 = time.perf_counter()
        n, stats = 0, None
        while eng.has_work():
            d = eng.step().get(key)
            if d is not None:
                n += len(d.token_ids)
                stats = d.stats or stats
                if show:
                    print(d.text, end="", flush=True)
        return n, time.perf_counter() - t0, stats

    print(f"[specd demo] target SmolLM2-135M-Instruct in {built.dtype_reason}\n[specd demo] draft {args.draft}, "
          f"γ={gamma}")
    for i, q in enumerate(DEMO_QUESTIONS):
        print(f"\n>>> {q}\n", flush=True)
        one(i, spec, gamma, show=True)  # streamed for reading; also warms up
        print()
    print("\n[specd demo] timing the same questions with and without speculation, interleaved ...", flush=True)
    tot = {"spec": [0, 0.0], "base": [0, 0.0]}
    stats = SpecStats()
    for i in range(len(DEMO_QUESTIONS)):
        for name, draft, g in (("base", None, 0), ("spec", spec, gamma)):
            n, dt, st = one(i, draft, g, show=False)
            tot[name][0] += n
            tot[name][1] += dt
            if name == "spec":
                stats.add(st)
    spec_tps, base_tps = (tot[k][0] / tot[k][1] for k in ("spec", "base"))
    print(f"\nspeculative ({args.draft}, γ={gamma}): {spec_tps:.1f} tok/s | γ=0: {base_tps:.1f} tok/s | "
          f"speedup {spec_tps / base_tps:.2f}×")
    print(f"acceptance α={stats.acceptance_rate:.2f}, mean accepted length {stats.mean_accepted_length:.2f}, "
          f"per position: {' '.join(f'{a:.2f}' for a in stats.per_position())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
