"""What the vision-language families share about a prompt's images."""

from __future__ import annotations

from collections.abc import Sequence


def placeholder_runs(token_ids: Sequence[int], image_token_id: int) -> list[list[int]]:
    """The positions of each run of consecutive image placeholder tokens, in prompt order (one run an image)."""
    runs: list[list[int]] = []
    for i, t in enumerate(token_ids):
        if t == image_token_id:
            if i == 0 or token_ids[i - 1] != image_token_id:
                runs.append([])
            runs[-1].append(i)
    return runs
