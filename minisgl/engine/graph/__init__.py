"""CUDA graphs: capture a forward once per size, replay it every step (decode and prefill).

Decode at small batch sizes is launch-bound, so replaying one graph instead of launching hundreds of kernels
matters more than any kernel; a large prefill step's host launch cost can exceed its GPU time too. A graph
replays fixed device addresses, so every input of a step is copied into fixed buffers first, and a batch is
padded to the nearest captured size. `BaseGraphRunner` holds what both runners share (capture into one
memory pool, largest size first; replay of the smallest graph that holds a batch); `DecodeGraphRunner` and
`PrefillGraphRunner` say what differs: their sizes, buffers, how a batch is copied in and what comes out.
A runner gets from the engine only `GraphDeps`: the device, the forward pieces, the token pool and the
dummy page-table row and KV slot.

Padding rows and tokens touch nothing real: they read page-table row `dummy_row` (the engine's extra row,
which maps position 0 to the dummy slot) and write their K/V into `dummy_slot`, the first slot of the one
page the engine allocates beyond `num_pages` (the scheduler never hands it out).

On a CPU (when asked for with `cuda_graph_max_bs > 0`) an EmulatedGraph stands in: its "capture" records
a closure that reads only the fixed buffers, so an input that replay forgets to copy gives a wrong result
on a CPU too, and the tests catch it.

The files: `sizes.py` (the captured sizes), `base.py` (the shared runner, capture, `GraphDeps`),
`decode.py`, `prefill.py`, `verify.py` (speculative verify steps: decode graphs at row counts).
"""

from .base import BaseGraphRunner, EmulatedGraph, GraphDeps, InputRows, capture_cuda, capture_emulated
from .decode import DECODE_INPUTS, DecodeGraphRunner, DecodeOutput, SampleOutput
from .prefill import PrefillGraphRunner, PrefillOutput
from .sizes import DEFAULT_MAX_BS, DEFAULT_MAX_PREFILL, MAX_PREFILL_REQS, capture_sizes, prefill_sizes
from .verify import VerifyGraphRunner

__all__ = [
    "DECODE_INPUTS",
    "DEFAULT_MAX_BS",
    "DEFAULT_MAX_PREFILL",
    "MAX_PREFILL_REQS",
    "BaseGraphRunner",
    "DecodeGraphRunner",
    "DecodeOutput",
    "EmulatedGraph",
    "GraphDeps",
    "InputRows",
    "PrefillGraphRunner",
    "PrefillOutput",
    "SampleOutput",
    "VerifyGraphRunner",
    "capture_cuda",
    "capture_emulated",
    "capture_sizes",
    "prefill_sizes",
]
