"""The speculative-decoding workloads (scripts/bench_spec.py at batch 1-4, scripts/bench_serve.py --scenario
speculative through the server): chat prompts for the default model.

- grounded: "repeat / edit this text" over a ~300-token paragraph or code block, so the answer copies the prompt
  (what prompt lookup predicts);
- open-ended: story / explanation prompts, little to copy.
"""

from __future__ import annotations

PARAGRAPHS = [
    "The Amazon rainforest covers much of the Amazon basin of South America. This basin encompasses seven million "
    "square kilometres, of which five and a half million square kilometres are covered by the rainforest. The "
    "region includes territory belonging to nine nations and 3,344 formally acknowledged indigenous territories. "
    "The majority of the forest, 60 percent, is in Brazil, followed by Peru with 13 percent, Colombia with 10 "
    "percent, and with minor amounts in Bolivia, Ecuador, French Guiana, Guyana, Suriname, and Venezuela. The "
    "rainforest likely formed during the Eocene era. It appeared following a global reduction of tropical "
    "temperatures when the Atlantic Ocean had widened sufficiently to provide a warm, moist climate to the "
    "Amazon basin. The rainforest has been in existence for at least 55 million years, and most of the region "
    "remained free of savanna-type biomes at least until the current ice age, when the climate was drier and "
    "savanna more widespread.",
    "def merge_sorted(a, b):\n    out = []\n    i = j = 0\n    while i < len(a) and j < len(b):\n"
    "        if a[i] <= b[j]:\n            out.append(a[i])\n            i += 1\n        else:\n"
    "            out.append(b[j])\n            j += 1\n    out.extend(a[i:])\n    out.extend(b[j:])\n"
    "    return out\n\n\ndef merge_sort(xs):\n    if len(xs) <= 1:\n        return xs\n    mid = len(xs) // 2\n"
    "    return merge_sorted(merge_sort(xs[:mid]), merge_sort(xs[mid:]))\n\n\ndef is_sorted(xs):\n"
    "    return all(x <= y for x, y in zip(xs, xs[1:]))\n",
]
GROUNDED = [
    f"Repeat the following text exactly, word for word, with nothing before or after it:\n\n{PARAGRAPHS[0]}",
    f"Rename the function merge_sorted to merge_two everywhere in this code and output the whole code:\n\n"
    f"{PARAGRAPHS[1]}",
    f"Copy this text exactly:\n\n{PARAGRAPHS[0][:700]}",
    f"Output this code unchanged:\n\n{PARAGRAPHS[1]}",
]
OPEN = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how a refrigerator works to a ten-year-old.",
    "Describe a day in the life of a honeybee.",
    "What are the pros and cons of living in a big city?",
]

# More grounded prompts for many concurrent streams: each instruction over each text, so no two requests are the
# same (GROUNDED's four come first).
_INSTRUCTIONS = [
    "Repeat the following text exactly, word for word, with nothing before or after it:",
    "Copy this text exactly:",
    "Output this text unchanged:",
    "Reproduce the text below verbatim, and nothing else:",
]
_TEXTS = [PARAGRAPHS[0], PARAGRAPHS[0][:700], PARAGRAPHS[1], PARAGRAPHS[0][300:]]


def grounded_prompts(n: int) -> list[str]:
    """`n` distinct grounded prompts (at most 18)."""
    extra = [f"{i}\n\n{t}" for t in _TEXTS for i in _INSTRUCTIONS]
    out = GROUNDED + [p for p in extra if p not in GROUNDED]
    if n > len(out):
        raise ValueError(f"at most {len(out)} distinct grounded prompts, asked for {n}")
    return out[:n]
