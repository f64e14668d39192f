"""Any tp works for any Llama-family model: widths tp does not divide are zero-padded per rank.

`intermediate_size`, the vocabulary and the query heads are padded to a multiple of tp with zero weights (as
transformers-neuronx did for Llama-3-8B / Mistral-7B / Llama-3-70B at tp 24 on inf2.48xlarge). Checked:
- the layout and the shards of the published configurations at tp 24 (what `plan` and `compile` refused before);
- tp=3 as real rank processes (gloo) against HF on a tiny model whose MLP width (101) no tp divides;
- tp=24 as 24 ranks in one process: threads joined by torch's threaded process group (the in-process backend
  torch tests its own collectives with), running the worker's own collectives, build and logits-gather code on
  24 shards of tiny widths; the gathered logits and greedy tokens against HF.
"""

from __future__ import annotations

import queue
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tiny import load_hf

from neuron_opt.backends.base import StepInputs
from neuron_opt.buckets import BucketConfig
from neuron_opt.config import CacheConfig, ModelConfig, ParallelConfig
from neuron_opt.parallel.collectives import TorchCollectives
from neuron_opt.parallel.executor import tp_executor_from_state_dict
from neuron_opt.parallel.launcher import RankSpec, write_rank_weights
from neuron_opt.parallel.sharding import MHA, head_layout, shard_state_dict
from neuron_opt.parallel.worker import _build, _finish
from neuron_opt.runtime.generate import generate_ids
from neuron_opt.runtime.runner import DecodeRow, ModelRunner
from neuron_opt.runtime.sampling import SamplingParams

MAX_LEN = 64

MISTRAL_7B = dict(
    architectures=["MistralForCausalLM"], model_type="mistral", hidden_size=4096, intermediate_size=14336,
    num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, vocab_size=32000,
    max_position_embeddings=32768, rms_norm_eps=1e-5, rope_theta=1e6, tie_word_embeddings=False,
)
LLAMA3_70B = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=8192, intermediate_size=28672,
    num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8, vocab_size=128256,
    max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=5e5, tie_word_embeddings=False,
)


class NoTok:
    def decode(self, ids, skip_special_tokens=True):
        return ""


@pytest.mark.parametrize(
    "hf, tp, inter_local, heads",
    [(MISTRAL_7B, 24, 598, 48), (LLAMA3_70B, 24, 1195, 72), (MISTRAL_7B, 3, 4779, 33)],
)
def test_published_configs_shard_at_any_tp(hf, tp, inter_local, heads):
    """Mistral-7B (14336 = 24 x 597.3) and Llama-3-70B (28672 = 24 x 1194.7) at tp 24; tp 3 likewise."""
    cfg = ModelConfig.from_hf(hf)
    lay = head_layout(cfg, ParallelConfig(tp=tp))
    assert lay.intermediate_local == inter_local and lay.intermediate_padded >= cfg.intermediate_size
    assert lay.intermediate_padded - cfg.intermediate_size < tp  # the least padding that divides
    assert lay.n_heads == heads and lay.strategy == MHA


def test_padded_mlp_shards_are_the_weights_plus_zeros():
    torch.manual_seed(0)
    cfg = ModelConfig.from_hf({**MISTRAL_7B, "hidden_size": 8, "intermediate_size": 13, "num_hidden_layers": 1,
                                 "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 11})
    lay = head_layout(cfg, ParallelConfig(tp=3))  # 13 -> 15 features, 5 per rank
    sd = {"model.layers.0.mlp.gate_proj.weight": torch.randn(13, 8),
          "model.layers.0.mlp.up_proj.weight": torch.randn(13, 8),
          "model.layers.0.mlp.down_proj.weight": torch.randn(8, 13)}
    shards = [shard_state_dict(sd, cfg, lay, r) for r in range(3)]
    for name, dim in (("gate_proj", 0), ("up_proj", 0), ("down_proj", 1)):
        key = f"model.layers.0.mlp.{name}.weight"
        assert all(s[key].shape[dim] == 5 for s in shards)
        full = torch.cat([s[key] for s in shards], dim=dim)
        torch.testing.assert_close(full.narrow(dim, 0, 13), sd[key], rtol=0, atol=0)
        assert not full.narrow(dim, 13, 2).any()  # two zero features, on the last rank
    # the sharded MLP sums to the unsharded one
    x = torch.randn(4, 8)
    def mlp(w, x):
        g, u, d = (w[f"model.layers.0.mlp.{n}_proj.weight"] for n in ("gate", "up", "down"))
        return (torch.nn.functional.silu(x @ g.t()) * (x @ u.t())) @ d.t()
    torch.testing.assert_close(sum(mlp(s, x) for s in shards), mlp(sd, x), rtol=1e-5, atol=1e-6)


def _hf(d: Path):
    return load_hf(d)


def _buckets() -> BucketConfig:
    return BucketConfig.build(max_prompt_len=MAX_LEN, max_model_len=MAX_LEN, max_batch=2, min_prefill=16,
                              min_decode=16)


def _check_against_hf(executor, cfg: ModelConfig, hf) -> None:
    """Two prompts prefilled into two slots, 4 batched decode steps teacher-forced (logits within 1e-4), then
    16 greedy tokens identical to HF's."""
    cache = CacheConfig(max_batch=2, max_model_len=MAX_LEN)
    runner = ModelRunner(executor, _buckets(), cache, cfg.vocab_size)
    g = torch.Generator().manual_seed(5)
    prompts = (9, 4)
    seqs = [torch.randint(3, cfg.vocab_size, (n + 4,), generator=g).tolist() for n in prompts]
    with torch.no_grad():
        refs = [hf(torch.tensor([s])).logits[0] for s in seqs]
    for slot, (s, n) in enumerate(zip(seqs, prompts, strict=True)):
        torch.testing.assert_close(runner.prefill(slot, s[:n]), refs[slot][n - 1], atol=1e-4, rtol=0)
    for step in range(4):
        got = runner.decode([DecodeRow(slot, s[n + step], n + step)
                             for slot, (s, n) in enumerate(zip(seqs, prompts, strict=True))])
        for slot, n in enumerate(prompts):
            torch.testing.assert_close(got[slot], refs[slot][n + step], atol=1e-4, rtol=0)
    prompt, n = [1, 17, 42, 99, 5], 16
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                          pad_token_id=0)[0, len(prompt):].tolist()
    got = generate_ids(runner, NoTok(), prompt, SamplingParams(max_tokens=n, min_tokens=n), (2,)).token_ids
    assert got == ref


def test_tp3_rank_processes_match_hf_with_a_padded_mlp(tiny_dir, tmp_path):
    d = tiny_dir("llama-odd-mlp")
    cfg = ModelConfig.from_hf(d)
    par = ParallelConfig(tp=3)
    lay = head_layout(cfg, par)
    assert (lay.intermediate_local, lay.n_heads, lay.vocab_padded) == (34, 6, 258)  # 101->102, 4->6, 257->258
    cache = CacheConfig(max_batch=2, max_model_len=MAX_LEN)
    with tp_executor_from_state_dict(cfg, load_file(str(d / "model.safetensors")), par, cache, tmp_path) as ex:
        _check_against_hf(ex, cfg, _hf(d))


class ThreadRanks:
    """tp ranks as threads of this process, joined by torch's "threaded" process group (thread-local default
    groups, collectives through shared memory). Each thread runs the worker's code for its rank: TorchCollectives
    over the group, the rank model built from its shard file, one step, the logits gathered to rank 0."""

    def __init__(self, spec: RankSpec) -> None:
        from torch.testing._internal.distributed.multi_threaded_pg import _install_threaded_pg

        torch._C._distributed_c10d._set_thread_isolation_mode(True)  # process-group names per thread
        _install_threaded_pg()
        self.spec, self.tp = spec, spec.parallel.tp
        self.inbox = [queue.Queue() for _ in range(self.tp)]
        self.outbox: queue.Queue = queue.Queue()
        store = torch.distributed.HashStore()
        self.threads = [threading.Thread(target=self._rank, args=(r, store), daemon=True) for r in range(self.tp)]
        for t in self.threads:
            t.start()
        self._collect()

    def _rank(self, rank: int, store) -> None:
        import torch.distributed as dist

        try:
            dist.init_process_group("threaded", rank=rank, world_size=self.tp, store=store)
            comm = TorchCollectives(self.tp)
            model = _build(rank, self.spec, comm)
            shape = model.kv_shape(self.spec.cache.num_blocks, self.spec.cache.block_size)
            caches = [[torch.zeros(shape) for _ in range(self.spec.model.num_hidden_layers)] for _ in "kv"]
            self.outbox.put((rank, "ready"))
            while (msg := self.inbox[rank].get()) is not None:
                bucket, inputs = msg
                with torch.inference_mode():
                    local = model(*inputs.arrays(), caches[0], caches[1], bucket.kv_len)
                    self.outbox.put((rank, _finish(local.float(), rank, self.spec, comm, None)))
        except BaseException as e:  # surfaced by _collect instead of hanging the test
            self.outbox.put((rank, e))
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()

    def _collect(self):
        replies = dict(self.outbox.get(timeout=120) for _ in range(self.tp))
        for r, v in replies.items():
            if isinstance(v, BaseException):
                raise RuntimeError(f"rank {r} failed") from v
        return replies[0]

    def run(self, bucket, inputs: StepInputs) -> torch.Tensor:
        for q in self.inbox:
            q.put((bucket, inputs))
        return torch.from_numpy(self._collect())

    def close(self) -> None:
        from torch.testing._internal.distributed.multi_threaded_pg import _uninstall_threaded_pg

        for q in self.inbox:
            q.put(None)
        for t in self.threads:
            t.join(30)
        _uninstall_threaded_pg()
        torch._C._distributed_c10d._set_thread_isolation_mode(False)


def test_tp24_sharding_of_tiny_widths_matches_hf(tiny_dir, tmp_path):
    """inf2.48xlarge's degree: 4 query heads padded to 24 (20 zero heads), 2 KV heads expanded to one per query
    head, MLP 101 -> 120 features (5 per rank, 19 zero), vocabulary 257 -> 264."""
    d = tiny_dir("llama-odd-mlp")
    cfg = ModelConfig.from_hf(d)
    par = ParallelConfig(tp=24)
    lay = head_layout(cfg, par)
    assert (lay.n_heads, lay.n_kv_heads, lay.intermediate_local, lay.vocab_padded) == (24, 24, 5, 264)
    cache = CacheConfig(max_batch=2, max_model_len=MAX_LEN)
    write_rank_weights(load_file(str(d / "model.safetensors")), cfg, par, tmp_path)
    ranks = ThreadRanks(RankSpec(cfg, par, cache, str(tmp_path)))
    try:
        _check_against_hf(ranks, cfg, _hf(d))
    finally:
        ranks.close()
