"""The Scheduler: radix prefix sharing, chunked prefill, overlap scheduling, queueing and retraction,
aborts, and the KV integrity check, all compared with Hugging Face greedy or a hand count.

Every test ends with the integrity check: every page free or held by the prefix cache, no slot taken."""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from helpers import (
    TINY_SPECS,
    assert_all_kv_free,
    assert_tokens_equal_hf,
    make_llm,
    random_prompt,
    tiny_llm_kwargs,
)

from minisgl.core import FinishReason, Phase, SamplingParams
from minisgl.engine import DECODE_INPUTS

ARCH = "llama"
VOCAB = TINY_SPECS[ARCH].config_kwargs["vocab_size"]


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True)


def shared_prefix_prompts(prefix_len: int, suffix_lens: list[int], seed: int = 0) -> list[list[int]]:
    prefix = random_prompt(prefix_len, VOCAB, seed)
    return [prefix + random_prompt(n, VOCAB, seed + 1 + i) for i, n in enumerate(suffix_lens)]


def record_batches(llm) -> list[tuple[str, list[int]]]:
    """Spy on the engine: (phase, extend length per request) of every batch it computes."""
    seen: list[tuple[str, list[int]]] = []
    engine = llm.scheduler.engine
    forward = engine.forward_batch

    def spy(batch):
        seen.append((batch.phase, list(batch.extend_lens)))
        return forward(batch)

    engine.forward_batch = spy
    return seen


def run(model_dir: str, prompts, params, batches=None, **kwargs) -> tuple[list[list[int]], dict[str, float]]:
    """Generate with a fresh LLM; returns the token ids and the stats, after checking no KV leaked.
    `batches`, a list, receives what record_batches saw."""
    with make_llm(model_dir, **tiny_llm_kwargs(**kwargs)) as llm:
        seen = record_batches(llm)
        outs = llm.generate(prompts, params)
        assert_all_kv_free(llm)
        if batches is not None:
            batches.extend(seen)
        return [o["token_ids"] for o in outs], llm.stats()


# ---- radix prefix cache -----------------------------------------------------------------------------
SUFFIXES = [3, 9, 1, 14, 6, 11, 2, 8]


@pytest.mark.parametrize("page_size", [1, 4])
def test_shared_prefix_is_computed_once(tiny_model_dirs, hf_reference, page_size):
    """8 requests sharing a 256-token prefix, submitted together: the prefix is computed once."""
    prompts = shared_prefix_prompts(256, SUFFIXES)
    outs, stats = run(tiny_model_dirs[ARCH], prompts, greedy(12), page_size=page_size)
    assert stats["prompt_tokens"] == sum(len(p) for p in prompts)
    assert stats["computed_prompt_tokens"] == 256 + sum(SUFFIXES)
    assert stats["cached_prompt_tokens"] == 7 * 256
    for p, o in list(zip(prompts, outs))[:3]:
        assert_tokens_equal_hf(o, hf_reference(ARCH), p, what=f"shared prefix + {len(p) - 256}")


@pytest.mark.parametrize("page_size", [1, 4])
def test_shared_prefix_across_calls_is_served_from_cache(tiny_model_dirs, page_size):
    """A prefix computed by an earlier call is read from the cache (page-aligned) by later ones."""
    prompts = shared_prefix_prompts(256, SUFFIXES, seed=7)
    with make_llm(tiny_model_dirs[ARCH], **tiny_llm_kwargs(page_size=page_size)) as llm:
        first = llm.generate(prompts[:1], greedy(8))
        before = llm.stats()
        rest = llm.generate(prompts[1:], greedy(8))
        after = llm.stats()
        served = after["cached_prompt_tokens"] - before["cached_prompt_tokens"]
        assert served >= 7 * (256 // page_size * page_size)
        assert (
            after["computed_prompt_tokens"] - before["computed_prompt_tokens"]
            == sum(len(p) for p in prompts[1:]) - served
        )
        assert_all_kv_free(llm)
    naive, _ = run(tiny_model_dirs[ARCH], prompts, greedy(8), cache_type="naive", page_size=page_size)
    assert [o["token_ids"] for o in first + rest] == naive


@pytest.mark.parametrize("page_size", [1, 4])
def test_radix_and_naive_give_identical_outputs(tiny_model_dirs, page_size):
    prompts = shared_prefix_prompts(40, [5, 20, 1, 33], seed=1) + shared_prefix_prompts(9, [2, 30], seed=2)
    prompts += prompts[:2]  # exact repeats
    params = [greedy(n) for n in (20, 5, 31, 12, 8, 17, 20, 3)]
    radix, radix_stats = run(tiny_model_dirs[ARCH], prompts, params, cache_type="radix", page_size=page_size)
    naive, naive_stats = run(tiny_model_dirs[ARCH], prompts, params, cache_type="naive", page_size=page_size)
    assert radix == naive
    assert naive_stats["cached_prompt_tokens"] == 0
    assert radix_stats["cached_prompt_tokens"] > 0
    assert (
        radix_stats["computed_prompt_tokens"]
        < naive_stats["computed_prompt_tokens"]
        == sum(len(p) for p in prompts)
    )


# ---- chunked prefill --------------------------------------------------------------------------------
def test_chunked_prefill_equals_unchunked_and_hf(tiny_model_dirs, hf_reference):
    """A 1,000-token prompt with a 64-token budget, beside short requests that decode meanwhile."""
    long_prompt = random_prompt(1000, VOCAB, seed=11)
    prompts = [random_prompt(6, VOCAB, seed=12), long_prompt, random_prompt(70, VOCAB, seed=13)]
    params = [greedy(40), greedy(16), greedy(24)]
    batches: list[tuple[str, list[int]]] = []
    chunked, stats = run(tiny_model_dirs[ARCH], prompts, params, batches=batches, max_prefill_length=64)
    whole, _ = run(tiny_model_dirs[ARCH], prompts, params, max_prefill_length=4096)
    assert chunked == whole
    prefill_steps = [lens for phase, lens in batches if phase == Phase.PREFILL]
    assert max(sum(lens) for lens in prefill_steps) <= 64
    assert len(prefill_steps) >= 1000 // 64
    # while the short request decodes, each chunk is followed by its decode step: no two prefill steps in
    # a row, so the long prompt delays its stream by one chunk at a time
    phases = [phase for phase, _ in batches]
    last_chunk = len(phases) - 1 - phases[::-1].index(Phase.PREFILL)
    assert all(not (a == b == Phase.PREFILL) for a, b in itertools.pairwise(phases[: last_chunk + 1]))
    assert stats["computed_prompt_tokens"] == sum(len(p) for p in prompts)
    assert_tokens_equal_hf(chunked[1], hf_reference(ARCH), long_prompt, what="1000-token chunked prompt")
    assert_tokens_equal_hf(chunked[2], hf_reference(ARCH), prompts[2], what="70-token prompt")


def test_a_long_prompt_arriving_while_others_decode_is_cut_into_small_cpu_chunks(
    tiny_model_dirs, hf_reference
):
    """On a CPU, a prompt that arrives while requests decode is computed in chunks paced to a fraction of
    a second each (the default budget is far larger): FIRST_TOKENS first, then what the measured pace
    allows, each chunk followed by a decode step; alone, a prompt still takes the whole budget. Both
    requests' tokens equal HF."""
    from minisgl.scheduler.pacing import FIRST_TOKENS, MAX_TOKENS, MIN_TOKENS

    long_prompt = random_prompt(1100, VOCAB, seed=21)
    short = random_prompt(5, VOCAB, seed=22)
    with make_llm(tiny_model_dirs[ARCH], **tiny_llm_kwargs(num_page_override=8192)) as llm:
        sched = llm.scheduler
        sched.pacer.seconds_per_unit = None  # as a new scheduler (the warm-up measured a pace)
        seen = record_batches(llm)
        sched.add_request(1, short, greedy(60))
        tokens: dict[int, list[int]] = {1: [], 2: []}
        for _ in range(3):  # the short request is decoding
            for out in sched.step():
                tokens[out.uid].append(out.token_id)
        first = len(seen)
        sched.add_request(2, long_prompt, greedy(4))
        while sched.has_work:
            for out in sched.step():
                tokens[out.uid].append(out.token_id)
        assert_all_kv_free(llm)
    prefills = [sum(lens) for phase, lens in seen[first:] if phase == Phase.PREFILL]
    assert prefills[0] == FIRST_TOKENS and sum(prefills) == len(long_prompt)
    assert all(MIN_TOKENS <= n <= MAX_TOKENS for n in prefills[:-1]) and len(prefills) > 1
    phases = [phase for phase, _ in seen[first:]]
    last = len(phases) - 1 - phases[::-1].index(Phase.PREFILL)
    assert all(not (a == b == Phase.PREFILL) for a, b in itertools.pairwise(phases[: last + 1]))
    assert_tokens_equal_hf(tokens[2], hf_reference(ARCH), long_prompt, what="prompt cut while others decode")
    assert_tokens_equal_hf(tokens[1], hf_reference(ARCH), short, what="the request decoding meanwhile")
    # alone, the same prompt is one prefill step (the budget is 8,192)
    batches: list[tuple[str, list[int]]] = []
    run(tiny_model_dirs[ARCH], [long_prompt], greedy(2), batches=batches)
    assert [sum(lens) for phase, lens in batches if phase == Phase.PREFILL] == [len(long_prompt)]


@pytest.mark.parametrize("budget", [1, 7])
def test_tiny_prefill_budgets_equal_unchunked(tiny_model_dirs, budget):
    prompts = [random_prompt(n, VOCAB, seed=n) for n in (23, 5, 40)]
    batches: list[tuple[str, list[int]]] = []
    chunked, _ = run(
        tiny_model_dirs[ARCH], prompts, greedy(10), batches=batches, max_prefill_length=budget, page_size=4
    )
    whole, _ = run(tiny_model_dirs[ARCH], prompts, greedy(10), page_size=4)
    assert chunked == whole
    assert all(sum(lens) <= budget for phase, lens in batches if phase == Phase.PREFILL)


# ---- overlap scheduling -----------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_overlap_on_and_off_give_identical_outputs(tiny_model_dirs, hf_reference, arch):
    vocab = TINY_SPECS[arch].config_kwargs["vocab_size"]
    prompts = [random_prompt(n, vocab, seed=30 + n) for n in (4, 25, 13, 50, 2)]
    # 1- and 2-token requests finish while a step is in flight
    params = [greedy(n) for n in (1, 30, 2, 17, 25)]
    on, _ = run(tiny_model_dirs[arch], prompts, params, overlap=True)
    off, _ = run(tiny_model_dirs[arch], prompts, params, overlap=False)
    assert on == off
    assert [len(o) for o in on] == [1, 30, 2, 17, 25]  # the extra in-flight token is never reported
    for p, o in zip(prompts, on):
        assert_tokens_equal_hf(o, hf_reference(arch), p, what=f"{arch} overlap")


def test_decode_batches_list_the_longest_contexts_first(tiny_model_dirs):
    """Attention kernels start their programs in batch order, so decode batches go longest first: at
    decode step j every request still running has prompt + j keys (hand count: all prompts are prefilled
    in the first step, no overlap), listed in decreasing order."""
    prompt_lens, outputs = [5, 40, 12, 27, 3, 19], [9, 4, 12, 7, 12, 2]
    prompts = [random_prompt(n, VOCAB, seed=70 + i) for i, n in enumerate(prompt_lens)]
    seen: list[list[int]] = []
    with make_llm(tiny_model_dirs[ARCH], **tiny_llm_kwargs(overlap=False)) as llm:
        prepare = llm.scheduler._prepare_decode

        def spy():
            batch = prepare()
            if batch is not None:
                seen.append(list(batch.seq_lens))
            return batch

        llm.scheduler._prepare_decode = spy
        llm.generate(prompts, [greedy(m) for m in outputs])
        assert_all_kv_free(llm)
    want = [
        sorted((p + j for p, m in zip(prompt_lens, outputs) if m > j), reverse=True)
        for j in range(1, max(outputs))
    ]
    assert seen == want


def test_decode_batches_pack_their_graph_inputs_in_the_graph_layout(tiny_model_dirs):
    """A decode step's per-request rows go to the device as one [4, batch] block in the decode graph's
    row order (DECODE_INPUTS), each row the batch field of that name; hand count of the first decode
    step: position = prompt length, sequence length one more, longest first."""
    prompt_lens = [5, 17, 9]
    prompts = [random_prompt(n, VOCAB, seed=80 + i) for i, n in enumerate(prompt_lens)]
    seen = []
    with make_llm(tiny_model_dirs[ARCH], **tiny_llm_kwargs(overlap=False)) as llm:
        prepare = llm.scheduler._prepare_decode

        def spy():
            batch = prepare()
            if batch is not None:  # copied now: the staging buffers are reused by later steps
                rows = [t.clone() for t in DECODE_INPUTS.of(batch)]
                seen.append((batch.graph_inputs.clone(), rows, [r.table_idx for r in batch.reqs]))
            return batch

        llm.scheduler._prepare_decode = spy
        llm.generate(prompts, greedy(3))
        assert_all_kv_free(llm)
    packed, rows, table_idx = seen[0]
    assert packed.shape == (len(DECODE_INPUTS.fields), len(prompts))
    for field, got, want in zip(DECODE_INPUTS.fields, packed, rows):
        assert torch.equal(got, want), field
    fields = dict(zip(DECODE_INPUTS.fields, rows))
    longest_first = sorted(prompt_lens, reverse=True)
    assert fields["positions"].tolist() == longest_first
    assert fields["seq_lens_t"].tolist() == [n + 1 for n in longest_first]
    assert fields["table_idx"].tolist() == table_idx


# ---- a pool too small: queueing and retraction --------------------------------------------------------
SMALL_POOL_PROMPTS = [(30, 40), (12, 50), (45, 20), (8, 60), (25, 35), (50, 10), (3, 45), (20, 30)]


def _small_pool_workload():
    prompts = [random_prompt(n, VOCAB, seed=50 + i) for i, (n, _) in enumerate(SMALL_POOL_PROMPTS)]
    return prompts, [greedy(m) for _, m in SMALL_POOL_PROMPTS]


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("reserve_ratio", [1.0, 0.0], ids=["queueing", "retraction"])
def test_small_pool_completes_every_request_like_a_large_pool(tiny_model_dirs, page_size, reserve_ratio):
    """A pool of 160 tokens for 8 requests needing 483 together: requests wait (full reservation) or are
    retracted and resumed (no reservation); outputs equal a large pool's."""
    prompts, params = _small_pool_workload()
    large, _ = run(tiny_model_dirs[ARCH], prompts, params, page_size=page_size)
    small, stats = run(
        tiny_model_dirs[ARCH],
        prompts,
        params,
        page_size=page_size,
        num_page_override=160 // page_size,
        max_seq_len_override=128,
        reserve_ratio=reserve_ratio,
    )
    assert small == large
    assert stats["max_batch_size"] < len(prompts)
    if reserve_ratio == 0.0:
        assert stats["num_retractions"] > 0
    else:
        assert stats["num_retractions"] == 0


def test_small_pool_with_naive_cache_and_no_overlap(tiny_model_dirs):
    prompts, params = _small_pool_workload()
    large, _ = run(tiny_model_dirs[ARCH], prompts, params, cache_type="naive")
    small, stats = run(
        tiny_model_dirs[ARCH],
        prompts,
        params,
        cache_type="naive",
        overlap=False,
        num_page_override=160,
        max_seq_len_override=128,
        reserve_ratio=0.0,
    )
    assert small == large
    assert stats["num_retractions"] > 0


# ---- aborts -------------------------------------------------------------------------------------------
class Driver:
    """Drives llm.scheduler step by step and records every reported token per uid."""

    def __init__(self, llm) -> None:
        self.sched = llm.scheduler
        self.tokens: dict[int, list[int]] = {}
        self.finish: dict[int, FinishReason] = {}

    def add(self, uid: int, prompt: list[int], params: SamplingParams) -> None:
        self.sched.add_request(uid, prompt, params)
        self.tokens[uid] = []

    def step(self) -> None:
        for res in self.sched.step():
            assert res.uid not in self.finish, f"token reported for request {res.uid} after it finished"
            self.tokens[res.uid].append(res.token_id)
            if res.finished:
                self.finish[res.uid] = res.finish_reason

    def abort(self, uid: int) -> None:
        assert self.sched.abort_request(uid)
        self.finish[uid] = FinishReason.ABORT

    def drain(self) -> None:
        for _ in range(10_000):
            if not self.sched.has_work:
                return
            self.step()
        raise AssertionError("the scheduler did not become idle")


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("stage", ["waiting", "prefilling", "decoding"])
def test_abort_frees_everything_at_each_stage(tiny_model_dirs, hf_reference, stage, overlap):
    kwargs = tiny_llm_kwargs(overlap=overlap, page_size=4, max_prefill_length=32)
    survivor = random_prompt(10, VOCAB, seed=60)
    victim = random_prompt(150, VOCAB, seed=61)  # five 32-token chunks
    with make_llm(tiny_model_dirs[ARCH], **kwargs) as llm:
        d = Driver(llm)
        d.add(0, survivor, greedy(30))
        d.add(1, victim, greedy(30))
        if stage == "prefilling":
            while d.sched.prefill.chunked is None or d.sched.prefill.chunked.uid != 1:
                d.step()
        elif stage == "decoding":
            while len(d.tokens[1]) < 3:
                d.step()
        d.abort(1)
        assert not d.sched.abort_request(1), "a second abort of the same uid finds nothing"
        reported_at_abort = len(d.tokens[1])
        d.drain()
        assert len(d.tokens[1]) == reported_at_abort, "a token of the aborted request was reported"
        assert d.finish[0] == FinishReason.LENGTH and len(d.tokens[0]) == 30
        assert_tokens_equal_hf(d.tokens[0], hf_reference(ARCH), survivor, what="request beside an abort")
        assert_all_kv_free(llm)
        # the victim's pages were returned: the same prompt runs again to completion
        again = llm.generate([victim], greedy(5))[0]["token_ids"]
        assert_tokens_equal_hf(again, hf_reference(ARCH), victim, what="aborted prompt run again")
        assert_all_kv_free(llm)


def test_abort_of_unknown_uid_returns_false(tiny_model_dirs):
    with make_llm(tiny_model_dirs[ARCH], **tiny_llm_kwargs()) as llm:
        assert llm.scheduler.abort_request(12345) is False
        assert_all_kv_free(llm)


# ---- randomized interleavings -------------------------------------------------------------------------
@pytest.mark.parametrize(
    "seed,cache_type,page_size,overlap",
    [
        (0, "radix", 1, True),
        (1, "radix", 4, True),
        (2, "naive", 2, False),
        (3, "radix", 4, False),
    ],
)
def test_random_arrivals_and_aborts_never_leak_a_page(
    tiny_model_dirs, hf_reference, seed, cache_type, page_size, overlap
):
    """Seeded random arrivals (sharing prefixes), steps and aborts in a pool small enough to evict and
    retract: no page leaks, and every request that completes equals Hugging Face."""
    rng = random.Random(seed)
    prefixes = [random_prompt(rng.randint(4, 40), VOCAB, seed=1000 * seed + i) for i in range(3)]
    kwargs = tiny_llm_kwargs(
        cache_type=cache_type,
        page_size=page_size,
        overlap=overlap,
        num_page_override=256 // page_size,
        max_seq_len_override=128,
        max_prefill_length=rng.choice([16, 48, 512]),
        reserve_ratio=rng.choice([0.0, 0.5, 1.0]),
        max_running_req=6,
    )
    prompts: dict[int, list[int]] = {}
    with make_llm(tiny_model_dirs[ARCH], **kwargs) as llm:
        d = Driver(llm)
        uid = 0
        for _ in range(160):
            action = rng.random()
            if action < 0.25 and uid < 24:
                prefix = rng.choice(prefixes) if rng.random() < 0.7 else []
                prompt = prefix + random_prompt(rng.randint(1, 30), VOCAB, seed=10_000 * seed + uid)
                prompts[uid] = prompt
                d.add(uid, prompt, greedy(rng.randint(1, 40)))
                uid += 1
            elif action < 0.32:
                live = [u for u in prompts if u not in d.finish]
                if live:
                    d.abort(rng.choice(live))
            else:
                d.step()
        d.drain()
        assert_all_kv_free(llm)
        completed = [u for u, why in d.finish.items() if why != FinishReason.ABORT]
        assert len(completed) + sum(why == FinishReason.ABORT for why in d.finish.values()) == uid
        for u in completed:
            assert_tokens_equal_hf(d.tokens[u], hf_reference(ARCH), prompts[u], what=f"request {u}")


def test_the_prefill_pacer_sizes_a_chunk_to_its_target_time_at_the_measured_pace():
    """Hand computations: with the weights worth 1,000 context tokens of attention, a 100-token chunk
    after 900 cached tokens is 100 * (1 + (900 + 50) / 1000) = 195 units of work; at the pace that
    measurement gives, the chunk that fits the target after a 2,000-token prefix solves
    n * (1 + (2000 + n / 2) / 1000) = target / pace."""
    from minisgl.scheduler.pacing import FIRST_TOKENS, MAX_TOKENS, MIN_TOKENS, PrefillPacer

    pacer = PrefillPacer(attn_ratio=1000.0, target=0.5)
    assert pacer.budget(0) == FIRST_TOKENS  # nothing measured yet
    assert pacer.work(100, 900) == pytest.approx(195.0)
    pacer.measured(0.39, [(100, 900)])  # 0.002 s a unit
    units = 0.5 / 0.002
    n = pacer.budget(2000)
    assert n * (1 + (2000 + n / 2) / 1000) == pytest.approx(units, rel=0.02)
    assert pacer.budget(0) > n  # the same time holds more tokens without a prefix to attend to
    pacer.measured(0.0, [(100, 0)])  # a fast step: the pace moves half way
    assert pacer.seconds_per_unit == pytest.approx(0.001)
    for _ in range(40):  # the pace follows a machine that became much faster...
        pacer.measured(1e-9, [(1, 0)])
    assert pacer.budget(0) == MAX_TOKENS
    pacer.measured(100.0, [(1, 0)])  # ... or much slower
    assert pacer.budget(10_000) == MIN_TOKENS


def test_the_attention_ratio_is_the_weights_work_over_one_context_tokens_attention():
    """SmolLM2-135M's shapes, by hand: 30 layers of 576 hidden, 9 heads of 64 (q 576), 3 KV heads
    (kv 192), MLP 1,536: weights 30 * (576 * (2 * 576 + 2 * 192) + 3 * 576 * 1536) multiply-adds a
    token, attention 30 * 2 * 576 a context token, counted ATTENTION_SLOWDOWN times."""
    from types import SimpleNamespace

    from minisgl.scheduler.pacing import ATTENTION_SLOWDOWN, attention_ratio

    m = SimpleNamespace(
        num_heads=9,
        head_dim=64,
        num_kv_heads=3,
        hidden_size=576,
        intermediate_size=1536,
        num_layers=30,
        moe=None,
    )
    weights = 30 * (576 * (2 * 576 + 2 * 192) + 3 * 576 * 1536)
    assert attention_ratio(m) == pytest.approx(weights / (30 * 2 * 576 * ATTENTION_SLOWDOWN))


def _tree_nodes(cache) -> list:
    """Every node of a radix cache's tree, root included, by a walk from the root."""
    nodes, stack = [], [cache.root]
    while stack:
        node = stack.pop()
        nodes.append(node)
        stack.extend(node.children.values())
    return nodes


def _brute_evict(cache, num_pages: int) -> list[int]:
    """Least-recently-used eviction by hand: each time, every unlocked leaf of the whole tree is looked at
    and the one touched longest ago goes (its parent may become such a leaf)."""
    ps, freed = cache.page_size, []
    while len(freed) < num_pages:
        nodes = _tree_nodes(cache)
        leaves = [n for n in nodes if not n.children and n.ref == 0 and n is not cache.root]
        if not leaves:
            break
        victim = min(leaves, key=lambda n: n.last_access)
        freed.extend((victim.value[::ps] // ps).tolist())
        del victim.parent.children[tuple(victim.key[:ps])]
    return freed


@pytest.mark.parametrize(("page_size", "heap_slack"), [(1, 64), (4, 64), (1, -400)])
def test_radix_eviction_takes_the_least_recently_used_unlocked_leaves_as_a_full_scan_does(
    page_size, heap_slack
):
    """Seeded random inserts (sharing prefixes), matches, locks, unlocks and evictions: every eviction frees
    the pages that a scan of the whole tree picks, in a copy of the cache taken just before it, and the
    cached and evictable counts equal a hand count of the tree. A negative slack rebuilds the cache's heap
    of eviction candidates at almost every entry."""
    import copy

    from minisgl.kvcache.radix import RadixPrefixCache

    rng = random.Random(page_size)
    cache, ps = RadixPrefixCache(page_size), page_size
    cache.heap_slack = heap_slack
    next_page, held, evictions = 0, [], 0
    stems = [[rng.randrange(6) for _ in range(ps * rng.randint(1, 4))] for _ in range(4)]
    for _ in range(600):
        op = rng.random()
        if op < 0.45:
            tokens = rng.choice(stems) + [rng.randrange(6) for _ in range(ps * rng.randint(0, 5))]
            tokens = tokens[: len(tokens) // ps * ps]
            pages = list(range(next_page, next_page + len(tokens) // ps))
            next_page += len(pages)
            slots = torch.tensor([p * ps + i for p in pages for i in range(ps)], dtype=torch.int32)
            handle, _ = cache.insert(tokens, slots)
            if rng.random() < 0.3:
                cache.lock(handle)
                held.append(handle)
        elif op < 0.6:
            tokens = rng.choice(stems) + [rng.randrange(6) for _ in range(ps * rng.randint(0, 3))]
            result = cache.match_prefix(tokens)  # touches the path, locked or not
            if rng.random() < 0.5:
                cache.lock(result.handle)
                held.append(result.handle)
        elif op < 0.8 and held:
            cache.unlock(held.pop(rng.randrange(len(held))))
        else:
            n = rng.randint(1, 12)
            expected = _brute_evict(copy.deepcopy(cache), n)
            assert cache.evict(n) == expected
            evictions += len(expected) > 0
        nodes = _tree_nodes(cache)
        tokens_cached = sum(len(n.key) for n in nodes)
        tokens_free = sum(len(n.key) for n in nodes if n.ref == 0 and n is not cache.root)
        assert (cache.cached_pages, cache.evictable_pages) == (tokens_cached // ps, tokens_free // ps)
    assert evictions > 20  # the walk did evict, often
