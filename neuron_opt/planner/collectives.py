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
  context parallel  with whole KV heads per rank (shard layout, `cp_degree` tp; prefill steps with S % tp == 0):
  over heads        per layer, in place of the attention's all_reduce, all_gathers over the tp ranks of the rows'
                    K and V (B*n_kv*kv_len*D*e_kv each, e_kv the pool's element bytes), the q weight
                    (n_heads*D*H*e), its bias (n_heads*D*e) and the sinks (n_heads*e) where the model has them, the
                    o weight (H*n_heads*D*e) and the attention output (T*H*e); the MLP's all_reduce as before
  LM head           full: all_gather B*V_pad*4; candidates K: all_gather tp*B*K*4 (values) + tp*B*K*8 (ids)
"""

from __future__ import annotations

from dataclasses import dataclass

from neuron_opt.buckets import PREFILL, Bucket
from neuron_opt.config import ModelConfig, ParallelConfig
from neuron_opt.parallel.collectives import CollectiveCall
from neuron_opt.parallel.sharding import HeadLayout, head_layout

GROUP = "group_all_gather"  # within a flash-decoding KV group (layer_collectives names the q/k/v ones apart)


def layer_collectives(lay: HeadLayout, sequence_parallel: bool, context_parallel: bool = False,
                      q_bias: bool = False, sinks: bool = False) -> list[str]:
    """The collectives one decoder layer issues, in order: under plain TP an all-reduce after the attention's
    and after the MLP's row-parallel linear; sequence parallel turns each into an all-gather before the column
    layers and a reduce-scatter after the row ones; flash decoding adds one group all-gather of the partial
    softmax results (max, sum) in the KV group, and a context-parallel prefill step three before it (q, k, v).
    None at tp=1."""
    if lay.tp == 1:
        return []
    if context_parallel and lay.cp_heads:  # models/llama.py, Attention._cp_heads_forward
        return ["cp_k", "cp_v", "cp_wq", *(["cp_bq"] if q_bias else []), *(["cp_sinks"] if sinks else []),
                "cp_wo", "cp_out", "all_reduce"]
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
    cfg: ModelConfig, par: ParallelConfig, bucket: Bucket, act_bytes: int, candidates: int | None,
    kv_bytes: int | None = None
) -> list[CollectiveCall]:
    """The collectives one rank issues for one step of `bucket` (empty for tp=1). `kv_bytes`: the KV pool's
    element bytes (None: act_bytes)."""
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
    cp = lay.cp and bucket.phase == PREFILL and S > 1 and S % lay.cp_degree == 0  # models/llama.py, Attention
    D = cfg.head_dim
    e_kv = act_bytes if kv_bytes is None else kv_bytes
    nq = lay.n_heads_local * tp
    whole = {"cp_k": B * lay.n_kv_local * tp * bucket.kv_len * D * e_kv,
             "cp_v": B * lay.n_kv_local * tp * bucket.kv_len * D * e_kv,
             "cp_wq": nq * D * H * act_bytes, "cp_bq": nq * D * act_bytes, "cp_sinks": nq * act_bytes,
             "cp_wo": H * nq * D * act_bytes, "cp_out": full}
    payload = {"all_gather": padded, "reduce_scatter": padded, "all_reduce": full,
               "group_all_gather": g * B * lay.n_heads_local * S * 2 * act_bytes,
               "group_all_gather_q": B * S * lay.n_heads_local * D * act_bytes,
               "group_all_gather_k": B * S * lay.n_kv_local * D * act_bytes,
               "group_all_gather_v": B * S * lay.n_kv_local * D * act_bytes}
    for _ in range(cfg.num_hidden_layers):
        calls += [CollectiveCall("all_gather", whole[op], tp) if op in whole else
                  CollectiveCall(GROUP if op.startswith(GROUP) else op, payload[op], g if op.startswith(GROUP) else tp)
                  for op in layer_collectives(lay, sp, cp, cfg.attention_bias, cfg.attention_sinks)]
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


def cp_heads_break_even(cfg: ModelConfig, lay: HeadLayout, spmd_gather: bool = False) -> int | None:
    """Under context parallelism with whole KV heads per rank (`HeadLayout.cp_heads`): the shortest prompt (one
    row from position 0, KV and activations of one element size) whose prefill step moves fewer wire bytes per
    layer (ring model) through the all-gathers of K, V, the q/o weights and the output than through the
    all-reduce they replace; None: no length does. `spmd_gather`: each all-gather is an all-reduce of tp times its
    bytes (torch-xla 2.9's SPMD graphs, neuron_opt.backends.neuron.SpmdCollectives)."""
    n, D, H = lay.tp, cfg.head_dim, cfg.hidden_size
    nq, nkv = lay.n_heads_local * n, lay.n_kv_local * n
    weights = 2 * nq * D * H + (nq * D if cfg.attention_bias else 0) + (nq if cfg.attention_sinks else 0)
    # per token of the prompt: the gathered K and V (2 * nkv * D) and output (H); per step: the weights
    gather = n * 2 * (n - 1) / n if spmd_gather else (n - 1) / n  # wire bytes per gathered byte
    per_token = gather * (2 * nkv * D + H) - 2 * (n - 1) / n * H
    if per_token >= 0:
        return None
    return int(gather * weights // -per_token) + 1
