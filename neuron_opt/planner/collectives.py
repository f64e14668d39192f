"""The planner's one collective model: the calls of a step, their bytes per step and per token, from a formula
(checked against the counted calls in tests; the latency model counts its per-layer collectives from it).

`expected_calls` lists, in issue order, the collectives one rank makes for one step of a bucket, using the
same payload convention as `neuron_opt.parallel.collectives` (all_reduce: the tensor; all_gather: the gathered
output; reduce_scatter: the full input). With e = activation bytes, T = B x S tokens of the step,
S_pad = S rounded up to a multiple of tp, L layers, H hidden:

  plain TP          embed all_reduce T*H*e; per layer 2 x all_reduce T*H*e
  sequence parallel embed reduce_scatter B*S_pad*H*e; per layer 2 x (all_gather + reduce_scatter) of
                    B*S_pad*H*e; then one all_reduce B*H*e for the last rows (prefill only; decode is plain)
  flash decoding    + per layer one group all_gather of (max, sum): g*B*S*(n_heads_local)*2*e
  context parallel  prefill steps with S % g == 0 (`cp_degree` g): + per layer, before that one, group all_gathers
                    of q, k and v: B*S*n_heads_local*D*e, then B*S*n_kv_local*D*e twice
  LM head           full: all_gather B*V_pad*4; candidates K: all_gather tp*B*K*4 (values) + tp*B*K*8 (ids)
"""

from __future__ import annotations

from dataclasses import dataclass

from neuron_opt.buckets import PREFILL, Bucket
from neuron_opt.config import ModelConfig, ParallelConfig
from neuron_opt.parallel.collectives import CollectiveCall
from neuron_opt.parallel.sharding import HeadLayout, head_layout

GROUP = "group_all_gather"  # within a flash-decoding KV group (layer_collectives names the q/k/v ones apart)


def layer_collectives(lay: HeadLayout, sequence_parallel: bool, context_parallel: bool = False) -> list[str]:
    """The collectives one decoder layer issues, in order: under plain TP an all-reduce after the attention's
    and after the MLP's row-parallel linear; sequence parallel turns each into an all-gather before the column
    layers and a reduce-scatter after the row ones; flash decoding adds one group all-gather of the partial
    softmax results (max, sum) in the KV group, and a context-parallel prefill step three before it (q, k, v).
    None at tp=1."""
    if lay.tp == 1:
        return []
    ops = []
    if sequence_parallel:
        ops.append("all_gather")
    if context_parallel:
        ops += ["group_all_gather_q", "group_all_gather_k", "group_all_gather_v"]
    if lay.kv_seq_shards > 1:
        ops.append("group_all_gather")
    ops.append("reduce_scatter" if sequence_parallel else "all_reduce")
    if sequence_parallel:
        ops.append("all_gather")
    ops.append("reduce_scatter" if sequence_parallel else "all_reduce")
    return ops


def expected_calls(
    cfg: ModelConfig, par: ParallelConfig, bucket: Bucket, act_bytes: int, candidates: int | None
) -> list[CollectiveCall]:
    """The collectives one rank issues for one step of `bucket` (empty for tp=1)."""
    tp = par.tp
    if tp == 1:
        return []
    lay = head_layout(cfg, par)
    B, H = bucket.batch, cfg.hidden_size
    S = bucket.tokens
    sp = par.sequence_parallel and S > 1
    full = B * S * H * act_bytes
    padded = B * (-(-S // tp) * tp) * H * act_bytes
    calls = [CollectiveCall("reduce_scatter", padded, tp) if sp else CollectiveCall("all_reduce", full, tp)]
    g = lay.kv_seq_shards
    cp = lay.cp and bucket.phase == PREFILL and S > 1 and S % g == 0  # models/llama.py, Attention.forward
    D = cfg.head_dim
    payload = {"all_gather": padded, "reduce_scatter": padded, "all_reduce": full,
               "group_all_gather": g * B * lay.n_heads_local * S * 2 * act_bytes,
               "group_all_gather_q": B * S * lay.n_heads_local * D * act_bytes,
               "group_all_gather_k": B * S * lay.n_kv_local * D * act_bytes,
               "group_all_gather_v": B * S * lay.n_kv_local * D * act_bytes}
    for _ in range(cfg.num_hidden_layers):
        calls += [CollectiveCall(GROUP if op.startswith(GROUP) else op, payload[op], g if op.startswith(GROUP) else tp)
                  for op in layer_collectives(lay, sp, cp)]
    if sp:
        calls.append(CollectiveCall("all_reduce", B * H * act_bytes, tp))
    if candidates is None:
        calls.append(CollectiveCall("all_gather", B * lay.vocab_padded * 4, tp))
    else:
        k = min(candidates, lay.vocab_local)
        calls += [
            CollectiveCall("all_gather", tp * B * k * 4, tp),
            CollectiveCall("all_gather", tp * B * k * 8, tp),
        ]
    return calls


@dataclass(frozen=True)
class CommSummary:
    calls: int
    payload_bytes: int
    wire_bytes: float  # per rank, ring model
    tokens: int

    @property
    def payload_per_token(self) -> float:
        return self.payload_bytes / self.tokens

    @property
    def wire_per_token(self) -> float:
        return self.wire_bytes / self.tokens


def summarize(calls: list[CollectiveCall], bucket: Bucket) -> CommSummary:
    """Totals of one step's calls, and per token of the step (B x S for prefill, B for decode)."""
    return CommSummary(
        len(calls), sum(c.nbytes for c in calls), sum(c.wire_bytes for c in calls), bucket.num_tokens
    )
