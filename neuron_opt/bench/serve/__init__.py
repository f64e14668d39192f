"""Serving benchmark, like `vllm bench serve`, plus the no-engine baseline in the same run.

1. Starts `neuron-opt serve` as a subprocess on a free loopback port (artifact or --model PATH|default).
2. Sends `--num-prompts` random prompts (token ids drawn uniformly from the non-special vocabulary, exactly
   `--input-len` long) to /v1/completions, streaming, greedy, `ignore_eos` so every output has `--output-len`
   tokens; at most `--concurrency` in flight, arrivals at `--request-rate` (Poisson; inf = all at once).
3. Correctness under load (`--check-streams`, default 64): that many concurrent streams, each must arrive
   exactly once, complete, with the asked token count, and equal to the same prompt served alone
   (sequentially, same server): nothing lost, duplicated or mixed.
4. Baseline: HF transformers `generate` (greedy, same prompts, EOS disabled, fp32) serving the requests one
   after another in this process, from the same checkpoint (the default GGUF goes through transformers'
   GGUF loader), loaded and warmed up once.
5. Rounds (`--rounds`): every concurrency level on the server, then the HF baseline, again and again while the
   server stays up (idle between its loads): every figure is the median of the rounds, throughput with its min
   and max, and the ratio to HF is taken per round as well.

`--scenario peer` puts llama.cpp's own server (`llama-server`, built once from the llama.cpp that the installed
llama-cpp-python vendors) beside ours on the same weights, one pair of servers per `--pair` width: the same prompts
through the same streaming client, one server alive at a time, rounds interleaved (neuron_opt.bench.llamacpp_server
has the peer's build and configuration).

`--scenario lora` serves one `--enable-lora` artifact with random PEFT adapters made by the script on HF's model of
the same weights (loaded through /v1/load_lora_adapter, timed): the same prompts on the base model alone and as a mix
over the adapters and the base, rounds interleaved; the mixed / base throughput and TPOT ratios per level.

`--scenario image` sends one PIL-drawn image (a base64 PNG data URL) and a question per chat request to a
vision-language --model (or the random checkpoint --make-tiny-vlm writes) at each --concurrency level (default 1 and
8), against HF transformers `generate` on the same processor outputs, rounds interleaved; in fp32 every served answer
must be HF's greedy text (image.py).

Every report records the machine (CPU model, ISA flags, cores, a bandwidth probe, torch) and whether it was idle
before and during the run (neuron_opt.bench.RunRecord); `--require-idle` refuses a busy machine.

Metric definitions follow vLLM (vllm/benchmarks/serve.py): TTFT = first token chunk - send;
TPOT = (latency - TTFT) / (output tokens - 1) per request; ITL = every gap between consecutive chunks;
output throughput = output tokens / wall time of the run; request throughput = completed requests / wall time.

    python scripts/bench_serve.py --model default --num-prompts 32 --concurrency 16 --json
"""
