"""`neuron-opt run-batch`: an OpenAI batch file (vLLM's `run-batch` format) through the engine at full batch, without
an HTTP server (neuron_opt/server/batch.py)."""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

from tqdm import tqdm

from neuron_opt.commands.serve_engine import add_engine_flags, build_engine, served_name
from neuron_opt.errors import ConfigError
from neuron_opt.server.limits import ServerLimits


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "run-batch",
        help="run an OpenAI batch file (JSONL) through a model",
        description="Run each line of an OpenAI batch file ({custom_id, method, url, body}; url /v1/chat/completions, "
        "/v1/completions or /v1/embeddings) and write one result line per input line, in order ({id, custom_id, "
        "response: {status_code, request_id, body}, error}). A bad line gets an error line. An existing output file "
        "is continued where it stops.",
    )
    add_engine_flags(p)
    p.add_argument("-i", "--input-file", required=True, type=Path, help="the batch file: one JSON request per line")
    p.add_argument("-o", "--output-file", required=True, type=Path,
                   help="where the results go; if it exists, its results are kept and the run goes on after them")
    p.set_defaults(func=run, max_waiting=1024, lora_modules=None, kv_offloading_size=None,
                   kv_offloading_disk_dir=None, kv_offloading_disk_size=None)


def run(args: argparse.Namespace) -> int:
    if bool(args.artifact) == bool(args.model):
        raise ConfigError("run-batch: give either an artifact directory or --model PATH|default (not both)")
    # the serving code needs the `serve` extra (pydantic; prometheus-client for its counters): imported here
    from neuron_opt.server.app import engine_metrics, error_payload
    from neuron_opt.server.batch import BatchRunner, input_lines, resume_from
    from neuron_opt.server.media import image_renderer
    from neuron_opt.server.reasoning import make_reasoning_parser
    from neuron_opt.server.serving import OpenAIServing
    from neuron_opt.server.tools import make_parser

    lines = input_lines(args.input_file)
    start = resume_from(args.output_file, lines)  # before loading the model: a wrong output file fails at once
    engine = build_engine(args)
    name = served_name(args)
    max_len = engine.runner.max_model_len
    serving = OpenAIServing(engine, engine.tokenizer, engine.encode_chat, name, engine_metrics(engine, name, max_len),
                            max_len, tool_parser=make_parser(args.tool_call_parser, engine.tokenizer),
                            reasoning_parser=make_reasoning_parser(args.reasoning_parser, engine.tokenizer),
                            limits=ServerLimits(), encode_image_chat=image_renderer(engine))
    window = 2 * engine.max_num_seqs  # a full batch running and as many waiting to take a freed slot
    engine.start()
    try:
        with args.output_file.open("a", encoding="utf-8") as out, tqdm(
                total=len(lines), initial=start, desc="run-batch", unit="req", file=sys.stderr) as bar:
            ok, failed = asyncio.run(BatchRunner(serving, error_payload).run(lines, start, out, window, bar.update))
    finally:
        engine.stop()
    print(f"run-batch: {ok} succeeded, {failed} failed, {start} already done; results in {args.output_file}")
    return 0
