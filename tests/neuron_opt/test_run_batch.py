"""`neuron-opt run-batch`: a file of good and bad lines gives one result line per input line, in order; the good
ones equal the single-sequence reference loop (`LLM.chat` / `LLM.generate` on a batch-1 model), the bad ones are
error lines naming the line; a partial output (a last line cut mid-write) is continued to the same results, an
output file of another input is refused before the model loads, and embedding lines equal sentence-transformers."""

from __future__ import annotations

import json

import pytest
import torch

from neuron_opt.api import LLM
from neuron_opt.cli import main
from neuron_opt.runtime.sampling import SamplingParams

CHAT = "/v1/chat/completions"


def chat_line(cid: str, text: str) -> dict:
    return {"custom_id": cid, "method": "POST", "url": CHAT,
            "body": {"model": "tiny", "messages": [{"role": "user", "content": text}], "max_tokens": 8,
                     "temperature": 0}}


LINES = [
    json.dumps(chat_line("a", "Hello.")),
    json.dumps(chat_line("b", "Tell me a story.")),
    "not json at all",
    json.dumps({"custom_id": "c", "method": "POST", "url": "/v1/completions",
                "body": {"prompt": "Once upon a time", "max_tokens": 6, "temperature": 0}}),
    "",
    json.dumps({**chat_line("d", "x"), "url": "/v1/nope"}),
    json.dumps({**chat_line("e", "x"), "body": {**chat_line("e", "x")["body"], "temperature": "hot"}}),
    json.dumps({**chat_line("f", "x"), "body": {**chat_line("f", "x")["body"], "stream": True}}),
    json.dumps({"custom_id": "g", "method": "POST", "url": "/v1/embeddings", "body": {"input": "hi"}}),
    json.dumps(chat_line("h", "What is the weather?")),
]


@pytest.fixture(scope="module")
def ref(tiny_dir):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield LLM(tiny_dir("smollm-tok"), batch_size=1, max_model_len=256)
    torch.set_num_threads(threads)


def run(tiny_dir, tmp_path, out, lines=LINES) -> int:
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(lines) + "\n")
    return main(["run-batch", "-i", str(src), "-o", str(out), "--model", str(tiny_dir("smollm-tok")),
                 "--served-model-name", "tiny", "--max-num-seqs", "4", "--max-model-len", "256"])


def test_good_and_bad_lines_and_a_resumed_run(tiny_dir, tmp_path, ref, capsys):
    out = tmp_path / "out.jsonl"
    assert run(tiny_dir, tmp_path, out) == 0
    results = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["custom_id"] for r in results] == ["a", "b", None, "c", "d", "e", "f", "g", "h"]
    by_id = {r["custom_id"]: r for r in results}
    for cid, text in (("a", "Hello."), ("b", "Tell me a story."), ("h", "What is the weather?")):
        r = by_id[cid]
        assert r["error"] is None and r["response"]["status_code"] == 200 and r["id"].startswith("batch_req_")
        want = ref.chat([{"role": "user", "content": text}], SamplingParams(max_tokens=8, temperature=0))
        assert r["response"]["body"]["choices"][0]["message"]["content"] == want.text
    completion = by_id["c"]["response"]["body"]["choices"][0]["text"]
    assert completion == ref.generate("Once upon a time", SamplingParams(max_tokens=6, temperature=0)).text
    bad = {"d": ("url", 6), "e": ("temperature", 7), "f": ("stream", 8), "g": ("model", 9), None: (None, 3)}
    for cid, (param, number) in bad.items():  # (file line numbers: the blank line 5 counts)
        r = by_id[cid]
        assert r["response"]["status_code"] == 400 and r["error"] == r["response"]["body"]["error"], r
        assert r["error"]["param"] == param and r["error"]["message"].startswith(f"line {number}: "), r
    assert results[2]["error"]["message"].startswith("line 3: not JSON")
    assert "4 succeeded, 5 failed, 0 already done" in capsys.readouterr().out

    whole = out.read_bytes()
    cut = whole.index(b"\n", whole.index(b"\n") + 1) + 1  # two complete lines, then half of the third
    out.write_bytes(whole[:cut] + whole[cut:cut + 30])
    assert run(tiny_dir, tmp_path, out) == 0
    again = [json.loads(line) for line in out.read_text().splitlines()]
    assert out.read_bytes()[:cut] == whole[:cut]
    assert [r["custom_id"] for r in again] == [r["custom_id"] for r in results]
    for new, old in zip(again, results, strict=True):
        assert new["response"]["status_code"] == old["response"]["status_code"]
        if old["error"] is None:
            assert new["response"]["body"]["choices"] == old["response"]["body"]["choices"]
    assert "2 already done" in capsys.readouterr().out


def test_an_output_of_another_input_is_refused(tiny_dir, tmp_path, capsys):
    out = tmp_path / "out.jsonl"
    out.write_text(json.dumps({"custom_id": "zzz", "response": {}}) + "\n")
    assert run(tiny_dir, tmp_path, out, [json.dumps(chat_line("a", "Hi."))]) == 2
    assert "is not the result of input line 1" in capsys.readouterr().err


def test_embedding_lines_equal_sentence_transformers(tmp_path, capsys):
    pytest.importorskip("sentence_transformers")
    from st_models import TEXTS, assert_same, make_st_model, reference

    d, model = make_st_model(tmp_path / "st", "qwen3", "lasttoken", True)
    lines = [json.dumps({"custom_id": f"e{i}", "method": "POST", "url": "/v1/embeddings",
                         "body": {"input": TEXTS[i:i + 2], "encoding_format": "float"}}) for i in (0, 2)]
    chat = chat_line("c", "hi")
    del chat["body"]["model"]
    lines.append(json.dumps(chat))  # a text route on an embedding model: a 400 naming `model`
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("\n".join(lines) + "\n")
    assert main(["run-batch", "-i", str(src), "-o", str(out), "--model", str(d), "--max-num-seqs", "2"]) == 0
    results = [json.loads(line) for line in out.read_text().splitlines()]
    got = [e["embedding"] for r in results[:2] for e in r["response"]["body"]["data"]]
    assert_same(got, reference(model, TEXTS[:4]))
    assert results[2]["response"]["status_code"] == 400 and results[2]["error"]["param"] == "model"
