"""Token masks without a server: packing, the sampler's use of them, TokenMask across threads and pickling,
and the engine's GrammarMasks on the bundled model's tokenizer."""
from __future__ import annotations

import pickle
import threading

import numpy as np
import pytest
import torch

from gpu_model.sampler import sample, unpack_mask
from hetcore.backend import SamplingParams, SeqChunk, StepInput, TokenMask


def pack(allowed: np.ndarray) -> np.ndarray:
    """The naive twin of the packing llguidance writes: bit t % 32 of word t // 32."""
    words = np.zeros((len(allowed) + 31) // 32, np.int64)
    for t in np.flatnonzero(allowed):
        words[t // 32] |= 1 << (t % 32)
    return words.astype(np.uint32).view(np.int32)


@pytest.mark.parametrize("vocab", [1, 31, 32, 33, 100, 49152])
def test_unpack_mask_matches_the_naive_packing(vocab):
    allowed = np.random.default_rng(vocab).random(vocab) < 0.3
    allowed[-1] = True  # the sign bit of a last full word
    assert torch.equal(unpack_mask(pack(allowed), vocab), torch.from_numpy(allowed))
    assert not unpack_mask(pack(allowed), vocab + 40)[vocab:].any()  # past the mask: not allowed


def test_sampler_applies_masks_first_and_row_by_row():
    logits = torch.randn(3, 64)
    allowed = np.zeros(64, bool)
    allowed[[5, 9]] = True
    mask = pack(allowed)
    greedy = SamplingParams(temperature=0.0, logit_bias=((7, 100.0),))  # bias cannot bring back a masked token
    hot = SamplingParams(temperature=2.0, seed=3)
    tokens = sample(logits, [greedy, hot, greedy], [0, 0, 0], masks=[mask, mask, None])
    assert tokens[0] == (5 if logits[0, 5] > logits[0, 9] else 9)
    assert tokens[2] == 7
    draws = {sample(logits, [SamplingParams(temperature=2.0, seed=s)], [0], masks=[mask])[0] for s in range(40)}
    assert draws == {5, 9}


def test_token_mask_waits_for_its_words_and_pickles_as_them():
    mask = TokenMask()
    filler = threading.Timer(0.05, mask.fill, [np.arange(4, dtype=np.int32)])
    filler.start()
    assert mask.words().tolist() == [0, 1, 2, 3]
    assert pickle.loads(pickle.dumps(mask)).words().tolist() == [0, 1, 2, 3]
    broken = TokenMask()
    broken.fail("no grammar")
    with pytest.raises(RuntimeError, match="no grammar"):
        broken.words()


@pytest.fixture(scope="module")
def compiler():
    from gpu_model.loader import resolve_model_dir
    from gpu_model.tokenizer import Tokenizer
    from server.grammar import GrammarCompiler

    tok = Tokenizer(resolve_model_dir(None), (2,))
    return tok, GrammarCompiler(tok.hf, tok.eos_token_ids)


def test_grammar_masks_follow_the_sampled_tokens(compiler):
    from server.grammar import GrammarMasks, GrammarSpec

    tok, grammars = compiler
    grammar = grammars.compile(GrammarSpec("choice", '["yes", "no"]'))
    masks = GrammarMasks()
    masks.add(1, grammar)
    chunk = SeqChunk(1, (5,), 0, (0,), SamplingParams())
    inp = masks.attach(StepInput((chunk, SeqChunk(2, (6,), 0, (1,), SamplingParams()),
                                  SeqChunk(1, (5,), 0, (0,), None))))
    assert inp.chunks[1].allowed_tokens is None and inp.chunks[2].allowed_tokens is None
    allowed = torch.nonzero(unpack_mask(inp.chunks[0].allowed_tokens.words(), tok.vocab_size)).flatten().tolist()
    assert {tok.decode([t]) for t in allowed} <= {"y", "ye", "yes", "n", "no"} and allowed
    yes = tok.hf.encode("yes", add_special_tokens=False)
    assert [masks.consume(1, t) for t in yes] == [None] * (len(yes) - 1) + ["stop"]
    assert masks.consume(2, 123) is None  # unconstrained
    masks.close()
