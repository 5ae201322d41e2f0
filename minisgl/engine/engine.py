"""The Engine: model + KV pool + page table + token pool + attention backend + sampler.

It computes; it never decides. The scheduler hands it a prepared Batch and gets the sampled tokens back
(on the device, plus an asynchronous copy to the host)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from minisgl import kernel
from minisgl.attention import AttnConfig, attends_sliding_windows, create_attn_backend, kv_cache_dtype
from minisgl.core import Batch
from minisgl.distributed import all_reduce_min, destroy_process_group, init_process_group, set_tp_info
from minisgl.gguf import stored
from minisgl.grammar import TokenMask, apply_token_mask
from minisgl.kvcache import KVPool
from minisgl.layers.context import Context, set_global_ctx
from minisgl.models import ModelConfig, create_model
from minisgl.models.resolve import resolve_model_path
from minisgl.moe import create_moe_backend
from minisgl.utils import init_logger
from minisgl.utils.device import (
    HostRing,
    is_cuda,
    keep_freed_memory,
    pick_device,
    set_cpu_threads,
    synchronize,
)
from minisgl.utils.hf import load_hf_config, pooling_of

from .config import EngineConfig
from .cpu_step import CpuDecodeStep
from .graph import DecodeGraphRunner, GraphDeps, PrefillGraphRunner, VerifyGraphRunner
from .sampler import Sampler
from .weight_loading import load_model_weights, resident_weight_bytes

logger = init_logger(__name__)


@dataclass
class ForwardOutput:
    next_tokens: torch.Tensor  # [num_sampled] int32 on the device
    next_tokens_host: torch.Tensor  # the same, copied asynchronously to (pinned) host memory
    copy_done: Any  # event: the host copy is complete once it is synchronised
    logprobs_host: tuple | None = None  # (chosen [S], top values [S, k] | None, top ids [S, k] | None)
    prompt_logprobs_host: tuple | None = None  # Batch.prompt_rows': target [R], rank [R], top values, ids
    embed_host: torch.Tensor | None = None  # [len(Batch.embed_reqs), hidden] float32 pooled sums

    def wait(self) -> None:
        self.copy_done.synchronize()


@dataclass
class Logits:
    """What `Engine.forward` launched: the sampled rows' logits [S, V] on the device, and a decode or
    verify graph's greedy tokens of them (already in the token pool) and its runner, None elsewhere."""

    logits: torch.Tensor
    greedy: torch.Tensor | None = None
    graphs: DecodeGraphRunner | None = None
    prompt: tuple | None = None  # Batch.prompt_rows reduced (prompt_logprobs), on the device
    embed: torch.Tensor | None = None  # Batch.embed_rows summed per embedding request, on the device


# rows of prompt logits computed at a time: [256, vocab] float32 at most (150 MB for 150k words), so a long
# prompt's log-probabilities never hold [prompt_len, vocab]
PROMPT_LOGPROB_ROWS = 256


def reduce_prompt_logprobs(
    hidden: torch.Tensor, rows: torch.Tensor, targets: torch.Tensor, top: int, compute_logits: Any
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """For each row of `hidden` in `rows`: the float32 log-probability of its target, the target's rank
    (1: the most likely) and the top `top` (values, ids); the logits of PROMPT_LOGPROB_ROWS rows at a time."""
    chosen, ranks, vals, ids = [], [], [], []
    for i in range(0, rows.numel(), PROMPT_LOGPROB_ROWS):
        block = slice(i, i + PROMPT_LOGPROB_ROWS)
        logp = torch.log_softmax(compute_logits(hidden[rows[block]]).float(), dim=-1)
        target = logp.gather(-1, targets[block, None])
        chosen.append(target.squeeze(-1))
        ranks.append((logp > target).sum(-1, dtype=torch.int32) + 1)
        v, k = logp.topk(top, dim=-1)
        vals.append(v)
        ids.append(k.to(torch.int32))
        del logp
    return torch.cat(chosen), torch.cat(ranks), torch.cat(vals), torch.cat(ids)


def _pick_dtype(hf_config, device: torch.device) -> torch.dtype:
    if device.type == "cpu":
        return torch.float32  # bf16 matmuls are several times slower than fp32 on most CPUs
    dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    return dtype if dtype in (torch.float16, torch.bfloat16) else torch.bfloat16


class Engine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        tp = config.tp_info
        set_tp_info(tp)
        self.device = self._pick_device()
        hf_config = self._read_model_config()
        init_process_group(tp.rank, tp.size, config.dist_init_method, self.device, config.dist_timeout)
        self.dtype = config.dtype or _pick_dtype(hf_config, self.device)
        self.max_seq_len = self._max_seq_len()
        self.moe_backend = (
            create_moe_backend(config.moe_backend, self.device) if self.model_config.moe else None
        )
        self._init_model()
        attn_cfg = self._attn_config()
        self._init_pools(attn_cfg)
        graphs = self._init_compute(attn_cfg)
        self.memory = self._report_memory(graphs)
        logger.info(
            f"Engine ready: {self.model_config.architecture} {self.dtype} on {self.device}, "
            f"{self.num_pages} pages x {config.page_size} tokens, max_seq_len {self.max_seq_len}, "
            f"attention {type(self.attn_backend).__name__}"
        )

    # ---- construction ----------------------------------------------------------------------------
    def _pick_device(self) -> torch.device:
        """This rank's device: its GPU (each node runs tp_size / nnodes ranks on its own GPUs), or the CPU
        with its share of the threads."""
        tp, nnodes = self.config.tp_info, self.config.nnodes
        device = pick_device(self.config.device)
        if is_cuda(device):
            local_rank = tp.rank % (tp.size // nnodes)
            device = torch.device("cuda", local_rank % torch.cuda.device_count())
            torch.cuda.set_device(device)
        else:
            threads = set_cpu_threads(tp.size // nnodes)
            keep_freed_memory()
            logger.info(f"CPU engine: {threads} threads")
        return device

    def _read_model_config(self) -> Any:
        """Resolve the model and read its config (`model_dir`, `model_config`, `pooling`); the HF config."""
        tp = self.config.tp_info
        self.model_dir = resolve_model_path(self.config.model_path, self.config.weights_format)
        hf_config = load_hf_config(self.model_dir)
        self.model_config = ModelConfig.from_hf(hf_config)
        self.pooling = pooling_of(self.model_dir, self.config.pooling)  # what an embedding request pools
        self.model_config.check_tp(tp.size, tp.ep_size)  # on every rank, before any rank waits for the others
        return hf_config

    def _init_model(self) -> None:
        """The model, its weights loaded, in eval mode."""
        config = self.config
        torch.manual_seed(config.seed)
        self.model = self._build_model()
        self.weight_bytes = load_model_weights(
            self.model, self.model_config, config, self.model_dir, self.device
        )
        self.model.eval()
        if config.stored_dot != "exact":  # how the stored weights' linear layers multiply (the kernels')
            stored.set_dot(self.model, config.stored_dot)

    def _init_compute(self, attn_cfg: AttnConfig) -> int:
        """The attention backend, this engine's Context, the sampler, the CUDA graphs and the CPU decode
        step; the bytes the graphs took (CUDA's pool growth while capturing)."""
        config = self.config
        self.attn_backend = create_attn_backend(config.attn, attn_cfg, self.kv_pool, self.page_table)
        self.ctx = Context(
            kv_pool=self.kv_pool,
            attn_backend=self.attn_backend,
            moe_backend=self.moe_backend,
        )
        set_global_ctx(self.ctx)
        fused = config.sampler == "fused" or (config.sampler == "auto" and is_cuda(self.device))
        self.sampler = Sampler(self.device, self.token_pool, fused=fused)
        self._host_tokens = HostRing(self.device)  # pinned buffers the sampled tokens are copied into
        self.graph_runner = self.prefill_graphs = self.verify_graphs = None
        before = torch.cuda.memory_reserved(self.device) if is_cuda(self.device) else 0
        self._init_graphs()
        graphs = torch.cuda.memory_reserved(self.device) - before if is_cuda(self.device) else 0
        self.cpu_step = None
        if self.device.type == "cpu" and config.cpu_decode_step == "auto":
            self.cpu_step = CpuDecodeStep.create(
                self.model, self.kv_pool, self.page_table, self.attn_backend, self.dtype, config.stored_dot
            )
        return graphs

    def _attn_config(self) -> AttnConfig:
        """This rank's share of the attention heads, and the sequence limits the backends plan for."""
        cfg, tp = self.model_config, self.config.tp_info
        return AttnConfig(
            num_heads=cfg.num_heads // tp.size,
            num_kv_heads=max(1, cfg.num_kv_heads // tp.size),
            head_dim=cfg.head_dim,
            max_seq_len=self.max_seq_len,
            device=self.device,
            dtype=self.dtype,
            windows=cfg.attn_windows,
        )

    def _init_pools(self, attn_cfg: AttnConfig) -> None:
        """The KV pool (as many pages as the memory holds), the page table and the token pool."""
        config, cfg = self.config, self.model_config
        self.kv_dtype = kv_cache_dtype(config.attn, self.device, self.dtype, config.kv_cache_dtype)
        self.num_pages = self._plan_pages(attn_cfg)
        # one page beyond num_pages: the dummy page that CUDA-graph padding writes
        pages, kv_heads = self.num_pages + 1, attn_cfg.num_kv_heads
        self.kv_pool = KVPool(
            cfg.num_layers, pages, config.page_size, kv_heads, cfg.head_dim, self.kv_dtype, self.device
        )
        rows = config.max_running_req + 1  # the last row is a dummy used to pad CUDA-graph batches
        self.page_table = torch.zeros(rows, self.max_seq_len, dtype=torch.int32, device=self.device)
        self.token_pool = torch.zeros(rows, self.max_seq_len, dtype=torch.int32, device=self.device)
        # graph padding reads the dummy row and writes its K/V into the first slot of the dummy page
        self.dummy_row, self.dummy_slot = config.max_running_req, self.num_pages * config.page_size
        self.page_table[self.dummy_row].fill_(self.dummy_slot)
        assert self.kv_pool.num_slots > self.dummy_slot, "the pool has one page beyond num_pages"

    def _max_seq_len(self) -> int:
        limit = self.model_config.max_position_embeddings
        window = max(self.model_config.attn_windows, default=0)
        if 0 < window < limit and not attends_sliding_windows(self.config.attn, self.device, self.dtype):
            limit = window  # within the window every key is visible: sliding changes nothing there
            if self.config.tp_info.is_primary():
                logger.info(
                    f"Sequences end at the model's attention window of {window} tokens "
                    f"(the {self.config.attn} attention backend does not slide; torch and cpu do)"
                )
        if self.config.max_seq_len_override:
            limit = min(limit, self.config.max_seq_len_override)
        return limit

    def _build_model(self) -> torch.nn.Module:
        """The model, its parameters allocated in the engine's dtype on its device (weights come next)."""
        if self.config.tp_info.is_primary():  # seconds for a large model, before the weights' progress bar
            logger.info(f"Building {self.model_config.architecture} ({self.dtype}) from {self.model_dir}")
        with torch.device(self.device):
            prev = torch.get_default_dtype()
            torch.set_default_dtype(self.dtype)
            try:
                return create_model(self.model_config)
            finally:
                torch.set_default_dtype(prev)

    def _plan_pages(self, attn_cfg: AttnConfig) -> int:
        cfg, page = self.model_config, self.config.page_size
        per_page = KVPool.bytes_per_page(
            cfg.num_layers, page, attn_cfg.num_kv_heads, cfg.head_dim, self.kv_dtype
        )
        if self.config.num_pages:
            num = self.config.num_pages
        elif is_cuda(self.device):
            free, total = torch.cuda.mem_get_info(self.device)
            # the budget counts this process's memory only, so that replicas sharing a GPU with
            # --mem-fraction 1/k each get their share whichever of them starts first
            own = torch.cuda.memory_reserved(self.device)
            budget = min(total * self.config.mem_fraction - own, free)
            num = int(max(0, budget - (1 << 30)) // per_page)  # 1 GiB: graphs, activations, sampling
            logger.info(
                f"Memory: {own / 2**30:.1f} GiB of weights, {free / 2**30:.1f} GiB free of "
                f"{total / 2**30:.1f} GiB; KV pool {num * per_page / 2**30:.1f} GiB"
            )
        else:
            num = self.config.cpu_kv_cache_bytes // per_page
        if not self.config.num_pages:  # every rank holds the same pages: as many as the fullest rank fits
            num = all_reduce_min(num)
        if num * page < self.max_seq_len // 8 or num < 2:
            raise ValueError(
                f"the KV pool holds only {num} pages of {page} tokens; give more memory or pages"
            )
        return num

    def _report_memory(self, graphs: int) -> dict[str, int]:
        """This rank's bytes of weights, KV pool and graph buffers (CUDA's pool growth while capturing),
        logged per rank."""
        weights = resident_weight_bytes(self.model)  # stored GGUF blocks too, tied matrices once
        kv = sum(t.numel() * t.element_size() for t in (self.kv_pool.k_buffer, self.kv_pool.v_buffer))
        memory = {"weights": weights, "kv_pool": kv, "graphs": graphs}
        tp = self.config.tp_info
        logger.info(
            f"Memory of rank {tp.rank}/{tp.size}: weights {weights / 2**30:.3f} GiB, "
            f"KV pool {kv / 2**30:.3f} GiB ({self.num_pages} pages), graphs {graphs / 2**30:.3f} GiB"
        )
        return memory

    def _init_graphs(self) -> None:
        cfg = self.config
        if is_cuda(self.device) and self.moe_backend is not None and not self.moe_backend.capturable:
            logger.info(f"CUDA graphs off: the {cfg.moe_backend} MoE backend synchronises with the host")
            return
        deps = GraphDeps(
            device=self.device,
            attn_backend=self.attn_backend,
            prepare_inputs=self.prepare_inputs,
            run_model=self._run_model,
            compute_logits=self.model.compute_logits,
            token_pool=self.token_pool,
            sample=kernel.sample if self.sampler.fused else None,
            dummy_row=self.dummy_row,
            dummy_slot=self.dummy_slot,
            show_progress=cfg.show_progress and cfg.tp_info.is_primary(),
        )
        self.graph_runner = DecodeGraphRunner.create(
            deps, max_bs=cfg.cuda_graph_max_bs, max_running_req=cfg.max_running_req
        )
        self.prefill_graphs = PrefillGraphRunner.create(
            deps,
            max_tokens=cfg.cuda_graph_max_prefill,
            max_prefill_length=cfg.max_prefill_length,
            max_running_req=cfg.max_running_req,
            graphs_off=cfg.cuda_graph_max_bs == 0,  # "graphs off" means decode and prefill
        )

    def capture_verify_graphs(self, max_rows: int) -> None:
        """Graphs for speculative verify steps of up to `max_rows` rows, where decode steps have graphs."""
        self.verify_graphs = VerifyGraphRunner.create(self.graph_runner, max_rows)

    # ---- compute ---------------------------------------------------------------------------------
    def prepare_inputs(self, batch: Batch) -> None:
        """The device side of a step's inputs: write the new page-table entries (a decode step's are
        (table_idx, positions, out_loc)) and read a decode step's input tokens from the token pool, where
        the previous step wrote them. Inside the decode graphs, so a replay does it too."""
        rows, pos, slots = batch.pt_writes or (batch.table_idx, batch.positions, batch.out_loc)
        self.page_table[rows, pos] = slots
        if batch.draft_writes is not None:  # a verify step: the proposals are its later rows' inputs
            rows, pos, ids = batch.draft_writes
            self.token_pool[rows, pos] = ids
        if batch.is_decode:
            batch.input_ids = self.token_pool[batch.table_idx, batch.positions]

    @torch.inference_mode()
    def forward_batch(self, batch: Batch) -> ForwardOutput:
        """Run the model on `batch`, sample, write the sampled tokens into the token pool, start the
        host copy. Returns immediately on a GPU (nothing here waits for the device)."""
        return self.sample(batch, self.forward(batch))

    @torch.inference_mode()
    def forward(self, batch: Batch) -> Logits:
        """The first half of `forward_batch`: launch the model on `batch` up to the sampled rows' logits
        (a decode graph also writes its greedy tokens into the token pool). The scheduler calls the
        halves apart when the batch has rows under a grammar: their masks need the previous step's tokens."""
        set_global_ctx(self.ctx)  # the layers read this engine's Context, even if another was built since
        for graphs in (self.graph_runner, self.verify_graphs):
            if graphs is not None and graphs.can_run(batch):
                out = graphs.replay(batch)  # the greedy tokens are in the token pool already
                return Logits(out.logits[: batch.size], out.tokens[: batch.size], graphs)
        prompt_rows = batch.prompt_rows
        eager = prompt_rows is not None or batch.embed_rows is not None  # a prefill graph keeps no hidden
        if not eager and self.prefill_graphs is not None and self.prefill_graphs.can_run(batch):
            return Logits(self.prefill_graphs.replay(batch))
        self.prepare_inputs(batch)
        self.attn_backend.prepare_metadata(batch)
        if self.cpu_step is not None and batch.is_decode:
            return Logits(self.model.compute_logits(self.cpu_step.run(batch)))
        hidden = self._run_model(batch)
        prompt = None
        if prompt_rows is not None:  # eager: a prefill graph ends at the sampled rows' logits
            assert batch.prompt_targets is not None
            prompt = reduce_prompt_logprobs(
                hidden, prompt_rows, batch.prompt_targets, batch.prompt_top, self.model.compute_logits
            )
        embed = None
        if batch.embed_rows is not None:
            assert batch.embed_seg is not None and batch.embed_reqs is not None
            embed = torch.zeros(
                len(batch.embed_reqs), hidden.shape[-1], dtype=torch.float32, device=hidden.device
            )
            embed.index_add_(0, batch.embed_seg, hidden[batch.embed_rows].float())
        hidden = hidden[batch.logits_idx] if batch.logits_idx is not None else hidden[: batch.size]
        return Logits(self.model.compute_logits(hidden), prompt=prompt, embed=embed)

    @torch.inference_mode()
    def sample(self, batch: Batch, fwd: Logits, mask: TokenMask | None = None) -> ForwardOutput:
        """The second half of `forward_batch`: sample from `fwd`'s logits (after `mask`, the allowed
        tokens of the rows under a grammar), write the tokens into the token pool, start the host copy."""
        info, logits = batch.sampling_info, fwd.logits
        if mask is not None:
            apply_token_mask(logits, mask)  # in place: the logprobs are those of the masked rows too
        if fwd.greedy is not None and info.all_greedy and mask is None:
            next_tokens = fwd.greedy
        elif fwd.graphs is not None and fwd.graphs.can_sample(info) and batch.draft_probs is None:
            # the batch's own sampling graph, over the decode graph's logits buffer (masked in place); a
            # verify step that checks drawn proposals samples eagerly (its q rows are no graph input)
            next_tokens = fwd.graphs.replay_sampling(batch, info)
        else:
            next_tokens = self._sample(logits, batch)
        buf, slot = self._host_tokens.take(next_tokens.numel())
        host = buf[: next_tokens.numel()]
        host.copy_(next_tokens, non_blocking=True)
        logprobs = None
        top = info.top_logprobs
        if top >= 0:
            logprobs = tuple(
                None if t is None else t.to("cpu", non_blocking=True)
                for t in self.sampler.logprobs(logits, next_tokens, top)
            )
        prompt = None
        if fwd.prompt is not None:  # copied before the event below, which then covers it
            prompt = tuple(t.to("cpu", non_blocking=True) for t in fwd.prompt)
        embed = fwd.embed.to("cpu", non_blocking=True) if fwd.embed is not None else None
        return ForwardOutput(next_tokens, host, self._host_tokens.used(slot), logprobs, prompt, embed)

    def _run_model(self, batch: Batch) -> torch.Tensor:
        """The model's final hidden states for a batch whose inputs and attention metadata are set."""
        with self.ctx.forward_batch(batch):
            return self.model()

    def _sample(self, logits: torch.Tensor, batch: Batch) -> torch.Tensor:
        if batch.is_prefill:  # its rows sample for the first time since admission: their tokens so far
            self.sampler.load_history(batch.sampling_info)  # enter the token pool, if penalties read them
        next_tokens = self.sampler.sample(logits, batch.sampling_info, batch.draft_probs)
        self.token_pool[batch.sample_table_idx, batch.sample_pos] = next_tokens
        return next_tokens

    def shutdown(self) -> None:
        synchronize(self.device)
        self.graph_runner = self.prefill_graphs = self.verify_graphs = self.cpu_step = None
        set_global_ctx(None)
        for name in ("model", "kv_pool", "page_table", "token_pool", "attn_backend", "ctx"):
            if hasattr(self, name):
                delattr(self, name)
        if is_cuda(self.device):
            torch.cuda.empty_cache()
        destroy_process_group()
