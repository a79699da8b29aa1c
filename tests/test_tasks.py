"""Long-context tasks of `hetserve eval --task`: prompts that fit and hold their answer, greedy
generation through the serving path equal to plain greedy decoding, and the harness's rows."""
from __future__ import annotations

import dataclasses
import json
import re

import pytest

from tests.conftest import SHARED

WIKITEXT = SHARED / "data" / "wikitext-2" / "test.txt"


@pytest.fixture(scope="module")
def smollm2():
    from gpu_model.loader import load_model, resolve_model_dir
    from gpu_model.tokenizer import Tokenizer

    model_dir = resolve_model_dir(None)
    model = load_model(model_dir)
    return model, Tokenizer(model_dir, model.cfg.eos_token_ids)


def haystack() -> list[str]:
    from evaluation.tasks import sentences

    text = WIKITEXT.read_text()[:200_000] if WIKITEXT.exists() else "A plain sentence of five words here.\n" * 2000
    return sentences(text)


@pytest.mark.parametrize("task", ["passkey", "niah", "cwe"])
@pytest.mark.parametrize("context", [512, 2048])
def test_prompts_fit_the_context_and_hold_the_answer(smollm2, task, context):
    from evaluation.tasks import make_samples

    _, tok = smollm2
    samples = make_samples(task, tok, context, 3, haystack(), seed=1)
    assert len({s.answers for s in samples}) == 3  # different keys, needles, words
    for s in samples:
        assert 0.9 * context <= len(s.prompt) <= context
        text = tok.decode(s.prompt)
        assert text.endswith(("is", "are:"))
        if task == "cwe":
            items = re.findall(r"\d+\. (\w+)", text)
            counts = {items.count(w) for w in s.answers}
            assert len(counts) == 1 and 3 < counts.pop() <= 30
            assert max(items.count(w) for w in set(items) - set(s.answers)) <= 3
        else:
            assert s.answers[0] in text


def test_answers_are_scored_by_whole_words():
    from evaluation.tasks import Sample

    key = Sample([1], ("71432",), 8)
    assert key.score(" 71432. It") == 1 and key.score(" 714321") == 0 and key.score("") == 0
    words = Sample([1], ("apple", "river", "candle", "pencil"), 8)
    assert words.score("\n- Apple\n- river\n- apple") == 0.5


def test_generate_equals_plain_greedy_decoding(smollm2):
    """Every worker of one `generate` call (the second only had the shared prefill written to
    its store) gives the same greedy answers as re-running the whole prefix each step."""
    import torch

    from cpu_attn.kv_store import make_store
    from cpu_attn.worker import AttentionWorker, ChunkLayout
    from gpu_model.worker import ModelWorker
    from evaluation.tasks import generate, make_samples

    model, tok = smollm2
    cfg = model.cfg
    samples = [dataclasses.replace(s, max_new_tokens=4) for s in make_samples("niah", tok, 320, 2, haystack(), seed=2)]

    def worker():
        return AttentionWorker(make_store("fp32", cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 16, 64), cfg.head_dim)

    answers = generate(model, {"a": worker(), "b": worker()}, samples, tok.eos_token_ids)
    assert answers["a"] == answers["b"]
    for s, got in zip(samples, answers["a"]):
        ids = list(s.prompt)
        for _ in range(s.max_new_tokens):
            w = worker()
            w.begin_step([ChunkLayout(len(ids), 0, tuple(range(64)), 0)])
            logits, _ = ModelWorker(model).forward(ids, list(range(len(ids))), [len(ids) - 1], w.attend)
            ids.append(int(torch.argmax(logits[0])))
            if ids[-1] in tok.eos_token_ids:
                break
        assert got == [t for t in ids[len(s.prompt):] if t not in tok.eos_token_ids]


def test_task_harness_scores_oaken_magicpig_and_topk(smollm2):
    from cpu_attn.calibrate import calibrate, text_windows
    from cpu_attn.magicpig import LshConfig
    from evaluation.tasks import evaluate_task

    model, tok = smollm2
    cal = calibrate(model, text_windows(tok.encode(" ".join(haystack()[:400])), 4, 128), progress=False)
    rows = evaluate_task(model, tok, "passkey", [512], 2, ["oaken"], haystack=haystack(), oaken_cal=cal,
                         lsh=LshConfig(min_context=256, window=32), topk_frac=0.05, progress=False)
    assert [r["attention"] for r in rows] == ["exact", "magicpig", "topk", "topk-ann"]
    for r in rows:
        assert r["kv_format"] == "oaken" and r["context_tokens"] == 512 and r["num_samples"] == 2
        assert r["task_accuracy"] in (0, 0.5, 1) and r["task_accuracy_ref"] in (0, 0.5, 1)
    assert 0 < rows[1]["keys_touched_frac"] < 0.3
    assert rows[2]["keys_touched_frac"] == pytest.approx(0.05, abs=0.01) == rows[3]["keys_touched_frac"]


def test_eval_cli_task_writes_json(tmp_path, capsys):
    """fp32 KV scored against itself: the variant's accuracy is the reference's."""
    from hetserve.cli import main

    out = tmp_path / "passkey.json"
    main(["eval", "--task", "passkey", "--kv-format", "fp32", "--context-tokens", "400", "--num-samples", "2",
          "--text", str(WIKITEXT if WIKITEXT.exists() else __file__), "--json", str(out)])
    rows = json.loads(out.read_text())["results"]
    assert len(rows) == 1 and rows[0]["task"] == "passkey" and rows[0]["task_accuracy"] == rows[0]["task_accuracy_ref"]
    assert "passkey" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="context-tokens"):
        main(["eval", "--task", "passkey", "--kv-format", "fp32", "--context-tokens", "100"])
