"""How a compiled program (or an uncompiled checkpoint) runs: in this process, as gloo rank processes, or as one
SPMD device program, chosen by one factory (`factory.create_executor`) from the manifest or a checkpoint spec;
`loader.load_model`, the one loader, returns the manifest, tokenizer and runner. The rank processes (`tp.py`,
`launcher.py`, `worker.py`) are started only from here."""

from neuron_opt.executors.factory import (
    RANKS,
    SINGLE,
    SPMD,
    ArtifactSpec,
    CheckpointSpec,
    build_model,
    create_executor,
    executor_kind,
)
from neuron_opt.executors.loader import LoadedModel, check_artifact_settings, is_artifact, load_model

__all__ = [
    "RANKS",
    "SINGLE",
    "SPMD",
    "ArtifactSpec",
    "CheckpointSpec",
    "LoadedModel",
    "build_model",
    "check_artifact_settings",
    "create_executor",
    "executor_kind",
    "is_artifact",
    "load_model",
]
