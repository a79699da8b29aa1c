"""The accelerator worker: runs the model's linear layers for a flat batch of tokens and
hands each layer's attention to a callback (the CPU attention workers)."""
from __future__ import annotations

import time
from typing import Callable, Optional, Sequence

import torch

from gpu_model.lsh import LshCoder
from gpu_model.model import LlamaModel
from gpu_model.sampler import SamplingLike, sample

# attend(layer, q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D], codes) -> [T, Hq * D], all CPU float32;
# codes: (query codes [T, Hq, L], key codes [T, Hkv, L]) int32 from the LshCoder, or None
AttendFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor, Optional[tuple]], torch.Tensor]
Chunks = Sequence[tuple[int, int, int]]  # (seq_id, start_pos, num_tokens) of the flat batch, in order


class ModelWorker:
    def __init__(self, model: LlamaModel, lsh: LshCoder | None = None):
        self.model = model
        self.lsh = lsh
        """With it, every layer's q and k are hashed here, next to the projection (MagicPIG)."""
        self.is_cpu = model.device.type == "cpu" and model.dtype == torch.float32

    def free(self, seq_ids) -> None:
        """Drop the per-sequence state (LSH key centers) of finished or preempted sequences."""
        if self.lsh is not None:
            self.lsh.free(seq_ids)

    def _to_host(self, t: torch.Tensor) -> torch.Tensor:
        return t if self.is_cpu else t.float().cpu()

    @torch.inference_mode()
    def forward(self, token_ids: Sequence[int], positions: Sequence[int], logit_rows: Sequence[int],
                attend: AttendFn, chunks: Chunks = ()) -> tuple[torch.Tensor, float]:
        """Run every layer over the flat batch -> logits at `logit_rows` [R, vocab] (float32, on the
        model's device) and the seconds spent outside `attend`. `chunks` is needed with `lsh`."""
        t0 = time.perf_counter()
        m, dev = self.model, self.model.device
        x = m.embed(torch.tensor(token_ids, device=dev))
        cos, sin = m.rope(torch.tensor(positions, device=dev))
        attend_s = 0.0
        for i in range(m.cfg.num_layers):
            q, k, v = m.pre_attention(i, x, cos, sin)
            codes = None if self.lsh is None else self.lsh.codes(i, q, k, chunks)
            t1 = time.perf_counter()
            o = attend(i, self._to_host(q), self._to_host(k), self._to_host(v), codes)
            attend_s += time.perf_counter() - t1
            x = m.post_attention(i, x, o.to(device=dev, dtype=m.dtype))
        logits = m.logits(x[torch.tensor(logit_rows, device=dev, dtype=torch.long)])
        return logits, time.perf_counter() - t0 - attend_s

    def step(
        self,
        token_ids: Sequence[int],
        positions: Sequence[int],
        sample_rows: Sequence[int],
        params: Sequence[SamplingLike],
        output_indices: Sequence[int],
        attend: AttendFn,
        chunks: Chunks = (),
    ) -> tuple[list[int], float]:
        """Run every layer over the flat batch; sample one token at each of `sample_rows`.

        Returns the sampled tokens and the seconds spent outside `attend`.
        """
        logits, busy_s = self.forward(token_ids, positions, sample_rows, attend, chunks)
        if not sample_rows:
            return [], busy_s
        t0 = time.perf_counter()
        tokens = sample(logits, params, output_indices)
        return tokens, busy_s + time.perf_counter() - t0
