"""The graph runners: decode replay equals the eager forward, batches are padded to a captured size, every
input is copied before each replay, and padding rows write nothing but the dummy KV slot; when each
runner is off. A verify step (rows of one request checking proposals) replays its own graph and equals its
eager forward.

On a CPU the graphs are emulated (their replay reads only the fixed input buffers, like a CUDA graph), with
the torch backend (metadata recomputed from the buffers at replay) and with the Triton backend (its own
graph hooks) under TRITON_INTERPRET=1. On a CUDA host the same tests capture real CUDA graphs (Triton)."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

if not torch.cuda.is_available():  # must be set before Triton is first imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

from minisgl.attention import BaseAttnBackend
from minisgl.core import Batch, Phase, Req, SamplingParams
from minisgl.engine import DECODE_INPUTS, Engine, EngineConfig, SamplingInfo
from minisgl.engine.graph import (
    DecodeGraphRunner,
    PrefillGraphRunner,
    VerifyGraphRunner,
    capture_sizes,
    prefill_sizes,
)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

PAGE = 4
MAX_SEQ = 64
NUM_PAGES = 48
VOCAB = 101
MAX_BS = 4  # captured sizes 1, 2, 4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    from transformers import LlamaConfig

    path = tmp_path_factory.mktemp("graph_model")
    LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=MAX_SEQ,
        architectures=["LlamaForCausalLM"],
    ).save_pretrained(path)
    return str(path)


def _attn_backends():
    backends = ["torch"] if DEVICE.type == "cpu" else []  # torch attention cannot be captured on a GPU
    try:
        import minisgl.attention.triton_backend  # noqa: F401

        backends.append("triton")
    except ImportError:
        pass
    return backends


@pytest.fixture(scope="module", params=_attn_backends())
def engine(request, model_dir):
    """An engine with graphs captured for 1, 2 and 4 requests (one engine per process)."""
    config = EngineConfig(
        model_path=model_dir,
        dtype=torch.float32,
        device=DEVICE.type,
        attn=request.param,
        load_format="dummy",
        page_size=PAGE,
        num_pages=NUM_PAGES,
        max_running_req=8,
        max_seq_len_override=MAX_SEQ,
        cuda_graph_max_bs=MAX_BS,
        show_progress=False,
    )
    eng = Engine(config)
    # weights far larger than the dummy init, so every input visibly changes the hidden states
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in eng.model.named_parameters():
            if not name.endswith("norm.weight"):
                p.copy_(torch.randn(p.shape, generator=g).to(DEVICE) * 0.3)
    try:
        yield eng
    finally:
        eng.shutdown()


@pytest.fixture
def runner(engine) -> DecodeGraphRunner:
    """The engine's runner, with a freshly randomised KV pool (the prefixes the requests attend to)."""
    g = torch.Generator().manual_seed(1)
    engine.kv_pool.k_buffer.copy_(torch.randn(engine.kv_pool.k_buffer.shape, generator=g).to(DEVICE))
    engine.kv_pool.v_buffer.copy_(torch.randn(engine.kv_pool.v_buffer.shape, generator=g).to(DEVICE))
    assert engine.graph_runner is not None
    return engine.graph_runner


def decode_batch(engine: Engine, rows, seq_lens, first_page: int, seed: int) -> Batch:
    """A decode step of requests in page-table `rows` with `seq_lens` keys (the new token included); each
    request owns consecutive pages from `first_page` on. Fills the page table like the scheduler does."""
    g = torch.Generator().manual_seed(seed)
    out_loc, page = [], first_page
    for row, n in zip(rows, seq_lens):
        num = -(-n // PAGE)
        slots = torch.arange(page * PAGE, (page + num) * PAGE, dtype=torch.int32)[:n]
        page += num
        engine.page_table[row, :n] = slots.to(DEVICE)
        out_loc.append(int(slots[-1]))
    assert page <= NUM_PAGES, "the test must not use the dummy page"
    reqs = [Req(i, [0], SamplingParams()) for i in range(len(rows))]
    batch = Batch(reqs, Phase.DECODE, [n - 1 for n in seq_lens], [1] * len(rows), [True] * len(rows))
    batch.positions = torch.tensor([n - 1 for n in seq_lens], dtype=torch.int32, device=DEVICE)
    # a decode step's input token is where the previous step left it: in the token pool
    ids = torch.randint(0, VOCAB, (len(rows),), generator=g, dtype=torch.int32).to(DEVICE)
    engine.token_pool[torch.tensor(rows, device=DEVICE), batch.positions] = ids
    batch.out_loc = torch.tensor(out_loc, dtype=torch.int32, device=DEVICE)
    batch.table_idx = torch.tensor(rows, dtype=torch.int32, device=DEVICE)
    batch.seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    return batch


@torch.inference_mode()
def eager(engine: Engine, batch: Batch) -> torch.Tensor:
    """The un-captured forward, as Engine.forward_batch runs it without graphs."""
    engine.prepare_inputs(batch)
    engine.attn_backend.prepare_metadata(batch)
    with engine.ctx.forward_batch(batch):
        return engine.model().clone()


@torch.inference_mode()
def replay(runner: DecodeGraphRunner, batch: Batch) -> torch.Tensor:
    return runner.replay(batch).hidden.clone()


# Batches A and B differ in every input: rows, lengths, KV slots, tokens (hence positions too).
def batch_a(engine: Engine) -> Batch:
    return decode_batch(engine, rows=[0, 1, 2, 3], seq_lens=[5, 9, 17, 30], first_page=0, seed=10)


def batch_b(engine: Engine) -> Batch:
    return decode_batch(engine, rows=[4, 5, 6, 7], seq_lens=[7, 12, 3, 21], first_page=20, seed=11)


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_capture_sizes_cover_every_batch_size_up_to_the_max():
    sizes = capture_sizes(256)
    assert sizes[:6] == [1, 2, 4, 8, 16, 24] and sizes[-1] == 256 and sizes == sorted(set(sizes))
    assert capture_sizes(5) == [1, 2, 4, 5]
    assert capture_sizes(1) == [1]
    assert capture_sizes(130)[-3:] == [120, 128, 130]


def test_prefill_sizes_double_to_1024_then_step_by_1024_up_to_the_limit():
    assert prefill_sizes(8192) == [16, 32, 64, 128, 256, 512, 1024, 2048, 3072, 4096, 5120, 6144, 7168, 8192]
    assert prefill_sizes(100) == [16, 32, 64, 100]
    assert prefill_sizes(2500) == [16, 32, 64, 128, 256, 512, 1024, 2048, 2500]


def _deps(device: str, backend=None) -> SimpleNamespace:
    """The part of GraphDeps that deciding whether a runner is built reads."""
    return SimpleNamespace(device=torch.device(device), attn_backend=backend)


def test_prefill_graphs_are_off_on_a_cpu_by_default_when_disabled_and_for_backends_without_hooks():
    def create(device, backend=None, max_tokens=None, graphs_off=False):
        return PrefillGraphRunner.create(
            _deps(device, backend), max_tokens, 8192, max_running_req=256, graphs_off=graphs_off
        )

    assert create("cpu") is None
    assert create("cpu", max_tokens=0) is None
    assert create("cuda", max_tokens=0) is None
    assert create("cuda", graphs_off=True) is None  # cuda_graph_max_bs 0: "graphs off" means both
    no_hooks = SimpleNamespace(init_prefill_graph=BaseAttnBackend.init_prefill_graph.__get__(object()))
    assert create("cuda", no_hooks) is None  # e.g. the torch backend on a GPU


def test_graphs_are_off_when_disabled_on_a_cpu_by_default_and_for_backends_without_hooks():
    assert DecodeGraphRunner.create(_deps("cpu"), None, max_running_req=256) is None
    assert DecodeGraphRunner.create(_deps("cpu"), 0, max_running_req=256) is None
    assert DecodeGraphRunner.create(_deps("cuda"), 0, max_running_req=256) is None
    no_hooks = SimpleNamespace(init_capture_graph=BaseAttnBackend.init_capture_graph.__get__(object()))
    assert DecodeGraphRunner.create(_deps("cuda", no_hooks), 8, max_running_req=256) is None  # torch on a GPU


def test_the_engine_passes_its_graph_options_to_the_runners(engine, monkeypatch):
    """cuda_graph_max_bs 0 turns the prefill graphs off too; the other options reach create() as given."""
    seen = {}
    monkeypatch.setattr(DecodeGraphRunner, "create", lambda deps, **kw: seen.setdefault("decode", kw))
    monkeypatch.setattr(PrefillGraphRunner, "create", lambda deps, **kw: seen.setdefault("prefill", kw))
    saved = engine.config, engine.graph_runner, engine.prefill_graphs
    try:
        engine.config = EngineConfig(
            cuda_graph_max_bs=0, cuda_graph_max_prefill=32, max_prefill_length=512, max_running_req=8
        )
        engine._init_graphs()
    finally:
        engine.config, engine.graph_runner, engine.prefill_graphs = saved
    assert seen["decode"] == {"max_bs": 0, "max_running_req": 8}
    assert seen["prefill"] == {
        "max_tokens": 32,
        "max_prefill_length": 512,
        "max_running_req": 8,
        "graphs_off": True,
    }


def test_replay_equals_eager_and_pads_to_the_captured_size(engine, runner):
    assert runner.sizes == [1, 2, 4]
    for n, padded in [(1, 1), (3, 4)]:
        batch = decode_batch(engine, rows=list(range(n)), seq_lens=[6, 19, 33][:n], first_page=0, seed=n)
        want = eager(engine, batch)
        assert runner.can_run(batch)
        got = replay(runner, batch)
        assert batch.padded_size == padded and got.shape[0] == padded
        _close(got[:n], want)


def kv_state(engine: Engine) -> torch.Tensor:
    return torch.stack([engine.kv_pool.k_buffer, engine.kv_pool.v_buffer]).clone()


def set_kv_state(engine: Engine, state: torch.Tensor) -> None:
    engine.kv_pool.k_buffer.copy_(state[0])
    engine.kv_pool.v_buffer.copy_(state[1])


def eager_from(engine: Engine, batch: Batch, state: torch.Tensor):
    """Eager hidden states and KV pool after running `batch` from KV `state`; the pool is left at `state`."""
    set_kv_state(engine, state)
    hidden = eager(engine, batch)
    after = kv_state(engine)
    set_kv_state(engine, state)
    return hidden, after


def test_replay_reads_the_new_inputs_of_every_step(engine, runner):
    a, b = batch_a(engine), batch_b(engine)
    start = kv_state(engine)
    want_a, _ = eager_from(engine, a, start)
    want_b, kv_b = eager_from(engine, b, start)
    assert (want_a - want_b).abs().max() > 0.1
    _close(replay(runner, a), want_a)
    set_kv_state(engine, start)
    _close(replay(runner, b), want_b)
    _close(kv_state(engine), kv_b)


@pytest.mark.parametrize("field", DECODE_INPUTS.fields)
def test_every_input_buffer_is_read_by_the_graph(engine, runner, field):
    """Buffer discipline: each fixed input row is what the graph reads, so a row left at the previous
    step's value (batch A's, as if its copy had been skipped) makes either the hidden states or the KV
    written (a stale out_loc writes the previous step's slots) come out wrong."""
    a, b = batch_a(engine), batch_b(engine)
    replay(runner, a)
    start = kv_state(engine)
    want_b, want_kv = eager_from(engine, b, start)
    stale = {f: getattr(a if f == field else b, f) for f in DECODE_INPUTS.fields}
    b.graph_inputs = torch.stack(DECODE_INPUTS.ordered(**stale))
    got_b = replay(runner, b)
    hidden_error = (got_b[:4] - want_b).abs().max()
    kv_error = (kv_state(engine) - want_kv).abs().max()
    assert max(hidden_error, kv_error) > 1e-3, f"skipping the {field} copy went unnoticed"


def test_padding_rows_write_only_the_dummy_slot(engine, runner):
    """After a batch of 4, a batch of 3 is padded to 4: the 4th row must not replay the old request
    (whose KV slot may belong to someone else by now) but write the dummy slot."""
    a = batch_a(engine)
    replay(runner, a)
    stale_slot = int(a.out_loc[3])
    engine.kv_pool.k_buffer[:, stale_slot] = 0  # the slot was freed and reused meanwhile
    before_k, before_v = engine.kv_pool.k_buffer.clone(), engine.kv_pool.v_buffer.clone()
    c = decode_batch(engine, rows=[5, 6, 7], seq_lens=[4, 11, 26], first_page=30, seed=12)
    got = replay(runner, c)
    assert c.padded_size == 4
    changed = (
        ((engine.kv_pool.k_buffer != before_k) | (engine.kv_pool.v_buffer != before_v)).flatten(2).any(-1)
    )
    written = set(changed.any(0).nonzero().flatten().tolist())
    assert written <= set(c.out_loc.tolist()) | {runner.dummy_slot}
    assert runner.dummy_slot == NUM_PAGES * PAGE  # the page beyond num_pages, which the scheduler never owns
    _close(got[:3], eager(engine, c))


def test_engine_forward_batch_replays_decode_and_samples_like_eager(engine, runner, monkeypatch):
    calls = []
    real_replay = runner.replay
    monkeypatch.setattr(runner, "replay", lambda batch: calls.append(batch.size) or real_replay(batch))
    batch = decode_batch(engine, rows=[1, 2, 3], seq_lens=[8, 15, 2], first_page=0, seed=13)
    batch.sample_table_idx, batch.sample_pos = batch.table_idx, batch.positions + 1
    batch.sampling_info = SamplingInfo(all_greedy=True)
    with torch.inference_mode():
        want = engine.model.compute_logits(eager(engine, batch)).argmax(-1).to(torch.int32)
    out = engine.forward_batch(batch)
    assert calls == [3]
    assert torch.equal(out.next_tokens, want)
    prefill = Batch(batch.reqs, Phase.PREFILL, [0] * 3, [1] * 3, [True] * 3)
    assert not runner.can_run(prefill)


def test_a_penalised_greedy_batch_replaces_the_graphs_argmax(engine, runner):
    """The graph writes the raw argmax; a greedy batch with logit_bias or penalties samples again from the
    graph's logits, and its tokens (in the output and in the token pool) are the penalised argmax."""
    seq_lens, rows = [8, 15, 2], [1, 2, 3]
    batch = decode_batch(engine, rows=rows, seq_lens=seq_lens, first_page=0, seed=14)
    batch.sample_table_idx, batch.sample_pos = batch.table_idx, batch.positions + 1
    with torch.inference_mode():
        raw = engine.model.compute_logits(eager(engine, batch))
    top = raw.argmax(-1).tolist()
    # row 0: bias its argmax away; row 1: its argmax generated once before (pool row 2, position 5); row 2: plain
    engine.token_pool[2, :14] = (top[1] + 1) % VOCAB
    engine.token_pool[2, 5] = top[1]
    params = [
        SamplingParams(logit_bias={top[0]: -100.0}),
        SamplingParams(presence_penalty=2.0, frequency_penalty=2.0, repetition_penalty=50.0),
        SamplingParams(),
    ]
    reqs = [
        Req(i, [0] * n, p, prompt_len=1, table_idx=r)
        for i, (p, n, r) in enumerate(zip(params, seq_lens, rows))
    ]
    batch.reqs = reqs
    batch.sampling_info = SamplingInfo.build(reqs, seq_lens, VOCAB, DEVICE)
    assert not batch.sampling_info.all_greedy
    want = raw.clone()
    want[0, top[0]] -= 100.0
    x = want[1, top[1]]
    want[1, top[1]] = (x / 50.0 if x > 0 else x * 50.0) - 2.0 * 1 - 2.0
    x = want[1, (top[1] + 1) % VOCAB]  # seen in the prompt and 12 times in the output
    want[1, (top[1] + 1) % VOCAB] = (x / 50.0 if x > 0 else x * 50.0) - 2.0 * 12 - 2.0
    want = want.argmax(-1).to(torch.int32)
    assert want[0] != top[0] and want[1] != top[1] and want[2] == top[2]
    out = engine.forward_batch(batch)
    assert torch.equal(out.next_tokens, want)
    assert torch.equal(engine.token_pool[batch.table_idx, batch.sample_pos], want)


# ---- verify graphs ------------------------------------------------------------------------------------
def verify_batch(engine: Engine, proposals: list[int], seed: int) -> Batch:
    """A verify step as the scheduler builds one: request A (page-table row 0, 6 tokens cached before its
    rows) checks `proposals` in the rows after its last token, request B (row 1, 10 cached) none; a
    request's rows share its page-table row and write the proposals into the token pool where the next
    row reads its input."""
    g = torch.Generator().manual_seed(seed)
    reqs, positions, out_loc, rows, drafts, page = [], [], [], [], [], 0
    for row, (cached, mine) in enumerate([(6, proposals), (10, [])]):
        n = cached + len(mine) + 1
        slots = torch.arange(page * PAGE, page * PAGE + n, dtype=torch.int32)
        page += -(-n // PAGE)
        engine.page_table[row, :n] = slots.to(DEVICE)
        engine.token_pool[row, cached] = int(torch.randint(0, VOCAB, (1,), generator=g))
        req = Req(row, [0], SamplingParams())
        for p in range(cached, n):
            reqs.append(req)
            positions.append(p)
            out_loc.append(int(slots[p]))
            rows.append(row)
        drafts += [*mine, -1]
    batch = Batch(reqs, Phase.DECODE, positions, [1] * len(reqs), [True] * len(reqs))
    batch.drafts = drafts

    def dev(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int32, device=DEVICE)

    batch.positions, batch.out_loc, batch.table_idx = dev(positions), dev(out_loc), dev(rows)
    batch.seq_lens_t = dev([p + 1 for p in positions])
    has = [t >= 0 for t in drafts]
    batch.draft_writes = (
        dev([r if h else engine.dummy_row for r, h in zip(rows, has)]),
        dev([p + 1 if h else 0 for p, h in zip(positions, has)]),
        dev([t if h else 0 for t, h in zip(drafts, has)]),
    )
    return batch


@pytest.fixture(scope="module")
def verify_runner(engine) -> VerifyGraphRunner:
    engine.capture_verify_graphs(3)  # rows 1, 2 and 4: the decode sizes up to the first that holds 3
    assert engine.verify_graphs is not None
    return engine.verify_graphs


def test_verify_steps_replay_their_own_graph_and_equal_eager(engine, runner, verify_runner):
    """A verify step of 3 rows (padded to 4) then one of 4 with other proposals: each replay equals the
    eager forward of the same step (so the proposals, read from the graph's fixed buffer, are the inputs of
    the rows after them), and the KV pool ends the same but for the dummy slot; the decode graphs do not take a verify step."""
    assert verify_runner.sizes == [1, 2, 4]
    start = kv_state(engine)
    for proposals, padded in [([7], 4), ([50, 60], 4)]:
        batch = verify_batch(engine, proposals, seed=len(proposals))
        assert verify_runner.can_run(batch) and not runner.can_run(batch)
        want, want_kv = eager_from(engine, batch, start)
        w_rows, w_pos, _ = (t.long() for t in batch.draft_writes)
        engine.token_pool[w_rows, w_pos] = 0  # the replay must put the proposals there itself
        got = replay(verify_runner, batch)
        assert batch.padded_size == padded
        _close(got[: batch.size], want)
        real = slice(
            0, verify_runner.dummy_slot
        )  # padding rows write the dummy slot, the eager step does not
        _close(kv_state(engine)[:, :, real], want_kv[:, :, real])
        set_kv_state(engine, start)
    plain = batch_a(engine)
    assert runner.can_run(plain) and not verify_runner.can_run(plain)
