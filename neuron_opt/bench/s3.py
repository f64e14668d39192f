"""moto's S3 server on loopback, as the S3 benchmarks (`bench_cold_start.py`, `bench_chaos.py`) run it: the store
they push to and pull from, with no AWS account and nothing outside this machine."""

from __future__ import annotations

import logging
import os
from typing import Any

from neuron_opt.executors.launcher import free_port


def start_moto_server(user: str) -> tuple[Any, str]:
    """moto's S3 server on a free loopback port, with credentials `user`/`user` in this process's environment (any
    AWS endpoint or profile set there removed); returns (server, endpoint URL). Stop it with `server.stop()`."""
    from moto.server import ThreadedMotoServer  # the dev extra's moto: only the benchmarks start it

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # no line per request
    os.environ.update({"AWS_ACCESS_KEY_ID": user, "AWS_SECRET_ACCESS_KEY": user, "AWS_DEFAULT_REGION": "us-east-1"})
    for name in ("AWS_ENDPOINT_URL", "AWS_PROFILE"):
        os.environ.pop(name, None)
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    return server, f"http://127.0.0.1:{port}"
