"""Helpers the tests share: our eager runner for a checkpoint, greedy tokens from a runner and from HF, a live server
on loopback, tp ranks as threads of this process, the tp-against-HF check, and a cpu artifact with given graph bytes
(no compile)."""

from __future__ import annotations

import contextlib
import queue
import threading
from pathlib import Path

import torch

from neuron_opt.api import build_model
from neuron_opt.backends.base import StepInputs
from neuron_opt.backends.eager import EagerExecutor
from neuron_opt.buckets import BucketConfig
from neuron_opt.config import CacheConfig, ModelConfig
from neuron_opt.executors.launcher import RankSpec
from neuron_opt.executors.worker import _build, _finish
from neuron_opt.parallel.collectives import TorchCollectives
from neuron_opt.runtime.generate import generate_ids
from neuron_opt.runtime.runner import DecodeRow, ModelRunner
from neuron_opt.runtime.sampling import SamplingParams


def eager_runner(ckpt_dir: Path, max_model_len: int = 256, max_batch: int = 1, block_size: int = 32,
                 **bucket_kw) -> ModelRunner:
    from neuron_opt.checkpoint import open_checkpoint

    ck = open_checkpoint(ckpt_dir)  # an HF directory or a GGUF file
    cfg = ck.config
    sd = ck.state_dict()  # canonical: no tied lm_head, fused projections split (Phi-3)
    model = build_model(cfg, sd, max_model_len, torch.float32)
    cache = CacheConfig(max_batch=max_batch, max_model_len=max_model_len, block_size=block_size)
    buckets = BucketConfig.build(max_prompt_len=max_model_len, max_model_len=max_model_len, max_batch=max_batch,
                                 min_prefill=16, min_decode=16, **bucket_kw)
    return ModelRunner(EagerExecutor(model, cache), buckets, cache, cfg.vocab_size)


class _NoDetokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return ""


def runner_greedy(runner: ModelRunner, prompt: list[int], n: int) -> tuple[torch.Tensor, list[int]]:
    """`prompt`'s last logits on `runner` (KV slot 0) and the `n` tokens it then generates greedily (no EOS)."""
    logits = runner.prefill(0, prompt)
    out = generate_ids(runner, _NoDetokenizer(), prompt, SamplingParams(max_tokens=n, min_tokens=n), ())
    return logits, out.token_ids


def checkpoint_greedy(ck, prompt: list[int], n: int, max_len: int) -> tuple[torch.Tensor, list[int]]:
    """`runner_greedy` on our eager fp32 model of checkpoint `ck` (neuron_opt.checkpoint.Checkpoint), one sequence
    of up to `max_len` positions."""
    cache = CacheConfig(max_batch=1, max_model_len=max_len)
    buckets = BucketConfig.build(max_prompt_len=max_len, max_model_len=max_len, max_batch=1, min_prefill=16,
                                 min_decode=16)
    runner = ModelRunner(EagerExecutor(build_model(ck.config, ck.state_dict(), max_len, torch.float32), cache),
                         buckets, cache, ck.config.vocab_size)
    return runner_greedy(runner, prompt, n)


def hf_greedy(hf, prompt: list[int], n: int) -> tuple[torch.Tensor, list[int]]:
    """The HF oracle's `runner_greedy`: `prompt`'s last logits and `n` greedy tokens from HF's generate."""
    with torch.no_grad():
        logits = hf(torch.tensor([prompt])).logits[0, -1]
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                          pad_token_id=0)
    return logits, out[0, len(prompt):].tolist()


@contextlib.contextmanager
def one_thread_llm(path, batch_size: int, max_model_len: int):
    """An `LLM` of a tiny checkpoint on one torch thread (tiny models: thread barriers cost more than they save);
    the thread count is restored after."""
    from neuron_opt.api import LLM

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield LLM(path, batch_size=batch_size, max_model_len=max_model_len)
    finally:
        torch.set_num_threads(threads)


@contextlib.contextmanager
def one_thread_llms(path, max_model_len: int):
    """Two `LLM`s of a tiny checkpoint on one torch thread: batch 4 (the server's) and batch 1 (the reference)."""
    from neuron_opt.api import LLM

    with one_thread_llm(path, 4, max_model_len) as served:
        yield served, LLM(path, batch_size=1, max_model_len=max_model_len)


def run_engine(engine, requests: dict, max_steps: int = 2000) -> dict:
    """Adds `requests` ({request id: (prompt ids, SamplingParams)}) to `engine` and steps it until every one has
    finished (at most `max_steps` steps); returns each request's outputs in order."""
    outs: dict = {rid: [] for rid in requests}
    for rid, (ids, params) in requests.items():
        engine.add_request(rid, ids, params, outs[rid].append)
    for _ in range(max_steps):
        if not engine.step() and engine.num_unfinished == 0:
            break
    return outs


def assert_outputs_match_reference(outs: dict, ref, prompts: list, params: list) -> None:
    """Each request `str(i)` of `run_engine`'s outputs equals the reference loop on `prompts[i]`, `params[i]`: its
    tokens, finish reason and logprobs (1e-4)."""
    import pytest

    for i, p in enumerate(prompts):
        want = reference_generate(ref, p, params[i])
        got = outs[str(i)]
        assert [t for o in got for t in o.new_token_ids] == want.token_ids, i
        assert got[-1].finish_reason == want.finish_reason
        assert [lp.logprob for o in got for lp in o.logprobs] == pytest.approx(want.logprobs, abs=1e-4)


@contextlib.contextmanager
def live_server(llm, max_num_seqs: int, runner=None, model: str = "tiny", speculative=None, draft=None,
                max_waiting: int = 1024, **app_kw):
    """Serve `llm` on a free loopback port in a background thread; yields (base_url, engine). `app_kw`: create_app's
    keyword arguments (limits, enable_docs, api_key, ...; the image renderer is the engine's, as `serve` gives it)."""
    import socket
    import threading
    import time

    import uvicorn

    from neuron_opt.runtime.engine import Engine
    from neuron_opt.server.app import create_app
    from neuron_opt.server.media import image_renderer

    engine = Engine(
        runner or llm.runner,
        llm.tokenizer,
        llm.eos_token_ids,
        max_num_seqs=max_num_seqs,
        max_waiting=max_waiting,
        max_num_batched_tokens=64,
        speculative=speculative,
        draft=draft,
    )
    app_kw.setdefault("encode_image_chat", image_renderer(engine))  # as `serve` does: None for a text model
    app = create_app(engine, llm.tokenizer, llm.encode_chat, model, llm.runner.max_model_len, **app_kw)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}", engine
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


TP_MAX_LEN = 64


class NoTok:
    def decode(self, ids, skip_special_tokens=True):
        return ""


def _buckets() -> BucketConfig:
    return BucketConfig.build(max_prompt_len=TP_MAX_LEN, max_model_len=TP_MAX_LEN, max_batch=2, min_prefill=16,
                              min_decode=16)


def check_tp_against_hf(executor, cfg: ModelConfig, hf) -> None:
    """Two prompts prefilled into two slots, 4 batched decode steps teacher-forced (logits within 1e-4), then
    16 greedy tokens identical to HF's."""
    cache = CacheConfig(max_batch=2, max_model_len=TP_MAX_LEN)
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




def cpu_artifact_with_graphs(eager_artifact: Path, out: Path, so_bytes: bytes) -> Path:
    """A copy of an eager artifact made into a cpu one whose every graph `.so` holds `so_bytes` (the metadata beside
    each as the cpu backend writes it, no constants; hashes and digest recomputed, unsigned): the cpu backend's load
    path without a compile."""
    import json
    import shutil

    from neuron_opt.artifact import MANIFEST, manifest_digest, sha256_file
    from neuron_opt.backends.cpu.backend import FORMAT, META_SUFFIX, SUBDIR
    from neuron_opt.backends.cpu.graphs import graph_keys
    from neuron_opt.buckets import Bucket

    shutil.copytree(eager_artifact, out)
    raw = json.loads((out / MANIFEST).read_text())
    raw["backend"] = "cpu"  # options that need no C++ operator build
    raw["backend_options"] = {"decode_attention": "fused", "int8_linear": "inductor", "moe_gather": "inductor"}
    cache, graphs = raw["cache"], {}
    for key in raw["graphs"]:
        graphs[key] = []
        for gkey in graph_keys(Bucket.from_key(key)):
            rel = f"graphs/rank0/{SUBDIR}/{gkey}"
            (out / rel).parent.mkdir(parents=True, exist_ok=True)
            (out / f"{rel}.so").write_bytes(so_bytes)
            meta = {"format": FORMAT, "torch": torch.__version__, "dtype": raw["dtype"], "key": gkey,
                    "max_model_len": cache["max_model_len"], "so": f"{gkey}.so", "extern_ops": False, "constants": {},
                    "kind": "layer" if gkey.startswith("layer") else "head", "num_blocks": cache["num_blocks"],
                    "block_size": cache["block_size"]}
            (out / f"{rel}{META_SUFFIX}").write_text(json.dumps(meta))
            graphs[key] += [f"{rel}.so", f"{rel}{META_SUFFIX}"]
    raw["graphs"] = graphs
    raw["files"] = {str(p.relative_to(out)): sha256_file(p) for p in sorted(out.rglob("*"))
                    if p.is_file() and p.name != MANIFEST}
    raw["digest"] = manifest_digest(raw)
    (out / MANIFEST).write_text(json.dumps(raw))
    return out


_CLOSERS: dict[int, torch.Tensor] = {}


def _closers(tok) -> torch.Tensor:
    """Token ids of `"`, `}` and `]` (a bool mask over the vocabulary), once per tokenizer."""
    if id(tok) not in _CLOSERS:
        _CLOSERS[id(tok)] = torch.tensor([s in ('"', "}", "]") for s in tok.convert_ids_to_tokens(
            list(range(len(tok))))])
    return _CLOSERS[id(tok)]


def grammar_walk(compiler, tok, structured, seed: int, max_steps: int = 400, skip_special_tokens: bool = True) -> str:
    """A random reply `structured`'s grammar accepts, over the real tokenizer: at each step the end (with
    probability 0.3 where it may end), else a random allowed token, one that closes a string, array or object with
    probability 0.3 (so open strings do not run on for ever). Fails if the grammar allows no token or never ends."""
    import random

    import xgrammar as xgr

    closers = _closers(tok)
    eos = compiler.eos_token_ids[0]
    state = compiler.state(structured)
    rng = random.Random(seed)
    bm = xgr.allocate_token_bitmask(1, len(tok))
    ids: list[int] = []
    for _ in range(max_steps):
        state.fill(bm, 0)
        bits = ((bm[0].unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1).flatten()[:len(tok)].bool()
        assert bits.any(), "the grammar allows no token"
        can_end = bool(bits[eos])
        bits[eos] = False
        if rng.random() < 0.3 and bool((bits & closers).any()):
            bits &= closers
        pool = bits.nonzero().flatten()
        t = eos if can_end and (not len(pool) or rng.random() < 0.3) else int(pool[rng.randrange(len(pool))])
        state.accept(t)
        if state.terminated:
            return tok.decode(ids, skip_special_tokens=skip_special_tokens)
        ids.append(t)
    raise AssertionError(f"no end after {max_steps} tokens: {tok.decode(ids)!r}")


def reference_generate(llm, prompt_ids, params: SamplingParams):
    """`llm`'s prompt through the single-sequence reference loop (runtime/generate.py) on its runner, in KV slot 0:
    the oracle the engine (and so `LLM.generate_ids`) is compared against."""
    grammar = None if params.structured is None else llm.grammars.state(params.structured, params.stop_token_ids)
    return generate_ids(llm.runner, llm.tokenizer, list(prompt_ids), params, llm.eos_token_ids, grammar=grammar)


def compile_tiny_eager(tiny_dir, out: Path, sign_key=None) -> Path:
    """The tiny tokenizer checkpoint compiled for the eager backend (one prefill and one decode bucket)."""
    from neuron_opt.compiler import CompileRequest, compile_artifact

    req = CompileRequest(model=str(tiny_dir("smollm-tok")), out=out, backend="eager", max_model_len=128,
                         prefill_buckets=(16,), decode_buckets=(128,), use_cache=False, sign_key=sign_key)
    compile_artifact(req, log=lambda s: None, progress=False)
    return out


def hf_stepwise_logits(hf, ids: list[int], n: int) -> torch.Tensor:
    """HF's next-token logits the way generate computes them: the first `n` tokens in one call, then each further
    token in a call of its own over the cache. [1 + len(ids) - n, V]."""
    from transformers import DynamicCache

    cache = DynamicCache(config=hf.config)
    with torch.no_grad():
        out = [hf(torch.tensor([ids[:n]]), cache=cache, use_cache=True).logits[0, -1]]
        for t in range(n, len(ids)):
            out.append(hf(torch.tensor([[ids[t]]]), cache=cache, use_cache=True).logits[0, -1])
    return torch.stack(out)


def check_stepwise_against_hf(runner: ModelRunner, hf, batched: bool = True) -> None:
    """Against HF stepped as its generate steps (longrope, dynamic NTK: a call's frequencies follow its highest
    position). Prompts of 9 and 16 tokens (the original length is 12), 6 decode steps teacher-forced (logits within
    1e-4; `batched`: both rows in one step, so one row is on the short factors while the other is on the long
    ones), then 16 greedy tokens identical to HF's generate from a 5-token prompt (switching at position 12)."""
    from neuron_opt.runtime.generate import generate_ids
    from neuron_opt.runtime.sampling import SamplingParams

    g = torch.Generator().manual_seed(5)
    prompts, steps = (9, 16), 6
    seqs = [torch.randint(3, hf.config.vocab_size, (n + steps,), generator=g).tolist() for n in prompts]
    refs = [hf_stepwise_logits(hf, s, n) for s, n in zip(seqs, prompts, strict=True)]
    groups = [[0, 1]] if batched else [[0], [1]]
    for group in groups:
        for slot in group:
            n = prompts[slot]
            torch.testing.assert_close(runner.prefill(slot, seqs[slot][:n]), refs[slot][0], atol=1e-4, rtol=0)
        for step in range(steps):
            got = runner.decode([DecodeRow(slot, seqs[slot][prompts[slot] + step], prompts[slot] + step)
                                 for slot in group])
            for row, slot in enumerate(group):
                torch.testing.assert_close(got[row], refs[slot][step + 1], atol=1e-4, rtol=0)
    prompt, n = [1, 17, 42, 99, 5], 16
    with torch.no_grad():
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                           pad_token_id=0)[0, len(prompt):].tolist()
    assert generate_ids(runner, NoTok(), prompt, SamplingParams(max_tokens=n, min_tokens=n), (2,)).token_ids == want
