"""Every exception that crosses a boundary (CLI, config, HTTP, artifact, kernel arguments).

Each names what is wrong and, where there is one, the flag or file that fixes it.
"""

from __future__ import annotations


class NeuronOptError(Exception):
    """Base class of all neuron_opt errors.

    Args:
        param: the request parameter at fault, when there is one (e.g. "max_tokens"), set where the error is
            raised; the HTTP server reports it as the OpenAI error's `param` (never inferred from the message).
    """

    def __init__(self, *args: object, param: str | None = None) -> None:
        super().__init__(*args)
        self.param = param


class ConfigError(NeuronOptError, ValueError):
    """A configuration value is invalid; the message names the field."""


class UnsupportedModelError(NeuronOptError):
    """The checkpoint's architecture is not one we implement; the message lists the supported names."""


class CheckpointError(NeuronOptError):
    """A checkpoint file is missing, unreadable or inconsistent; the message names the file."""


class BucketOverflowError(NeuronOptError, ValueError):
    """A request does not fit the largest compiled bucket; the message names it and the flag that raises it."""


class ArtifactError(NeuronOptError):
    """An artifact is missing, tampered with, or does not match this install; the message says what differs."""


class BackendUnavailableError(NeuronOptError):
    """A backend's runtime (e.g. the Neuron SDK) is not installed here."""


class BackendCompileError(NeuronOptError):
    """A backend could not compile a bucket's graph; the message names the graph and what failed."""


class KernelArgumentError(NeuronOptError, ValueError):
    """An NKI kernel's host wrapper got shapes, dtypes or values the kernel does not support."""


class ContextLengthError(NeuronOptError, ValueError):
    """A prompt (plus the tokens asked for) is longer than the model or artifact allows."""


class QueueFullError(NeuronOptError):
    """The serving engine's waiting queue is full; the client should retry later (HTTP 503)."""


class RankFailedError(NeuronOptError):
    """A tensor-parallel rank process died, raised, or stopped answering; the others were shut down."""
