"""Messages survive serialization exactly, and the ZMQ queues deliver them between sockets and processes."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator

import pytest
import torch

from minisgl.core import SamplingParams
from minisgl.message import (
    AbortMsg,
    BatchBackendMsg,
    DetokenizeMsg,
    DetokenizeStartMsg,
    ReplyBatch,
    StatsMsg,
    TokenBatch,
    TokenizeMsg,
    TokenLogprob,
    UserMsg,
    UserReply,
    dumps,
    loads,
)

zmq_queue = pytest.importorskip("minisgl.service.zmq_queue")


@pytest.fixture
def ipc_addr() -> Iterator[Callable[[str], str]]:
    """name -> a fresh ipc address; ZMQ leaves a socket's file behind when it closes, so their directory
    is removed afterwards."""
    ipc_dir = tempfile.mkdtemp(prefix="minisgl-test-")
    yield lambda name: f"ipc://{ipc_dir}/{name}"
    shutil.rmtree(ipc_dir, ignore_errors=True)


def test_every_message_type_round_trips_with_its_fields():
    params = SamplingParams(
        temperature=0.7,
        top_k=5,
        top_p=0.9,
        max_tokens=12,
        seed=3,
        stop_token_ids=[7],
        logprobs=True,
        top_logprobs=2,
    )
    msgs = [
        TokenizeMsg(
            uid=1,
            sampling_params=params,
            messages=[{"role": "user", "content": "héllo 你好 🎉"}],
            stop=["\n\n"],
            max_tokens_auto=True,
        ),
        TokenizeMsg(uid=2, sampling_params=SamplingParams(max_tokens=None), input_ids=[1, 2, 3]),
        UserMsg(uid=3, input_ids=torch.tensor([5, 6, 7], dtype=torch.int32), sampling_params=params),
        AbortMsg(uid=4),
        BatchBackendMsg([AbortMsg(5), UserMsg(6, torch.tensor([1], dtype=torch.int32), SamplingParams())]),
        DetokenizeStartMsg(
            uid=7, prompt_len=10, prompt_tail=[1, 2], stop=["x"], stop_token_ids=[3], logprobs=True
        ),
        TokenBatch.of(
            [
                DetokenizeMsg(8, 42, True, "length", -0.5, [(42, -0.5), (7, -1.25)]),
                DetokenizeMsg(
                    9, error="too long", finished=True, finish_reason="error", error_param="prompt"
                ),
            ]
        ),
        StatsMsg({"num_running": 3, "kv_used_pages": 10.5}),
        ReplyBatch.of(
            [
                UserReply(
                    10,
                    "Paris",
                    [3],
                    True,
                    "stop",
                    5,
                    1,
                    [TokenLogprob("Paris", 3, -0.1, [("Paris", 3, -0.1)])],
                )
            ]
        ),
    ]
    for msg in msgs:
        back = loads(dumps(msg))
        assert type(back) is type(msg)
        if isinstance(msg, UserMsg):
            assert torch.equal(back.input_ids, msg.input_ids) and back.input_ids.dtype == torch.int32
            assert back.sampling_params == msg.sampling_params
        elif isinstance(msg, BatchBackendMsg):
            assert isinstance(back.msgs[0], AbortMsg) and back.msgs[0].uid == 5
            assert isinstance(back.msgs[1], UserMsg) and back.msgs[1].input_ids.tolist() == [1]
        elif isinstance(msg, TokenBatch):
            assert back.row(0).top_logprobs == [[42, -0.5], [7, -1.25]]  # tuples travel as lists
            assert back.row(0).finished and back.row(0).finish_reason == "length"
            assert back.row(1) == msg.row(1)
        elif isinstance(msg, ReplyBatch):
            lp = back.replies()[0].logprobs[0]
            assert isinstance(lp, TokenLogprob) and lp.top == [["Paris", 3, -0.1]]
            assert back.replies()[0].text == "Paris" and back.replies()[0].finish_reason == "stop"
        else:
            assert back == msg


@pytest.mark.parametrize(
    "dtype", [torch.int32, torch.int64, torch.float32, torch.bfloat16, torch.float16, torch.bool, torch.uint8]
)
@pytest.mark.parametrize("shape", [(), (0,), (5,), (2, 3, 4)])
def test_tensors_travel_as_raw_bytes_with_dtype_and_shape(dtype, shape):
    t = (torch.randn(shape) * 10).to(dtype)
    back = loads(dumps({"t": t}))["t"]
    assert back.dtype == dtype and tuple(back.shape) == shape
    assert torch.equal(back, t)


def test_non_contiguous_tensor_round_trips():
    t = torch.arange(12, dtype=torch.int32).reshape(3, 4).t()
    assert torch.equal(loads(dumps(t)), t)


def test_unregistered_classes_are_refused_both_ways():
    from dataclasses import dataclass

    @dataclass
    class Stranger:
        x: int

    with pytest.raises(TypeError, match="not registered"):
        dumps(Stranger(1))
    import msgpack

    forged = msgpack.packb({"\x00type": "Stranger", "x": 1})
    with pytest.raises(TypeError, match="unknown type"):
        loads(forged)


def test_push_pull_delivers_in_order_and_get_all_drains(ipc_addr):
    addr = ipc_addr("pp")
    pull = zmq_queue.ZmqPullQueue(addr, create=True, decoder=loads)
    push = zmq_queue.ZmqPushQueue(addr, create=False, encoder=dumps)
    try:
        for i in range(5):
            push.put(AbortMsg(i))
        first = pull.get(timeout=5)
        time.sleep(0.1)
        rest = pull.get_all()
        assert [m.uid for m in [first] + rest] == [0, 1, 2, 3, 4]
        assert pull.get(timeout=0.05) is None and pull.get_all() == []
    finally:
        push.stop()
        pull.stop()


def test_async_queues_round_trip(ipc_addr):
    async def main():
        addr = ipc_addr("async")
        pull = zmq_queue.ZmqAsyncPullQueue(addr, create=True, decoder=loads)
        push = zmq_queue.ZmqAsyncPushQueue(addr, create=False, encoder=dumps)
        try:
            await push.put(ReplyBatch.of([UserReply(1, "a")]))
            push.put_nowait(ReplyBatch.of([UserReply(2, "b")]))
            got = [(await asyncio.wait_for(pull.get(), 5)).replies()[0] for _ in range(2)]
            assert [(r.uid, r.text) for r in got] == [(1, "a"), (2, "b")]
        finally:
            push.stop()
            pull.stop()

    asyncio.run(main())


def _subscriber(addr: str, out: mp.Queue) -> None:
    from minisgl.message import loads as _loads
    from minisgl.service.zmq_queue import ZmqSubQueue

    time.sleep(0.5)  # join late: a plain PUB would already have dropped the first message
    sub = ZmqSubQueue(addr, decoder=_loads)
    out.put([sub.get(timeout=10).uid for _ in range(3)])
    sub.stop()


def test_pub_waits_for_late_subscribers_so_no_message_is_lost(ipc_addr):
    addr = ipc_addr("pub")
    pub = zmq_queue.ZmqPubQueue(addr, encoder=dumps)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_subscriber, args=(addr, out)) for _ in range(2)]
    try:
        for p in procs:
            p.start()
        pub.wait_for_subscribers(2, timeout=60)
        for i in range(3):
            pub.put(AbortMsg(i))
        assert [out.get(timeout=30) for _ in procs] == [[0, 1, 2], [0, 1, 2]]
    finally:
        for p in procs:
            p.join(timeout=10)
        pub.stop()


def test_pub_wait_times_out_without_subscribers(ipc_addr):
    pub = zmq_queue.ZmqPubQueue(ipc_addr("lonely"), encoder=dumps)
    try:
        with pytest.raises(TimeoutError, match="0 of 1"):
            pub.wait_for_subscribers(1, timeout=0.2)
    finally:
        pub.stop()


def test_sub_in_a_thread_receives_after_subscribing(ipc_addr):
    addr = ipc_addr("thread")
    pub = zmq_queue.ZmqPubQueue(addr, encoder=dumps)
    got = []

    def run():
        sub = zmq_queue.ZmqSubQueue(addr, decoder=loads)
        got.append(sub.get(timeout=10))
        sub.stop()

    t = threading.Thread(target=run)
    t.start()
    pub.wait_for_subscribers(1, timeout=10)
    pub.put(StatsMsg({"a": 1}))
    t.join(10)
    pub.stop()
    assert got and got[0].stats == {"a": 1}
