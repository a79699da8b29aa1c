"""Token sampler: greedy, temperature, top-k, top-p, reproducible per-request seeds.

A grammar's mask (structured outputs) is applied first, before penalties, temperature, top-k and
top-p, row by row: a row with a mask can only sample the tokens it allows.

Randomness for the n-th output token of a request comes from a generator seeded with
(seed, n) alone, so the same request samples the same text whatever else shares its batch,
and a preempted request that is recomputed continues exactly where it left off.
"""
from __future__ import annotations

from typing import Protocol, Sequence

import numpy as np
import torch


class SamplingLike(Protocol):
    temperature: float
    top_p: float
    top_k: int
    seed: int
    logprobs: int | None
    presence_penalty: float
    frequency_penalty: float
    logit_bias: tuple[tuple[int, float], ...]


def _row_seed(seed: int, output_index: int) -> int:
    return (seed * 1_000_003 + output_index) % (2**63 - 1)


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """logits: [V] float32 -> logits with tokens outside top-k / the top-p nucleus set to -inf."""
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        # keep a token while the mass strictly before it is below top_p (the top token always stays)
        drop = probs.cumsum(-1) - probs >= top_p
        logits = logits.clone()
        logits[order[drop]] = float("-inf")
    return logits


def unpack_mask(words: np.ndarray, vocab_size: int) -> torch.Tensor:
    """words: int32 [ceil(V / 32)], token t allowed when bit t % 32 of words[t // 32] is set -> bool [vocab_size]
    (tokens past the mask's 32 * len(words) are not allowed)."""
    bits = np.unpackbits(np.ascontiguousarray(words, dtype="<i4").view(np.uint8), bitorder="little")
    allowed = torch.zeros(vocab_size, dtype=torch.bool)
    n = min(vocab_size, bits.shape[0])
    allowed[:n] = torch.from_numpy(bits[:n].astype(np.bool_))
    return allowed


def apply_mask(logits: torch.Tensor, words: np.ndarray) -> torch.Tensor:
    """logits: [V] -> a copy with the tokens the packed mask `words` does not allow set to -inf."""
    return logits.masked_fill(~unpack_mask(words, logits.shape[-1]), float("-inf"))


def penalize(logits: torch.Tensor, p: SamplingLike, history: Sequence[int]) -> torch.Tensor:
    """logits: [V] -> a copy plus the request's logit_bias, less OpenAI's presence and frequency penalties
    of the tokens in `history`."""
    out = logits.clone()
    if history:
        ids, counts = torch.unique(torch.tensor(history, dtype=torch.long), return_counts=True)
        out[ids] -= p.frequency_penalty * counts.float() + p.presence_penalty
    for token, bias in p.logit_bias:
        out[token] += bias
    return out


def sample(logits: torch.Tensor, params: Sequence[SamplingLike], output_indices: Sequence[int],
           histories: Sequence[Sequence[int]] = (), masks: Sequence[np.ndarray | None] = ()) -> list[int]:
    """logits: [N, V] -> one token id per row. histories: each row's request's outputs so far, for
    its penalties (may be empty). masks: each row's packed mask of allowed tokens (unpack_mask), or None
    for any token (may be empty)."""
    logits = logits.float().cpu()
    tokens = logits.argmax(-1).tolist()
    for row, (p, index) in enumerate(zip(params, output_indices)):
        history = histories[row] if histories else ()
        mask = masks[row] if masks else None
        if p.temperature == 0.0 and not history and not p.logit_bias and mask is None:
            continue
        row_logits = logits[row] if mask is None else apply_mask(logits[row], mask)
        row_logits = penalize(row_logits, p, history) if history or p.logit_bias else row_logits
        if p.temperature == 0.0:
            tokens[row] = int(row_logits.argmax())
            continue
        scaled = filter_logits(row_logits / p.temperature, p.top_k, p.top_p)
        gen = torch.Generator().manual_seed(_row_seed(p.seed, index))
        # Gumbel-max: argmax(log p - log(-log u)) draws from softmax(scaled)
        noise = -torch.log(-torch.log(torch.rand(scaled.shape, generator=gen).clamp_min(1e-20)))
        tokens[row] = int((scaled + noise).argmax())
    return tokens


def logprobs(logits: torch.Tensor, tokens: Sequence[int], tops: Sequence[int | None]) -> list[tuple | None]:
    """For each row whose `tops` entry is not None: (log-probability of its token, its `tops` most likely
    (token, log-probability) pairs, best first); None for the others (a request's `logprobs`).

    Log-probabilities are the model's own distribution: before temperature, top-k, top-p, penalties and bias."""
    rows = [r for r, top in enumerate(tops) if top is not None]
    out: list[tuple | None] = [None] * len(tops)
    if not rows:
        return out
    logp = torch.log_softmax(logits[rows].float(), -1)
    chosen = logp.gather(1, torch.tensor([[tokens[r]] for r in rows], device=logp.device)).squeeze(1).tolist()
    k = max(tops[r] for r in rows)
    top_lp, top_ids = (logp.topk(k, -1) if k else (logp[:, :0], logp[:, :0].long()))
    top_lp, top_ids = top_lp.tolist(), top_ids.tolist()
    for i, r in enumerate(rows):
        n = tops[r]
        out[r] = (chosen[i], tuple(zip(top_ids[i][:n], top_lp[i][:n])))
    return out
