"""Model ops backed by our NKI kernels, run through numpy (the simulator here, the SDK's NKI where installed).

`NkiSimOps` has the contract of `models.llama.TorchOps` and is passed once, at build time:
`LlamaForCausalLM(cfg, layout, max_model_len, ops=NkiSimOps())`. It runs eagerly on CPU (tensors go to numpy and
back), so it is a correctness path for the kernels inside a whole model, not a traceable graph: on a Neuron
device the same kernels are called from inside the traced graph instead (docs/neuron_backend.md).

Which kernel runs is decided by the step's shape, as the runner builds steps:
- decode (S == 1): with `paged=True` (the default) `decode_attention.run_paged` on the layer's block pools and the
  rows' block tables, read in place; with `paged=False` the rows' blocks are gathered first (`read_blocks`) and
  `decode_attention.run` takes the contiguous cache. Lengths = position + 1 (keys [0, position] of the row);
- prefill from position 0 (S == kv_len, positions 0..S-1 on every row): causal `flash_attention.run`.
Soft-capped scores (Gemma 2's `softcap`) are the kernels' own `softcap` argument.
Anything else (a sliding window, a prompt continuing from a cached prefix) is refused with
`KernelArgumentError`: the mask must be exactly the one the kernel applies, which is checked on every call.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import torch

from kernels_nki import decode_attention, flash_attention, rmsnorm
from models.llama import TorchOps
from neuron_opt.errors import KernelArgumentError


def _np(t: torch.Tensor) -> np.ndarray:
    if t.dtype == torch.bfloat16:
        return t.detach().contiguous().view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.detach().contiguous().numpy()


def _torch(a: np.ndarray, like: torch.Tensor) -> torch.Tensor:
    a = np.asarray(a)
    if like.dtype == torch.bfloat16:
        return torch.from_numpy(a.astype(np.float32)).to(torch.bfloat16)
    return torch.from_numpy(np.ascontiguousarray(a)).to(like.dtype)


class NkiSimOps(TorchOps):
    """Attention and RMSNorm through `kernels_nki` (see the module docstring for when each kernel runs).

    `paged`: decode steps read the KV block pools through the block tables (the paged decode kernel) instead of
    gathering the rows' blocks into a contiguous cache for the contiguous one.
    """

    def __init__(self, paged: bool = True) -> None:
        self.paged = paged

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        H = x.shape[-1]
        w = weight.to(x.dtype)
        out = rmsnorm.run(_np(x.reshape(-1, H)), _np(w), eps)  # [N, H]
        return _torch(out, x).reshape(x.shape)

    def attention(
        self,
        q: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        positions: torch.Tensor,
        mask: torch.Tensor,
        scale: float,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if sinks is not None:  # the kernels take no sink logits: the torch op
            return TorchOps.attention(self, q, keys, values, positions, mask, scale, softcap=softcap, sinks=sinks)
        B, _, S, _ = q.shape
        kv_len = keys.shape[2]
        j = torch.arange(kv_len)
        if S == 1:
            lengths = self._decode_lengths(positions, mask)
            out = decode_attention.run(
                _np(q[:, :, 0]), _np(keys), _np(values), lengths.numpy(), softmax_scale=scale, softcap=softcap
            )  # [B, n_heads, D]
            return _torch(out, q)[:, :, None]  # [B, n_heads, 1, D]
        if S == kv_len and bool((positions == torch.arange(S)[None]).all()):
            self._check_mask(mask, (j[None, :] <= j[:, None])[None].expand(B, S, S), "prefill")
            out = flash_attention.run(_np(q), _np(keys), _np(values), causal=True, softmax_scale=scale,
                                      softcap=softcap)
            return _torch(out, q)  # [B, n_heads, S, D]
        raise KernelArgumentError(
            f"NkiSimOps.attention: no kernel for a step of {S} tokens over {kv_len} KV "
            "positions that is not a prefill from position 0; use the torch ops"
        )

    def attention_blocks(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        positions: torch.Tensor,
        mask: torch.Tensor,
        scale: float,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if sinks is not None:  # no kernel takes sink logits: the torch op over the gathered blocks
            return TorchOps.attention_blocks(self, q, k_cache, v_cache, block_tables, positions, mask, scale,
                                             softcap=softcap, sinks=sinks)
        if not (self.paged and q.shape[2] == 1):
            return super().attention_blocks(q, k_cache, v_cache, block_tables, positions, mask, scale,
                                            softcap=softcap)
        lengths = self._decode_lengths(positions, mask)
        out = decode_attention.run_paged(
            _np(q[:, :, 0]), _np(k_cache.to(q.dtype)), _np(v_cache.to(q.dtype)), block_tables.numpy(),
            lengths.numpy(), softmax_scale=scale, softcap=softcap,
        )  # [B, n_heads, D]
        return _torch(out, q)[:, :, None]  # [B, n_heads, 1, D]

    @classmethod
    def _decode_lengths(cls, positions: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """[B] valid positions of a decode step (position + 1: keys [0, position] of the row), after checking that
        the model's mask [B, 1, kv_len] is exactly that prefix, the mask the decode kernels apply."""
        lengths = positions[:, 0] + 1  # [B]
        cls._check_mask(mask, torch.arange(mask.shape[-1])[None, None, :] < lengths[:, None, None], "decode")
        return lengths

    @staticmethod
    def _check_mask(mask: torch.Tensor, kernel_mask: torch.Tensor, what: str) -> None:
        if not torch.equal(mask, kernel_mask):
            raise KernelArgumentError(
                f"NkiSimOps.attention: the model's {what} mask is not the plain causal one "
                "the kernel applies (sliding window?); use the torch ops for this model"
            )
