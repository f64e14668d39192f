"""The encoder cache: each image's embeddings, computed once and kept while a request that holds the image is in
flight. Engine thread only.

Design decisions
- Keyed by the image's content hash, with the requests that use it: an image is encoded once per request however
  its prompt is prefilled (in chunks that split its placeholder tokens, or again after a preemption, which
  recomputes K/V but not the image), and once for all requests in flight with the same image. An entry goes when
  its last request finishes.
- Encoding is lazy: only a prefill chunk that holds some of an image's placeholder positions asks for it, so an
  image whose tokens all come from the prefix cache is never encoded.
- A chunk's rows: the embeddings at the chunk's placeholder positions, as (indices within the chunk, rows), what
  `runtime.runner.PrefillRow.embeds` takes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from neuron_opt.multimodal.inputs import ImageItem


class EncoderCache:
    """`encode(item) -> [len(item.positions), H]`: the model's vision encoder (ModelRunner.encode_image)."""

    def __init__(self, encode: Callable[[ImageItem], torch.Tensor]) -> None:
        self.encode = encode
        self.entries: dict[bytes, torch.Tensor] = {}
        self.users: dict[bytes, set[str]] = {}
        self.num_encoded = 0  # encoder calls made (one per image, not per chunk)

    def embeddings(self, request_id: str, item: ImageItem) -> torch.Tensor:
        key = item.content_hash
        if key not in self.entries:
            out = self.encode(item)
            if out.shape[0] != len(item.positions):
                raise ValueError(f"the vision encoder gave {out.shape[0]} embeddings for an image with "
                                 f"{len(item.positions)} placeholder tokens")
            self.entries[key] = out
            self.num_encoded += 1
        self.users.setdefault(key, set()).add(request_id)
        return self.entries[key]

    def release(self, request_id: str, images: Sequence[ImageItem]) -> None:
        """A finished request lets go of its images; an image no request in flight holds is dropped."""
        for item in images:
            users = self.users.get(item.content_hash)
            if users is None:
                continue
            users.discard(request_id)
            if not users:
                del self.users[item.content_hash]
                self.entries.pop(item.content_hash, None)

    def chunk_embeds(self, request_id: str, images: Sequence[ImageItem], start: int,
                     count: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The embeddings of the placeholder positions in [start, start + count): (indices within the chunk [k],
        rows [k, H]), None when the chunk holds none."""
        idx: list[torch.Tensor] = []
        rows: list[torch.Tensor] = []
        end = start + count
        for item in images:
            if item.positions[-1] < start or item.positions[0] >= end:
                continue
            pos = torch.tensor(item.positions)
            inside = (pos >= start) & (pos < end)
            if not bool(inside.any()):
                continue
            emb = self.embeddings(request_id, item)
            idx.append(pos[inside] - start)
            rows.append(emb[inside])
        if not idx:
            return None
        return torch.cat(idx), torch.cat(rows)
