"""LLM(tp_size=2): two real rank processes over gloo give the tokens of TP=1, token for token, for tiny
Qwen3, Llama and Qwen2 models (2 KV heads: split; 1 KV head: replicated on both ranks), batched and with
chunked prefill; an abort frees the KV on both ranks; shutdown (or the parent's death) leaves no process;
a dead rank is an error naming it; a TP size that does not divide the heads is refused before any process
starts."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest
import torch
from helpers import TINY_SPECS, build_tiny_model, make_llm, random_prompt, tiny_llm_kwargs

from minisgl.core import SamplingParams
from minisgl.llm import RankFailed

# (name, spec, KV heads): with 1 KV head, TP=2 replicates it on both ranks
MODELS = [
    ("qwen3", TINY_SPECS["qwen3"], 2),
    ("llama_kv1", TINY_SPECS["llama"], 1),
    ("qwen2_kv1", TINY_SPECS["qwen2"], 1),
]
LENGTHS = [3, 17, 40, 9, 26]  # several of them longer than one 16-token prefill chunk
MAX_TOKENS = [12, 7, 10, 15, 5]


@pytest.fixture(scope="module")
def tp_models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tp_models")
    out = {}
    for name, spec, kv_heads in MODELS:
        spec = dataclasses.replace(
            spec, config_kwargs={**spec.config_kwargs, "num_key_value_heads": kv_heads}
        )
        out[name] = build_tiny_model(spec, str(root / name))
    return out


def _prompts(vocab: int) -> tuple[list[list[int]], list[SamplingParams]]:
    prompts = [random_prompt(n, vocab, seed=i) for i, n in enumerate(LENGTHS)]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in MAX_TOKENS]
    return prompts, params


def _follower_pids(llm) -> list[int]:
    return [p.pid for _, p, _ in llm.ranks.procs]


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _wait_gone(pids: list[int], timeout: float = 30) -> bool:
    deadline = time.monotonic() + timeout
    while not all(_gone(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    return all(_gone(p) for p in pids)


@pytest.mark.parametrize("name", [m[0] for m in MODELS])
def test_tp2_equals_tp1_token_for_token_batched_and_chunked(tp_models, name):
    vocab = TINY_SPECS[name.split("_")[0]].config_kwargs["vocab_size"]
    prompts, params = _prompts(vocab)
    with make_llm(tp_models[name], **tiny_llm_kwargs()) as llm:
        expected = [o["token_ids"] for o in llm.generate(prompts, params)]
        assert not torch.distributed.is_initialized()  # TP=1 forms no process group
        weights_tp1 = llm.rank_states()[0]["memory"]["weights"]
    # chunked: a 16-token prefill budget splits the longer prompts over several steps
    with make_llm(tp_models[name], **tiny_llm_kwargs(tp_size=2, max_prefill_length=16)) as llm:
        pids = _follower_pids(llm)
        assert len(pids) == 1
        got = [o["token_ids"] for o in llm.generate(prompts, params)]
        states = llm.rank_states()
    assert got == expected
    assert [len(t) for t in got] == MAX_TOKENS
    # each rank holds its shard: less than the whole model, the same KV pool on both
    assert len(states) == 2
    for s in states:
        assert s["integrity_error"] is None
        assert s["free_pages"] + s["cached_pages"] == s["total_pages"]
        assert s["memory"]["weights"] < weights_tp1
    assert states[0]["memory"] == states[1]["memory"]
    assert _wait_gone(pids), "shutdown() left a rank process behind"


def test_tp2_abort_frees_the_kv_on_both_ranks(tp_models):
    prompts, _ = _prompts(TINY_SPECS["qwen3"].config_kwargs["vocab_size"])
    with make_llm(tp_models["qwen3"], **tiny_llm_kwargs(tp_size=2, max_prefill_length=16)) as llm:
        long = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
        for uid, ids in enumerate(prompts[:3]):
            llm.add_request(1000 + uid, ids, long)
        for _ in range(6):  # prefill and a few decode steps: the requests hold KV on both ranks
            llm.step()
        busy = llm.rank_states()
        assert all(s["free_pages"] + s["cached_pages"] < s["total_pages"] for s in busy)
        for uid in range(3):
            llm.abort_request(1000 + uid)
        while llm.scheduler.has_work:
            llm.step()
        idle = llm.rank_states()
    for s in idle:
        assert s["integrity_error"] is None
        assert s["free_pages"] + s["cached_pages"] == s["total_pages"], s
    assert idle[0]["free_pages"] == idle[1]["free_pages"]  # the ranks made the same decisions


def test_a_killed_rank_is_an_error_naming_it_and_shutdown_still_cleans_up(tp_models):
    prompts, params = _prompts(TINY_SPECS["qwen3"].config_kwargs["vocab_size"])
    with make_llm(tp_models["qwen3"], **tiny_llm_kwargs(tp_size=2)) as llm:
        (pid,) = _follower_pids(llm)
        os.kill(pid, signal.SIGKILL)
        _wait_gone([pid])  # (not reaped here: the LLM's own watchdog must see the exit)
        with pytest.raises(RankFailed, match=r"rank 1 .*(killed|code -9)|rank 1 .*exited"):
            llm.generate(prompts, params)
    assert _gone(pid)


def test_a_tp_size_that_does_not_divide_the_heads_is_refused_before_any_process(tp_models):
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    from minisgl.llm import LLM

    with pytest.raises(ValueError, match=r"num_attention_heads=4.*--tp-size"):
        LLM(tp_models["qwen3"], **tiny_llm_kwargs(tp_size=3))
    assert {p.pid for p in psutil.Process().children(recursive=True)} <= before


def test_the_rank_processes_die_with_their_parent(tp_models, tmp_path):
    script = textwrap.dedent(
        f"""
        import sys, time
        from minisgl.llm import LLM

        if __name__ == "__main__":
            llm = LLM({tp_models["qwen3"]!r}, tp_size=2, num_page_override=512, show_progress=False)
            print(" ".join(str(p.pid) for _, p, _ in llm.ranks.procs), flush=True)
            time.sleep(600)
        """
    )
    path = tmp_path / "parent.py"
    path.write_text(script)
    parent = subprocess.Popen(
        [sys.executable, str(path)], stdout=subprocess.PIPE, text=True, env=dict(os.environ)
    )
    try:
        pids = [int(p) for p in parent.stdout.readline().split()]
        assert pids, "the parent printed no rank pid"
        parent.kill()  # SIGKILL: no atexit, no shutdown()
        parent.wait(30)
        assert _wait_gone(pids), "a rank process outlived its parent"
    finally:
        if parent.poll() is None:
            parent.kill()
        parent.stdout.close()


def test_an_unguarded_script_runs_tp2_and_its_body_runs_once(tp_models, tmp_path):
    """The followers never import the caller's `__main__`: a script written without the
    `if __name__ == "__main__":` guard generates HF's tokens, and its top-level code runs only in rank 0."""
    from helpers import HFReference, assert_tokens_equal_hf

    prompt = random_prompt(11, TINY_SPECS["qwen3"].config_kwargs["vocab_size"], seed=77)
    script = tmp_path / "unguarded.py"
    script.write_text(
        textwrap.dedent(
            """
            import json, sys
            import torch
            from minisgl.core import SamplingParams
            from minisgl.llm import LLM

            print("script body ran", flush=True)
            llm = LLM(sys.argv[1], tp_size=2, dtype=torch.float32, attn="torch", num_page_override=512,
                      show_progress=False)
            params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
            out = llm.generate([json.loads(sys.argv[2])], params)
            print("tokens", json.dumps(out[0]["token_ids"]), flush=True)
            llm.shutdown()
            """
        )
    )
    r = subprocess.run(
        [sys.executable, str(script), tp_models["qwen3"], json.dumps(prompt)],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
        check=False,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count("script body ran") == 1, r.stdout  # not again in the follower
    (line,) = [x for x in r.stdout.splitlines() if x.startswith("tokens ")]
    got = json.loads(line.split(" ", 1)[1])
    assert len(got) == 10
    assert_tokens_equal_hf(got, HFReference(tp_models["qwen3"]), prompt, "TP=2 from an unguarded script")


def test_two_nodes_of_one_rank_each_equal_tp1(tp_models, tmp_path):
    """LLM(nnodes=2): node 1 (another process here, another machine in real use) runs its rank until
    node 0's LLM shuts down, then its LLM(...) returns."""
    from helpers import free_port

    path = tp_models["llama_kv1"]
    addr = f"127.0.0.1:{free_port()}"
    common = {"tp_size": 2, "nnodes": 2, "dist_init_addr": addr}
    script = tmp_path / "node1.py"
    script.write_text(
        textwrap.dedent(
            f"""
            from minisgl.llm import LLM

            if __name__ == "__main__":
                LLM({path!r}, node_rank=1, num_page_override=4096, show_progress=False, **{common!r})
                print("node 1 done", flush=True)
            """
        )
    )
    node1 = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        prompts, params = _prompts(TINY_SPECS["llama"].config_kwargs["vocab_size"])
        with make_llm(path, **tiny_llm_kwargs()) as llm:
            expected = [o["token_ids"] for o in llm.generate(prompts, params)]
        with make_llm(path, **tiny_llm_kwargs(node_rank=0, **common)) as llm:
            assert llm.ranks.procs == []  # one rank per node: node 0 spawns none
            got = [o["token_ids"] for o in llm.generate(prompts, params)]
        assert got == expected
        assert node1.wait(60) == 0
        assert "node 1 done" in node1.stdout.read()
    finally:
        if node1.poll() is None:
            node1.kill()
        node1.stdout.close()


def test_tp2_with_speculation_equals_tp1_one_request_and_batched(tp_models):
    """n-gram speculation on two ranks: both make the same proposals and keep the same tokens (a lone
    request's k does not depend on timings there), equal to TP=1 without speculation."""
    vocab = TINY_SPECS["qwen3"].config_kwargs["vocab_size"]
    base = random_prompt(6, vocab, seed=21)
    prompts = [base * 3 + base[:2], *_prompts(vocab)[0][:3]]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    with make_llm(tp_models["qwen3"], **tiny_llm_kwargs()) as llm:
        expected = [llm.generate([p], params)[0]["token_ids"] for p in prompts]
    spec = {"speculative": "ngram", "num_speculative_tokens": 4}
    with make_llm(tp_models["qwen3"], **tiny_llm_kwargs(tp_size=2), **spec) as llm:
        alone = [llm.generate([p], params)[0]["token_ids"] for p in prompts]
        batched = [o["token_ids"] for o in llm.generate(prompts, params)]
        assert llm.stats()["spec_accepted_tokens"] > 0
        states = llm.rank_states()
    assert alone == expected and batched == expected
    for s in states:
        assert s["integrity_error"] is None
        assert s["free_pages"] + s["cached_pages"] == s["total_pages"]
