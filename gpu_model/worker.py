"""The accelerator worker: runs the model's linear layers for a flat batch of tokens and
hands each layer's attention to a callback (the CPU attention workers)."""
from __future__ import annotations

import time
from typing import Callable, Optional, Sequence

import torch

from cpu_attn.layered_worker import LayeredDecodeKV
from cpu_attn.simhash import LshCoder
from cpu_attn.worker import AttentionWorker, DecodeKV
from gpu_model.model import LlamaModel

# attend(layer, q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D], codes) -> [T, Hq * D], all CPU float32;
# codes: (query codes [D, Hq, L] of the D decode rows (one-token chunks, chunks with drafts), key codes [T, Hkv, L])
# int32 from the LshCoder, or None
AttendFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor, Optional[tuple]], torch.Tensor]
Chunks = Sequence[tuple[int, int, int, int]]  # (seq_id, start_pos, num_tokens, num_draft) of the flat batch, in order


def _drafts(chunks: Chunks) -> int:
    """Draft tokens among a batch's rows."""
    return sum(c[3] for c in chunks)


class ModelWorker:
    def __init__(self, model: LlamaModel, lsh: LshCoder | None = None):
        self.model = model
        self.lsh = lsh
        """With it, every layer's q and k are hashed here, next to the projection (MagicPIG)."""
        self.is_cpu = model.device.type == "cpu" and model.dtype == torch.float32
        self.tile_rows = model.tile_rows
        """The loader's choice: steps of at least this many rows multiply by AMX tiles (0: never; see tiles_for)."""

    def free(self, seq_ids) -> None:
        """Drop the per-sequence state (LSH key centers) of finished or preempted sequences."""
        if self.lsh is not None:
            self.lsh.free(seq_ids)

    def set_centers(self, centers) -> None:
        """(seq_id, layer, mu) key centers the attention workers chose (AttentionWorker.take_centers)."""
        for seq_id, layer, mu in centers:
            self.lsh.set_center(seq_id, layer, mu)

    def tiles_for(self, rows: int, drafts: int) -> int:
        """The model's tile_rows for `rows` rows of which `drafts` are draft tokens: with drafts, tiles exactly where
        the same rows without them would take tiles. Tiles round x to bf16 and the integer dots below them to int16,
        so a verified row's logits equal its one-token decode's (speculative decoding is exact) only where both
        steps multiply alike."""
        if not drafts or not self.tile_rows:
            return self.tile_rows
        return 1 if rows - drafts >= self.tile_rows else 0

    def _to_host(self, t: torch.Tensor) -> torch.Tensor:
        return t if self.is_cpu else t.float().cpu()

    def forward(self, token_ids: Sequence[int], positions: Sequence[int], logit_rows: Sequence[int],
                attend: AttendFn, chunks: Chunks = ()) -> tuple[torch.Tensor, float]:
        """Run every layer over the flat batch -> logits at `logit_rows` [R, vocab] (float32, on the
        model's device) and the seconds spent outside `attend`. `chunks` is needed with `lsh`."""
        sent = []
        (logits,), busy_s = self.forward_pipelined([(token_ids, positions, logit_rows, chunks)],
                                                   lambda _, *args: sent.append(args), lambda _: attend(*sent.pop()))
        return logits, busy_s

    def run(self, attn: AttentionWorker, token_ids: Sequence[int], positions: Sequence[int],
            logit_rows: Sequence[int], chunks: Chunks = ()) -> tuple[torch.Tensor, float]:
        """`forward` with `attn` (after its begin_step) attending: every layer in one call where the step allows it
        (forward_decode, then `attn.decoded`), else a layer at a time."""
        kv = attn.decode_kv(self.model.cfg.num_heads) if self.fuses_decode(len(token_ids)) else None
        if kv is None:
            return self.forward(token_ids, positions, logit_rows, attn.attend, chunks)
        logits, accel_s, attn_s = self.forward_decode(token_ids, positions, logit_rows, kv, _drafts(chunks))
        attn.decoded(kv, attn_s)
        return logits, accel_s

    def fuses_decode(self, num_tokens: int) -> bool:
        """Whether a step of `num_tokens` decode rows can run every layer in one call (forward_decode)."""
        return self.lsh is None and self.model.decode_stack is not None and num_tokens <= self.model.quant_max_tokens

    @torch.inference_mode()
    def forward_decode(self, token_ids: Sequence[int], positions: Sequence[int], logit_rows: Sequence[int],
                       kv: DecodeKV | LayeredDecodeKV, drafts: int = 0) -> tuple[torch.Tensor, float, float]:
        """`forward` of a step of decode rows (fuses_decode) with every layer in one call that also writes and
        attends their KV as `kv` (the attention worker's DecodeKV) says -> the logits at `logit_rows`, the seconds
        outside attention and the seconds of attention and KV writes. `drafts`: how many rows are draft tokens."""
        t0 = time.perf_counter()
        m = self.model
        x = m.embed(torch.tensor(token_ids))
        cos, sin = m.rope(torch.tensor(positions))
        t1 = time.perf_counter()
        m.tile_rows = self.tiles_for(len(token_ids), drafts)
        x, share = m.decode_layers(x, cos, sin, kv)
        attn_s = share * (time.perf_counter() - t1)
        m.tile_rows = self.tiles_for(len(logit_rows), drafts)
        logits = m.logits(x[torch.tensor(logit_rows, dtype=torch.long)])
        m.tile_rows = self.tile_rows
        return logits, time.perf_counter() - t0 - attn_s, attn_s

    @torch.inference_mode()
    def forward_pipelined(self, batches: Sequence[tuple], send: Callable, recv: Callable,
                          on_device: Sequence[bool] = ()) -> tuple[list[torch.Tensor], float]:
        """`forward` over micro-batches [(token_ids, positions, logit_rows, chunks)], layer by layer
        in turn: send(m, layer, q, k, v, codes) hands micro-batch m's attention to the CPU workers
        and recv(m) -> [T, Hq * D] waits for it, so while they attend for one micro-batch this
        worker runs the other's linears. A micro-batch marked in `on_device` is attended on the model's
        device: its q, k, v are sent as they are, not as CPU float32. Returns each one's logits and the
        seconds outside recv."""
        t0 = time.perf_counter()
        m, dev = self.model, self.model.device
        xs, ropes = [], []
        for token_ids, positions, _, _ in batches:
            xs.append(m.embed(torch.tensor(token_ids, device=dev)))
            ropes.append(m.rope(torch.tensor(positions, device=dev)))

        drafts = [_drafts(chunks) for *_, chunks in batches]

        def issue(b: int, i: int) -> None:
            m.tile_rows = self.tiles_for(len(xs[b]), drafts[b])
            q, k, v = m.pre_attention(i, xs[b], *ropes[b])
            codes = None if self.lsh is None else self.lsh.codes(i, q, k, batches[b][3])
            if b < len(on_device) and on_device[b]:
                send(b, i, q, k, v, codes)
            else:
                send(b, i, self._to_host(q), self._to_host(k), self._to_host(v), codes)

        for b in range(len(batches)):
            issue(b, 0)
        wait_s = 0.0
        for i in range(m.cfg.num_layers):
            for b in range(len(batches)):
                t1 = time.perf_counter()
                o = recv(b)
                wait_s += time.perf_counter() - t1
                m.tile_rows = self.tiles_for(len(xs[b]), drafts[b])
                xs[b] = m.post_attention(i, xs[b], o.to(device=dev, dtype=m.dtype))
                if i + 1 < m.cfg.num_layers:
                    issue(b, i + 1)
        logits = []
        for x, (_, _, rows, _), d in zip(xs, batches, drafts):
            m.tile_rows = self.tiles_for(len(rows), d)
            logits.append(m.logits(x[torch.tensor(rows, device=dev, dtype=torch.long)]))
        m.tile_rows = self.tile_rows
        return logits, time.perf_counter() - t0 - wait_s
