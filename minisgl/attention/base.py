"""The attention-backend interface. A backend stores the step's K/V into the pool and attends over
each request's whole sequence through the page table; its FusionPlan tells the attention layer
(layers/attention.py) which of attention's neighbours run inside its kernels for a batch."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from minisgl.kernel import Rope

if TYPE_CHECKING:
    from minisgl.core import Batch
    from minisgl.kvcache.pool import KVPool


@dataclass(frozen=True)
class FusionPlan:
    """Which neighbours of attention run inside another kernel for one batch: decided by the attention
    backend when it prepares the batch (BaseAttnBackend.fusion_plan) and read by the attention layer. All
    False: rotary, the KV store, attention and the output projection each run as written."""

    # attention takes q/k unrotated with the layer's Rope and rotates them (after Qwen3's q/k norm) and
    # stores the new K/V itself: no rotary or KV-store kernel runs before it
    rope_in_attention: bool = False
    # the rotary kernel writes the new K/V into the pool (attention reads every key from there)
    kv_store_in_rotary: bool = False
    # attention returns its KV splits unmerged (a kernel.SplitAttention) and the output projection's
    # kernel merges them as it reads its input
    merge_in_o_proj: bool = False
    # the decoder layer runs as one launch of the layer kernel (kernel.decode_layer), the backend giving
    # its attention inputs (layer_inputs); a layer the kernel does not serve ignores it and runs as above
    whole_layer: bool = False
    # every layer of the step runs as one launch of the decode-step kernel (kernel.decode_step), the backend
    # giving the pool and the batch's indices (step_inputs); a model the kernel does not serve runs as above
    whole_step: bool = False


UNFUSED = FusionPlan()


@dataclass
class AttnConfig:
    num_heads: int  # query heads on this rank
    num_kv_heads: int  # KV heads on this rank
    head_dim: int
    max_seq_len: int
    device: torch.device
    dtype: torch.dtype
    windows: tuple[int, ...] = ()  # each layer's attention window (0: full), () where no layer slides


class BaseAttnBackend(ABC):
    """Prepare once per batch, then run once per layer."""

    # whether the backend attends over a sliding window (AttnConfig.windows); without it, sequences end
    # at the window, within which sliding changes nothing
    sliding_window = False
    # whether its kernels store into and read from a float8 e4m3 KV pool (--kv-cache-dtype fp8_e4m3)
    supports_fp8_kv = False
    # the KV pool dtype its kernels read whatever the model's (None: the model's dtype)
    kv_dtype: torch.dtype | None = None
    # batch sizes whose decode step can run either way (the one-kernel step or the layers' own kernels)
    # with neither chosen yet: the decode graph runner times both as it captures the graph of each and keeps
    # the faster (choose_whole_step)
    whole_step_undecided: frozenset[int] = frozenset()

    def __init__(self, config: AttnConfig, kv_pool: KVPool, page_table: torch.Tensor) -> None:
        self.config = config
        self.kv_pool = kv_pool
        self.page_table = page_table  # [max_running_req, max_seq_len] int32: position -> KV slot
        self.scale = config.head_dim**-0.5

    def window(self, layer_id: int) -> int:
        """The keys a query of this layer sees: the last `window` positions up to its own (0: all)."""
        return self.config.windows[layer_id] if self.config.windows else 0

    @abstractmethod
    def prepare_metadata(self, batch: Batch) -> None:
        """Fill batch.attn_metadata from batch.table_idx, prefix/extend lengths (host and device)."""

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        layer_id: int,
        batch: Batch,
        rope: Rope | None = None,
    ):
        """Store k/v [T, Hkv, D] at batch.out_loc (k None: an earlier kernel stored them), then attend
        q [T, Hq, D] -> [T, Hq, D]. With `rope` (where the plan says rope_in_attention) q and k are not
        rotated yet and the backend rotates them (and stores the rotated k). Under the plan's
        merge_in_o_proj the result is a kernel.SplitAttention instead."""

    def fusion_plan(self, batch: Batch) -> FusionPlan:
        """How this batch's rotary, KV store, attention and output projection share kernels; fixed by
        prepare_metadata (or the graph hooks) for the batch."""
        return UNFUSED

    def layer_inputs(self, batch: Batch, layer_id: int) -> dict:
        """Under the plan's whole_layer: the attention arguments of kernel.decode_layer for this layer."""
        raise NotImplementedError(f"{type(self).__name__} does not run whole layers")

    def step_inputs(self, batch: Batch) -> dict:
        """Under the plan's whole_step: the pool and index arguments of kernel.decode_step."""
        raise NotImplementedError(f"{type(self).__name__} does not run whole steps")

    def choose_whole_step(self, size: int, on: bool) -> None:
        """Plan decode steps of `size` requests as the one-kernel step (on) or as the layers' own kernels
        from now on (a size in whole_step_undecided)."""
        raise NotImplementedError(f"{type(self).__name__} does not run whole steps")

    # CUDA-graph hooks (decode only). A backend without graph support keeps these defaults.
    def init_capture_graph(self, max_bs: int, capture_bs: list[int]) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not support CUDA graphs")

    def prepare_for_capture(self, batch: Batch) -> None:
        raise NotImplementedError

    def prepare_for_replay(self, batch: Batch) -> None:
        raise NotImplementedError

    # CUDA-graph hooks (prefill): batches of up to max_reqs requests padded to a captured token count
    def init_prefill_graph(self, max_tokens: int, max_reqs: int) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not support prefill CUDA graphs")

    def prepare_prefill_capture(self, batch: Batch, num_tokens: int) -> None:
        raise NotImplementedError

    def prepare_prefill_replay(self, batch: Batch) -> None:
        raise NotImplementedError


class HybridBackend(BaseAttnBackend):
    """`--attn prefill_name,decode_name`: one backend for prefill batches, another for decode."""

    def __init__(self, prefill: BaseAttnBackend, decode: BaseAttnBackend) -> None:
        self.prefill, self.decode = prefill, decode
        self.config = decode.config
        self.sliding_window = prefill.sliding_window and decode.sliding_window
        self.supports_fp8_kv = prefill.supports_fp8_kv and decode.supports_fp8_kv
        self.kv_dtype = prefill.kv_dtype or decode.kv_dtype

    def _pick(self, batch: Batch) -> BaseAttnBackend:
        return self.decode if batch.is_decode else self.prefill

    def prepare_metadata(self, batch: Batch) -> None:
        self._pick(batch).prepare_metadata(batch)

    def forward(self, q, k, v, layer_id, batch, rope=None):
        return self._pick(batch).forward(q, k, v, layer_id, batch, rope)

    def fusion_plan(self, batch: Batch) -> FusionPlan:
        return self._pick(batch).fusion_plan(batch)

    def layer_inputs(self, batch: Batch, layer_id: int) -> dict:
        return self._pick(batch).layer_inputs(batch, layer_id)

    def step_inputs(self, batch: Batch) -> dict:
        return self._pick(batch).step_inputs(batch)

    def init_capture_graph(self, max_bs: int, capture_bs: list[int]) -> None:
        self.decode.init_capture_graph(max_bs, capture_bs)

    def prepare_for_capture(self, batch: Batch) -> None:
        self.decode.prepare_for_capture(batch)

    def prepare_for_replay(self, batch: Batch) -> None:
        self.decode.prepare_for_replay(batch)

    def init_prefill_graph(self, max_tokens: int, max_reqs: int) -> None:
        self.prefill.init_prefill_graph(max_tokens, max_reqs)

    def prepare_prefill_capture(self, batch: Batch, num_tokens: int) -> None:
        self.prefill.prepare_prefill_capture(batch, num_tokens)

    def prepare_prefill_replay(self, batch: Batch) -> None:
        self.prefill.prepare_prefill_replay(batch)
