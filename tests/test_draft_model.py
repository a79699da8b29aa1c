"""Speculative decoding with a separate draft model (--speculative-method draft-model): its KV store's
bookkeeping, and the text end to end, token for token the model's own, with a draft of other geometry
(the bundled model cut to its first layers) and with the model itself as its draft (every draft accepted:
the store must catch up the last draft's row)."""
import json
import shutil

import httpx
import pytest
from safetensors.torch import load_file, save_file

from gpu_model.loader import ModelLoadError, default_model_path, resolve_model_dir
from hetcore.backend import SeqChunk, SamplingParams
from server.config import ServeConfig
from server.draft_model import _Sync
from tests.conftest import RunningServer
from tests.test_speculative import PROMPTS, complete



def truncated_model(out, layers: int, rename_token: bool = False):
    """The bundled model's first `layers` layers (a draft of other geometry, same tokenizer) in a Hugging Face
    directory; with rename_token, two tokens of its tokenizer swapped (another vocabulary)."""
    src = resolve_model_dir(None)
    out.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (src / name).exists():
            shutil.copy(src / name, out / name)
    config = json.loads((src / "config.json").read_text())
    config["num_hidden_layers"] = layers
    (out / "config.json").write_text(json.dumps(config))
    keep = {k: v for k, v in load_file(src / "model.safetensors").items()
            if not k.startswith("model.layers.") or int(k.split(".")[2]) < layers}
    save_file(keep, out / "model.safetensors")
    if rename_token:
        tok = json.loads((out / "tokenizer.json").read_text())
        vocab = tok["model"]["vocab"]
        a, b = [t for t in vocab if t.isalpha() and len(t) > 3][:2]
        vocab[a], vocab[b] = vocab[b], vocab[a]  # two tokens' ids swapped
        (out / "tokenizer.json").write_text(json.dumps(tok))
    return out


def chunk(tokens, start, draft=0):
    return SeqChunk(7, tuple(tokens), start, tuple(range(8)), SamplingParams(), self_draft=draft)


def test_draft_store_follows_each_sequence_lazily():
    s = _Sync(0, 0)
    s.record(chunk(range(100, 110), 0))  # a prompt chunk, run at once
    s.advance(10)
    s.record(chunk([5], 10))  # a decode that does not draft: recorded only
    s.record(chunk([6], 11, draft=3))  # drafts 3: runs 10, 11, then its drafts at 12, 13
    assert s.missing(12) == [5, 6]
    s.tokens += [21, 22, 23]
    s.synced = 14  # rows 10 .. 13 written (the last draft's row, 14, not)
    s.record(chunk([9], 13))  # one draft accepted: the rows from 13 are rewritten
    assert s.synced == 13 and s.missing(14) == [9]
    s.advance(13)
    s.tokens += [31, 32, 33]  # drafted from 13: rows 13 .. 15 written
    s.synced = 16
    s.record(chunk([40], 17))  # all three accepted: row 16 (the last draft, 33) is missing
    assert s.missing(18) == [33, 40]
    t = _Sync(64, 64)  # first seen after a cached prefix: its blocks hold the draft's rows
    t.record(chunk([1, 2], 64))
    assert t.missing(66) == [1, 2]


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory):
    return truncated_model(tmp_path_factory.mktemp("draft") / "smollm2-26-layers", 26)


@pytest.mark.parametrize("draft", ["26-layers", "itself"])
def test_draft_model_text_equals_text_without_it(server, draft_dir, draft):
    """Greedy, fp32 KV and linears: the target samples every row, so the text is its own whatever the draft; both
    drafts send drafts and have some accepted (the model itself: all of them)."""
    import concurrent.futures as cf

    path = str(draft_dir) if draft == "26-layers" else str(default_model_path())
    srv = RunningServer(ServeConfig(kv_format="fp32", kv_cache_bytes=256 * 2**20, cpu_linear_dtype="float32",
                                    speculative_method="draft-model", speculative_model=path,
                                    num_speculative_tokens=3))
    try:
        with cf.ThreadPoolExecutor(3) as pool:
            spec = list(pool.map(lambda p: complete(srv.url, p)["text"], PROMPTS))
        assert spec == [complete(server.url, p)["text"] for p in PROMPTS]
        metrics = {line.split("{")[0]: float(line.split()[-1]) for line in httpx.get(srv.url + "/metrics").text.splitlines()
                   if line.startswith("hetserve:spec_decode_num_") and 'method="draft-model"' in line}
        sent, accepted = metrics["hetserve:spec_decode_num_draft_tokens_total"], metrics[
            "hetserve:spec_decode_num_accepted_tokens_total"]
        assert sent > 0 and accepted > 0
        if draft == "itself":
            assert accepted >= 0.9 * sent
            # the same prompt again: its full blocks come from the prefix cache, with the draft's rows in them
            assert complete(srv.url, PROMPTS[0])["text"] == spec[0]
            metrics = {line.split("{")[0]: float(line.split()[-1]) for line in
                       httpx.get(srv.url + "/metrics").text.splitlines() if 'method="draft-model"' in line}
            again = (metrics["hetserve:spec_decode_num_accepted_tokens_total"] - accepted,
                     metrics["hetserve:spec_decode_num_draft_tokens_total"] - sent)
            assert again[1] > 0 and again[0] >= 0.9 * again[1]
            assert srv.engine.blocks.hit_tokens > 0
    finally:
        srv.close()


def test_draft_model_settings_are_checked(tmp_path):
    with pytest.raises(ValueError, match="draft-model and speculative_model go together"):
        ServeConfig(speculative_method="draft-model", kv_format="fp32")
    with pytest.raises(ValueError, match="draft-model and speculative_model go together"):
        ServeConfig(speculative_method="ngram", speculative_model="x", kv_format="fp32")
    with pytest.raises(ValueError, match="needs executor local, or ray with ray_cpu_actors 0"):
        ServeConfig(speculative_method="draft-model", speculative_model="x", kv_format="fp32", executor="ray",
                    ray_cpu_actors=1)
    other = truncated_model(tmp_path / "other-vocab", 1, rename_token=True)
    with pytest.raises(ModelLoadError, match="is not the model's"):
        RunningServer(ServeConfig(kv_format="fp32", kv_cache_bytes=64 * 2**20, speculative_method="draft-model",
                                  speculative_model=str(other)))
