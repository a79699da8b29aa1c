"""The accelerator worker: runs the model's linear layers for a flat batch of tokens and
hands each layer's attention to a callback (the CPU attention workers)."""
from __future__ import annotations

import time
from typing import Callable, Sequence

import torch

from gpu_model.model import LlamaModel
from gpu_model.sampler import SamplingLike, sample

# attend(layer, q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D]) -> [T, Hq * D], all CPU float32
AttendFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class ModelWorker:
    def __init__(self, model: LlamaModel):
        self.model = model
        self.is_cpu = model.device.type == "cpu" and model.dtype == torch.float32

    def _to_host(self, t: torch.Tensor) -> torch.Tensor:
        return t if self.is_cpu else t.float().cpu()

    @torch.inference_mode()
    def forward(self, token_ids: Sequence[int], positions: Sequence[int], logit_rows: Sequence[int],
                attend: AttendFn) -> tuple[torch.Tensor, float]:
        """Run every layer over the flat batch -> logits at `logit_rows` [R, vocab] (float32, on the
        model's device) and the seconds spent outside `attend`."""
        t0 = time.perf_counter()
        m, dev = self.model, self.model.device
        x = m.embed(torch.tensor(token_ids, device=dev))
        cos, sin = m.rope(torch.tensor(positions, device=dev))
        attend_s = 0.0
        for i in range(m.cfg.num_layers):
            q, k, v = m.pre_attention(i, x, cos, sin)
            t1 = time.perf_counter()
            o = attend(i, self._to_host(q), self._to_host(k), self._to_host(v))
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
    ) -> tuple[list[int], float]:
        """Run every layer over the flat batch; sample one token at each of `sample_rows`.

        Returns the sampled tokens and the seconds spent outside `attend`.
        """
        logits, busy_s = self.forward(token_ids, positions, sample_rows, attend)
        if not sample_rows:
            return [], busy_s
        t0 = time.perf_counter()
        tokens = sample(logits, params, output_indices)
        return tokens, busy_s + time.perf_counter() - t0
