"""Stop strings: the held-back tail found by one pass over the last (longest stop - 1) characters equals the
reference (every stop string, every prefix length), and a checker fed token by token streams what the reference
checker streams."""

from __future__ import annotations

import random

from neuron_opt.runtime.sampling import SamplingParams
from neuron_opt.runtime.stopping import StopChecker, StopStrings, held_back


def held_back_reference(text: str, stop: tuple[str, ...]) -> int:
    """The definition: the longest k < len(s), over the stop strings s, such that text ends with s[:k]."""
    keep = 0
    for s in stop:
        for k in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:k]):
                keep = max(keep, k)
                break
    return keep


def random_stops(rng: random.Random, alphabet: str) -> tuple[str, ...]:
    return tuple("".join(rng.choice(alphabet) for _ in range(rng.randint(1, 8))) for _ in range(rng.randint(0, 6)))


def test_held_back_equals_the_reference():
    rng = random.Random(0)
    for _ in range(3000):
        alphabet = "ab" if rng.random() < 0.5 else "abcé🙂"  # small alphabets: many partial matches
        stop = random_stops(rng, alphabet)
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 12)))
        assert held_back(text, StopStrings.of(stop)) == held_back_reference(text, stop), (text, stop)


class CharTok:
    """Each token id is one character (ord); decode joins them."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids if i != 0)


def test_a_checker_with_many_stop_strings_streams_what_the_definition_says():
    """Token by token: the visible text is the text so far cut at the first stop string found (in the order the
    request lists them) and short of the held-back tail; the deltas add up to it."""
    rng = random.Random(1)
    for _ in range(300):
        stop = random_stops(rng, "abc")
        text = "".join(rng.choice("abcd") for _ in range(rng.randint(1, 30)))
        sc = StopChecker(CharTok(), SamplingParams(max_tokens=len(text), stop=stop), eos_token_ids=(0,))
        streamed = ""
        for n, ch in enumerate(text, 1):
            streamed += sc.add(ord(ch))
            if sc.finish_reason is not None:
                break
            assert streamed == text[:n][: n - held_back_reference(text[:n], stop)], (text, stop)
        ends = [(text[:n].find(s), s) for s in stop if s in text[:n]]
        if ends and sc.finish_reason == "stop":
            at, first = next((i, s) for i, s in ends if s in text[:n])
            assert streamed == text[:at] and sc.stop_reason == first, (text, stop)
        else:
            assert sc.finish_reason == "length" and streamed == text and sc.stop_reason is None, (text, stop)


def test_the_stop_reason_is_the_stop_token_id_and_none_for_eos():
    """vLLM's stop_reason: the stop token id that ended the text, None when EOS did."""
    for token, reason in ((ord("x"), ord("x")), (0, None)):
        sc = StopChecker(CharTok(), SamplingParams(max_tokens=8, stop_token_ids=(ord("x"),)), eos_token_ids=(0,))
        for t in (ord("a"), token):
            sc.add(t)
        assert sc.finish_reason == "stop" and sc.stop_reason == reason
