"""BatchBuilder: a step's `Batch` and its device inputs, for a prefill plan or a set of decoding requests.

Every integer a step needs (positions, KV slots, page-table writes, sample rows, a prefill's input ids)
is packed into one pinned buffer and copied to the device in one go. Building a batch also advances its
requests' lengths: what the step will compute counts as computed from here on."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from minisgl.core import Batch, Phase, Req
from minisgl.engine import DECODE_INPUTS, SamplingInfo
from minisgl.utils.device import HostRing

if TYPE_CHECKING:
    from .cache import CacheManager
    from .decode import DecodeManager
    from .grammar import GrammarManager
    from .prefill import PrefillPlan


class BatchBuilder:
    def __init__(
        self,
        cache: CacheManager,
        decode: DecodeManager,
        grammar: GrammarManager,
        device: torch.device,
        vocab_size: int,
        pooling: str,
    ) -> None:
        self.cache, self.decode, self.grammar = cache, decode, grammar
        self.device, self.vocab_size, self.pooling = device, vocab_size, pooling
        self.page_size = cache.page_size
        self._staging = HostRing(device)  # pinned buffers for the per-step host -> device copy

    def prefill(self, plan: PrefillPlan) -> Batch:
        """The prefill step of an admission plan; the requests whose prompt it completes join decode."""
        sample_mask = [
            p + e == len(r.token_ids) for r, p, e in zip(plan.reqs, plan.prefix_lens, plan.extend_lens)
        ]
        batch = Batch(plan.reqs, Phase.PREFILL, plan.prefix_lens, plan.extend_lens, sample_mask)
        # per-token parts as tensors (a prefill step can hold thousands of tokens)
        positions, input_ids, out_loc, pt_rows, pt_pos, pt_slots = [], [], [], [], [], []
        for req, prefix, extend in zip(plan.reqs, plan.prefix_lens, plan.extend_lens):
            end = prefix + extend
            positions.append(torch.arange(prefix, end, dtype=torch.int32))
            input_ids.append(np.asarray(req.token_ids[prefix:end], dtype=np.int32))
            slots = self.cache.slots_of(req.pages, end)
            out_loc.append(slots[prefix:])
            # the page-table row also needs the cached prefix when the request was just admitted
            start = req.table_len
            pt_rows.append(torch.full((end - start,), req.table_idx, dtype=torch.int32))
            pt_pos.append(torch.arange(start, end, dtype=torch.int32))
            pt_slots.append(slots[start:])
            req.table_len = end
        self._prompt_rows(batch)
        self._embed_rows(batch)
        ends = torch.tensor(plan.extend_lens).cumsum(0) - 1
        sampled = [i for i, s in enumerate(sample_mask) if s]
        prefill_parts = (
            torch.cat(pt_rows),
            torch.cat(pt_pos),
            torch.cat(pt_slots),
            [plan.reqs[i].table_idx for i in sampled],
            ends[sampled].to(torch.int32),
            torch.from_numpy(np.concatenate(input_ids)),
        )
        self.to_device(
            batch,
            torch.cat(positions),
            torch.cat(out_loc),
            [plan.prefix_lens[i] + plan.extend_lens[i] for i in sampled],
            prefill_parts,
        )
        for req, prefix, extend, s in zip(plan.reqs, plan.prefix_lens, plan.extend_lens, sample_mask):
            req.cached_len = prefix + extend
            req.device_len = req.cached_len + 1 if s else req.cached_len
            if s:
                self.decode.add(req)
        return batch

    def decode_step(self, reqs: list[Req]) -> Batch:
        """The decode step of `reqs`, each of which already holds the page its next position is in."""
        ps = self.page_size
        # longest context first: attention kernels start their programs in batch order, and a last wave
        # of short programs leaves less of the GPU idle at the end of the step than one of random lengths
        reqs.sort(key=lambda r: r.cached_len, reverse=True)
        positions = [r.cached_len for r in reqs]
        out_loc = [r.pages[p // ps] * ps + p % ps for r, p in zip(reqs, positions)]
        batch = Batch(reqs, Phase.DECODE, positions, [1] * len(reqs), [True] * len(reqs))
        for r in reqs:
            r.table_len = r.cached_len + 1
        self.to_device(batch, positions, out_loc, [p + 1 for p in positions])
        for r in reqs:
            r.cached_len += 1
            r.device_len += 1
        return batch

    def _prompt_rows(self, batch: Batch) -> None:
        """The rows of this prefill whose logits give prompt log-probabilities, and their targets (one small
        extra copy to the device: only batches that ask for them pay it)."""
        rows: list[range] = []
        targets: list[int] = []
        counts: list[int] = []
        offset = 0
        for req, prefix, extend in zip(batch.reqs, batch.prefix_lens, batch.extend_lens):
            want = req.prompt_lp_rows
            lo, hi = max(prefix, want.start), min(prefix + extend, want.stop)
            counts.append(max(0, hi - lo))
            if hi > lo:
                rows.append(range(offset + lo - prefix, offset + hi - prefix))
                targets += req.token_ids[lo + 1 : hi + 1]
                req.prompt_lp_next = hi + 1
            offset += extend
        if not rows:
            return
        flat = torch.cat([torch.arange(r.start, r.stop) for r in rows])
        batch.prompt_rows = flat.to(self.device, non_blocking=True)
        batch.prompt_targets = torch.tensor(targets, dtype=torch.int64).to(self.device, non_blocking=True)
        batch.prompt_top = max(r.sampling_params.prompt_logprobs or 0 for r in batch.reqs)
        batch.prompt_counts = counts

    def _embed_rows(self, batch: Batch) -> None:
        """The rows of this prefill that embedding requests pool (all for mean, the first for cls, the last
        for last), summed per request by the engine."""
        rows: list[torch.Tensor] = []
        seg: list[int] = []
        reqs: list[int] = []
        offset = 0
        for i, (req, prefix, extend) in enumerate(zip(batch.reqs, batch.prefix_lens, batch.extend_lens)):
            if req.sampling_params.embed:
                pooling = self.pooling
                lo, hi = offset, offset + extend  # mean: every row of the chunk
                if pooling == "cls":
                    hi = offset + 1 if prefix == 0 else offset
                elif pooling == "last":
                    lo = offset + extend - 1 if prefix + extend == req.prompt_len else hi
                if hi > lo:
                    rows.append(torch.arange(lo, hi))
                    seg += [len(reqs)] * (hi - lo)
                    reqs.append(i)
            offset += extend
        if reqs:
            batch.embed_rows = torch.cat(rows).to(self.device, non_blocking=True)
            batch.embed_seg = torch.tensor(seg, dtype=torch.int64).to(self.device, non_blocking=True)
            batch.embed_reqs = reqs

    def to_device(
        self,
        batch: Batch,
        positions,
        out_loc,
        sample_pos: list[int],
        prefill_parts: tuple | None = None,
        spec_parts: tuple | None = None,
    ) -> None:
        """Pack the step's integers (lists or int32 tensors) into one pinned buffer, copy it to the device
        in one go, and fill in the batch's device tensors. A prefill batch also brings `prefill_parts`:
        page-table (rows, positions, slots), sample rows, logits rows and input ids. A decode batch starts
        with its per-request rows in the decode graph's order (DECODE_INPUTS), equally long, so they form
        one [4, n] view for the graph runner; its page-table writes are (table_idx, positions, out_loc)
        and its input ids come from the token pool, both done by the engine. A verify step also brings
        `spec_parts`: the token-pool (rows, positions, ids) of its proposals."""
        table_idx = [r.table_idx for r in batch.reqs]
        rows = DECODE_INPUTS.ordered(
            positions=positions, out_loc=out_loc, table_idx=table_idx, seq_lens_t=batch.seq_lens
        )
        parts = [*rows, sample_pos, *(prefill_parts or ()), *(spec_parts or ())]
        # every part starts 16-byte aligned: Triton specialises kernels on pointer alignment, so a
        # part at a varying alignment would recompile kernels step after step
        dev, offsets = self._staging.pack(parts)
        views = [dev[off : off + len(p)] for off, p in zip(offsets, parts)]
        k = len(rows)
        DECODE_INPUTS.assign(batch, views[:k])
        batch.sample_pos = views[k]
        if prefill_parts is None:
            n, m = batch.size, offsets[1]
            batch.graph_inputs = dev[: k * m].view(k, m)[:, :n]
            batch.sample_table_idx = batch.table_idx
            if spec_parts is not None:
                w_rows, w_pos, w_ids = views[k + 1 :]
                batch.draft_writes = (w_rows, w_pos, w_ids)
        else:
            pt_rows, pt_pos, pt_slots, batch.sample_table_idx, lidx_t, batch.input_ids = views[k + 1 :]
            batch.pt_writes = (pt_rows, pt_pos, pt_slots)
            batch.logits_idx = lidx_t.long()
        sampled = [r for r, s in zip(batch.reqs, batch.sample_mask) if s]
        batch.sampling_info = SamplingInfo.build(sampled, sample_pos, self.vocab_size, self.device)
        batch.grammar_rows = self.grammar.rows(sampled)
