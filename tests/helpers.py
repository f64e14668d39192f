"""Helpers the tests share: our eager runner for a checkpoint directory, a live server on loopback."""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch
from safetensors.torch import load_file

from neuron_opt.api import build_model
from neuron_opt.backends.eager import EagerExecutor
from neuron_opt.buckets import BucketConfig
from neuron_opt.config import CacheConfig, ModelConfig
from neuron_opt.runtime.runner import ModelRunner


def eager_runner(ckpt_dir: Path, max_model_len: int = 256, max_batch: int = 1, block_size: int = 32,
                 **bucket_kw) -> ModelRunner:
    cfg = ModelConfig.from_hf(ckpt_dir)
    sd = load_file(str(ckpt_dir / "model.safetensors"))
    if cfg.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    model = build_model(cfg, sd, max_model_len, torch.float32)
    cache = CacheConfig(max_batch=max_batch, max_model_len=max_model_len, block_size=block_size)
    buckets = BucketConfig.build(max_prompt_len=max_model_len, max_model_len=max_model_len, max_batch=max_batch,
                                 min_prefill=16, min_decode=16, **bucket_kw)
    return ModelRunner(EagerExecutor(model, cache), buckets, cache, cfg.vocab_size)


@contextlib.contextmanager
def live_server(llm, max_num_seqs: int, runner=None, model: str = "tiny", speculative=None):
    """Serve `llm` on a free loopback port in a background thread; yields (base_url, engine)."""
    import socket
    import threading
    import time

    import uvicorn

    from neuron_opt.runtime.engine import Engine
    from neuron_opt.server.app import create_app

    engine = Engine(
        runner or llm.runner,
        llm.tokenizer,
        llm.eos_token_ids,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=64,
        speculative=speculative,
    )
    app = create_app(engine, llm.tokenizer, llm.encode_chat, model, llm.runner.max_model_len)
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
