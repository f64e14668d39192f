"""Train an EAGLE-3 head for a model that has none (`scripts/train_eagle3.py`), saved in the `speculators` layout.

1. Data: the model's own greedy answers to chat prompts (a JSONL file, or `SEED_PROMPTS`), so the head learns
   what this model says. The model runs eagerly (tp 1) with verify graphs, so the same object measures
   acceptance afterwards.
2. Hidden states, captured once per sequence with one forward over it: the streams entering the head's layers
   ([n, n_aux * H]) and the last layer's output ([n, H], which gives the model's logits through its own final norm
   and LM head on the fly). Saved to `<out>/data.pt` and reused by a resumed run.
3. The head: one Llama layer shaped like the model's, over the model's full vocabulary or (`draft_vocab_size`)
   the data's most frequent tokens, mapped back by d2t; its `norm` and `lm_head` initialised from the model's final
   norm and LM head (those tokens' rows), the model's embeddings shared (frozen). The loss then compares the
   distributions over the draft vocabulary, the model's restricted to it (as speculators trains).
4. The training-time-test objective of EAGLE-3 (as speculators trains it): step 0 reads the model's states and
   token i + 1 at every position i; step s > 0 feeds back step s - 1's layer outputs with the true token
   i + 1 + s, at position i + s, attending to step 0's keys at positions <= i and to its own earlier steps' keys
   at i only (what the chain at inference sees). Each step's loss is the cross-entropy of the head's
   distribution against the model's at position i + 1 + s, weighted by `step_decay` ** s.
5. AdamW; sequences in a seeded order that depends only on the step number, so a run resumed from
   `<out>/checkpoint.pt` (head, optimizer, step) ends with the same weights as one that never stopped.
   `<out>/config.json` and `<out>/model.safetensors` (the head, speculators layout) are written at every
   checkpoint and at the end.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from models.eagle3 import Eagle3Config, Eagle3Head, default_aux_layers
from neuron_opt.errors import ConfigError

SEED_PROMPTS = [
    "Give me three tips for staying focused while studying.",
    "Explain what a black hole is in simple terms.",
    "Write a haiku about autumn leaves.",
    "What is the difference between weather and climate?",
    "Describe how to make a cup of tea.",
    "Why do cats purr?",
    "Summarize the plot of a fairy tale you know.",
    "What are some good habits for a healthy morning routine?",
    "Explain why the sky is blue.",
    "Write a short poem about the ocean.",
    "How do plants make their food?",
    "List five fruits and one fact about each.",
    "What should I pack for a weekend camping trip?",
    "Explain what a computer program is to a child.",
    "Tell me a fun fact about octopuses.",
    "How does a bicycle stay upright?",
    "Write a friendly note inviting a neighbour to dinner.",
    "What is the water cycle?",
    "Give me a simple recipe for pancakes.",
    "Why is exercise good for the brain?",
    "Describe the sound of rain to someone who has never heard it.",
    "What makes a good friend?",
    "Explain how a rainbow forms.",
    "Suggest three names for a small bakery and say why.",
]


def read_prompts(path: str | Path) -> list[list[dict[str, Any]]]:
    """Conversations from a JSONL file, one a line: {"messages": [...]}, a bare list of messages, or
    {"prompt": "text"} (one user turn). ConfigError naming the line otherwise."""
    chats = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except ValueError as e:
            raise ConfigError(f"prompts: {path} line {n} is not JSON ({e})", param="prompts") from None
        if isinstance(item, dict) and isinstance(item.get("prompt"), str):
            item = [{"role": "user", "content": item["prompt"]}]
        elif isinstance(item, dict):
            item = item.get("messages")
        if not (isinstance(item, list) and item and all(isinstance(m, dict) and "role" in m for m in item)):
            raise ConfigError(f"prompts: {path} line {n} is not a chat ({{\"messages\": [...]}}, a list of "
                              "messages, or {\"prompt\": text})", param="prompts")
        chats.append(item)
    if not chats:
        raise ConfigError(f"prompts: {path} holds no chats", param="prompts")
    return chats


@dataclass(frozen=True)
class TrainConfig:
    out: Path
    steps: int = 300
    ttt_steps: int = 3
    lr: float = 1e-3
    step_decay: float = 0.8
    max_new_tokens: int = 128
    checkpoint_every: int = 100
    seed: int = 0
    aux_layers: tuple[int, ...] | None = None  # None: (2, L // 2, L - 3)
    draft_vocab_size: int | None = None  # the data's most frequent tokens (d2t); None: the model's whole vocabulary

    def __post_init__(self) -> None:
        if self.steps < 1 or self.ttt_steps < 1 or self.checkpoint_every < 1 or self.max_new_tokens < 1:
            raise ConfigError("train-eagle3: steps, ttt_steps, checkpoint_every and max_new_tokens must be >= 1")
        if self.draft_vocab_size is not None and self.draft_vocab_size < 2:
            raise ConfigError(f"draft_vocab_size: must be >= 2, got {self.draft_vocab_size}",
                              param="draft_vocab_size")


def model_parts(llm: Any) -> Any:
    """The eager model of an `LLM` over a checkpoint (the trainer reads its final norm, LM head, embeddings)."""
    model = getattr(llm.runner.executor, "model", None)
    if model is None or not hasattr(model, "forward_with_aux"):
        raise ConfigError("train-eagle3: the model must run eagerly at tp 1 (a checkpoint, not an artifact)",
                          param="model")
    return model


def draft_vocabulary(data: Sequence[dict[str, torch.Tensor]], vocab_size: int, n: int | None) -> torch.Tensor | None:
    """The target ids of the draft vocabulary, ascending: the `n` tokens most frequent in the data (ties: the lower
    id); None for the whole vocabulary (n None or not smaller than it)."""
    if n is None or n >= vocab_size:
        return None
    counts = torch.bincount(torch.cat([d["ids"] for d in data]), minlength=vocab_size).double()
    counts -= torch.arange(vocab_size, dtype=torch.float64) / (2 * vocab_size)  # ties: the lower id first
    return torch.sort(torch.topk(counts, n).indices).values


def new_head(llm: Any, aux_layers: tuple[int, ...], draft_ids: torch.Tensor | None = None) -> Eagle3Head:
    """A head shaped like the model's layers, over its vocabulary (or the target ids `draft_ids`, mapped back by
    d2t); norm and LM head from the model's, the model's embeddings shared."""
    from neuron_opt.config import ModelConfig

    mc, model = llm.config, model_parts(llm)
    layer = ModelConfig.from_hf(dict(
        model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=mc.vocab_size,
        hidden_size=mc.hidden_size, intermediate_size=mc.intermediate_size, num_hidden_layers=1,
        num_attention_heads=mc.num_attention_heads, num_key_value_heads=mc.num_key_value_heads,
        head_dim=mc.head_dim, rms_norm_eps=mc.rms_norm_eps, max_position_embeddings=mc.max_position_embeddings,
        rope_parameters=dict(mc.rope)))
    ids = torch.arange(mc.vocab_size) if draft_ids is None else draft_ids
    cfg = Eagle3Config(layer=layer, draft_vocab_size=len(ids), aux_layer_ids=tuple(aux_layers),
                       has_vocab_map=draft_ids is not None)
    head = Eagle3Head(cfg, llm.runner.max_model_len)
    with torch.no_grad():
        head.norm.weight.copy_(model.model.norm.weight.float())
        head.lm_head.weight.copy_(model.lm_head.weight[ids].float())
        if draft_ids is not None:
            head.d2t.copy_(draft_ids - torch.arange(len(ids)))
    head.aux_layer_ids = tuple(aux_layers)
    head.share_embedding(lambda ids: F.embedding(ids, model.model.embed_tokens.weight).detach())
    return head


def generate_data(llm: Any, chats: Sequence[list[dict[str, Any]]], max_new_tokens: int) -> list[list[int]]:
    """Each chat's prompt and the model's greedy answer, as token ids."""
    from neuron_opt.runtime.sampling import SamplingParams

    prompts = [llm.encode_chat(c) for c in chats]
    outs = llm.generate_batch(prompts, SamplingParams(max_tokens=max_new_tokens, temperature=0.0))
    return [list(p) + list(o.token_ids) for p, o in zip(prompts, outs, strict=True)]


@torch.no_grad()  # not inference mode: the states are training inputs (a clone of the executor's)
def capture(llm: Any, seqs: Sequence[list[int]], aux_layers: tuple[int, ...]) -> list[dict[str, torch.Tensor]]:
    """Per sequence: its ids, the streams entering `aux_layers` at every position (fp32 [n, n_aux * H]) and the last
    layer's output ([n, H]), from one forward over it (in chunks of the largest prefill, into KV slot 0)."""
    runner = llm.runner
    L = llm.config.num_hidden_layers
    runner.capture_aux_hidden((*aux_layers, L))
    H = llm.config.hidden_size
    out = []
    for ids in seqs:
        parts = []
        for start in range(0, len(ids), runner.max_prompt_len):
            chunk = ids[start:start + runner.max_prompt_len]
            runner.prefill(0, chunk, start=start)
            parts.append(runner.aux_hidden[0, :len(chunk)].float().clone())
        states = torch.cat(parts)
        out.append({"ids": torch.tensor(ids), "aux": states[:, :-H].contiguous(), "last": states[:, -H:].contiguous()})
    return out


def ttt_loss(head: Eagle3Head, target_logits: Callable[[torch.Tensor], torch.Tensor], item: dict[str, torch.Tensor],
             ttt_steps: int, step_decay: float) -> tuple[torch.Tensor, list[float]]:
    """The training-time-test loss over one sequence (module docstring) and each step's top-1 agreement with the
    model's greedy token."""
    ids, aux, last = item["ids"], item["aux"], item["last"]
    T = len(ids) - 1  # head positions 0..T-1: state i with token i + 1
    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []

    def kv(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        keys.append(k)
        values.append(v)
        i = torch.arange(T)
        blocks = [i[None, :] <= i[:, None]] + [torch.eye(T, dtype=torch.bool)] * (len(keys) - 1)
        return torch.cat(keys, 1), torch.cat(values, 1), torch.cat(blocks, 1)[None]

    hidden = head.project(aux[:T])[None]
    loss = torch.zeros(())
    agree = []
    for s in range(ttt_steps):
        n = T - s  # positions i whose target (the model at i + 1 + s) exists
        if n < 1:
            break
        tokens = torch.cat([ids[1 + s:], ids.new_zeros(s)])[None]  # the true token i + 1 + s (pads past the end)
        h = head.run_layer(tokens, hidden, (torch.arange(T) + s)[None], kv)
        logits, hidden = head.logits(h)
        with torch.no_grad():
            want = torch.softmax(target_logits(last[1 + s:1 + s + n]), -1)  # the model at i + 1 + s
        logp = torch.log_softmax(logits[0, :n], -1)
        loss = loss + step_decay ** s * -(want * logp).sum(-1).mean()
        agree.append(float((logp.argmax(-1) == want.argmax(-1)).float().mean()))
    return loss, agree


def save_speculators(head: Eagle3Head, out: Path, verifier: str) -> None:
    """The head in the speculators layout (config.json, model.safetensors: layers.0.*, fc, norm, lm_head; the
    embeddings are the model's and not saved)."""
    cfg, lc = head.cfg, head.cfg.layer
    tensors = {(("layers.0." + k[len("midlayer."):]) if k.startswith("midlayer.") else k): v.detach().contiguous()
               for k, v in head.state_dict().items()}
    if cfg.has_vocab_map:  # speculators stores which target tokens the draft has beside d2t
        t2d = torch.zeros(lc.vocab_size, dtype=torch.bool)
        t2d[torch.arange(cfg.draft_vocab_size) + head.d2t] = True
        tensors["t2d"] = t2d
    save_file(tensors, str(out / "model.safetensors"))
    layer = dict(model_type="llama", vocab_size=lc.vocab_size, hidden_size=lc.hidden_size,
                 intermediate_size=lc.intermediate_size, num_hidden_layers=1,
                 num_attention_heads=lc.num_attention_heads, num_key_value_heads=lc.num_key_value_heads,
                 head_dim=lc.head_dim, rms_norm_eps=lc.rms_norm_eps, hidden_act="silu",
                 max_position_embeddings=lc.max_position_embeddings, rope_parameters=dict(lc.rope),
                 attention_bias=False, mlp_bias=False, tie_word_embeddings=False)
    doc = {"architectures": ["Eagle3DraftModel"], "speculators_model_type": "eagle3",
           "transformer_layer_config": layer, "draft_vocab_size": cfg.draft_vocab_size,
           "eagle_aux_hidden_state_layer_ids": list(head.aux_layer_ids), "norm_before_residual": False,
           "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                                  "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
                                  "verifier": {"name_or_path": verifier, "architectures": ["LlamaForCausalLM"]}}}
    (out / "config.json").write_text(json.dumps(doc, indent=1))


def order(step: int, n: int, seed: int) -> int:
    """The sequence trained on at `step`: a seeded permutation per pass over the data (a function of the step)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step // n)
    return int(torch.randperm(n, generator=g)[step % n])


def train(llm: Any, chats: Sequence[list[dict[str, Any]]], cfg: TrainConfig, verifier: str,
          progress: bool = True, log: Callable[[str], None] = print) -> Eagle3Head:
    """Train (or resume) into cfg.out; returns the head (module docstring)."""
    from tqdm import tqdm

    out = cfg.out
    out.mkdir(parents=True, exist_ok=True)
    L = llm.config.num_hidden_layers
    aux_layers = tuple(cfg.aux_layers or default_aux_layers(L))
    if len(aux_layers) != 3 or not all(0 <= i <= L for i in aux_layers):
        raise ConfigError(f"aux_layers: three layer ids within 0..{L}, got {list(aux_layers)} (a model of {L} layers "
                          "needs them given when the default (2, L // 2, L - 3) does not fit)", param="aux_layers")
    data_path, ckpt_path = out / "data.pt", out / "checkpoint.pt"
    if data_path.is_file():
        data = torch.load(data_path, weights_only=True)
        log(f"data: {len(data)} sequences from {data_path}")
    else:
        seqs = generate_data(llm, chats, cfg.max_new_tokens)
        data = [d for d in capture(llm, seqs, aux_layers) if len(d["ids"]) > cfg.ttt_steps + 1]
        torch.save(data, data_path)
        log(f"data: {len(data)} sequences, {sum(len(d['ids']) for d in data)} tokens -> {data_path}")
    model = model_parts(llm)
    draft_ids = draft_vocabulary(data, llm.config.vocab_size, cfg.draft_vocab_size)
    with torch.random.fork_rng():  # the layer's initial weights from the run's seed (a resumed run's match)
        torch.manual_seed(cfg.seed)
        head = new_head(llm, aux_layers, draft_ids)
    params = [p for p in head.parameters()]
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0)
    step = 0
    if ckpt_path.is_file():
        ck = torch.load(ckpt_path, weights_only=True)
        head.load_state_dict(ck["head"])
        opt.load_state_dict(ck["optimizer"])
        step = int(ck["step"])
        log(f"resumed at step {step} from {ckpt_path}")

    def target_logits(h: torch.Tensor) -> torch.Tensor:  # over the draft vocabulary (speculators' verifier head)
        logits = model.finish_logits(model.lm_head(model.model.norm(h.to(model.lm_head.weight.dtype))).float())
        return logits[:, :llm.config.vocab_size] if draft_ids is None else logits[:, draft_ids]

    def checkpoint() -> None:
        torch.save({"head": head.state_dict(), "optimizer": opt.state_dict(), "step": step}, ckpt_path)
        save_speculators(head, out, verifier)

    bar = tqdm(total=cfg.steps, initial=step, disable=not progress, desc="train-eagle3")
    while step < cfg.steps:
        loss, agree = ttt_loss(head, target_logits, data[order(step, len(data), cfg.seed)], cfg.ttt_steps,
                               cfg.step_decay)
        opt.zero_grad()
        loss.backward()
        opt.step()
        step += 1
        bar.update(1)
        bar.set_postfix(loss=f"{loss.detach().item():.3f}", top1=" ".join(f"{a:.2f}" for a in agree))
        if step % cfg.checkpoint_every == 0 or step == cfg.steps:
            checkpoint()
    bar.close()
    if not (out / "model.safetensors").is_file():
        checkpoint()
    for p in params:
        p.requires_grad_(False)
    return head.eval()
