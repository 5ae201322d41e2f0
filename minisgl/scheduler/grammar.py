"""GrammarManager: the requests whose grammar is compiling, and the token masks of a step's constrained rows.

A constrained request waits here, out of the prefill queue, while a compile process compiles its grammar
(minisgl/grammar/, within --grammar-compile-timeout); the requests behind it are admitted meanwhile.
Once compiled it gets its matcher and joins the queue; a grammar that fails to compile ends its request
with an error (a 400 naming the field when the constraint is at fault)."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future
from concurrent.futures import wait as wait_futures

import torch

from minisgl.core import Batch, InvalidRequest, Req
from minisgl.grammar import (
    DEFAULT_CACHE_MB,
    DEFAULT_COMPILE_TIMEOUT,
    GrammarCompiler,
    TokenMask,
    TokenMasks,
    new_matcher,
)
from minisgl.utils import init_logger

logger = init_logger(__name__)


class GrammarManager:
    """Owns the grammar compiler (built at the first constrained request) and the compiling requests.

    `blocking`: wait for each compilation at admission. With several tensor-parallel ranks every rank
    must admit a request at the same step, and a thread's finishing time differs from rank to rank."""

    def __init__(
        self,
        tokenizer_path: str,
        vocab_size: int,
        stop_ids: Callable[[], list[int]],
        device: torch.device,
        blocking: bool = False,
        timeout: float = DEFAULT_COMPILE_TIMEOUT,
        cache_bytes: int = DEFAULT_CACHE_MB << 20,
    ) -> None:
        self._compiler_args = (tokenizer_path, vocab_size, stop_ids, timeout, cache_bytes)
        self.compiler: GrammarCompiler | None = None
        self.masks = TokenMasks(vocab_size, device)
        self.blocking = blocking
        self.compiling: dict[int, tuple[Req, Future]] = {}  # uid -> (request, compiled grammar)
        self.num_constrained = 0  # requests holding a matcher (none: a step skips every grammar check)

    def add(self, req: Req) -> None:
        """Start compiling a constrained request's grammar; `ready` hands the request out once done."""
        if self.compiler is None:
            self.compiler = GrammarCompiler(*self._compiler_args)
        kind, text = req.sampling_params.grammar
        future = self.compiler.submit(kind, text, req.uid)
        if self.blocking:
            wait_futures([future])
        self.compiling[req.uid] = (req, future)

    def remove(self, uid: int) -> bool:
        """Forget a compiling request (aborted; a compile nobody else waits for is stopped); False if it
        is not compiling."""
        if self.compiling.pop(uid, None) is None:
            return False
        if self.compiler is not None:
            self.compiler.cancel(uid)
        return True

    def ready(self) -> tuple[list[Req], list[tuple[Req, str, str | None]]]:
        """The requests whose grammar compiled, each with its matcher now, in arrival order; and the
        requests whose grammar failed, with the error and the field it names (None: not the client's)."""
        done, failed = [], []
        for uid, (req, future) in list(self.compiling.items()):
            if not future.done():
                continue
            del self.compiling[uid]
            if future.cancelled():  # its compile was dropped: an abort is on its way
                continue
            error = future.exception()
            if isinstance(error, InvalidRequest):  # the client's: a 400 naming the constraint's field
                logger.info(f"request {uid}: {error}")
                failed.append((req, str(error), error.param))
                continue
            if error is not None:
                logger.warning(f"request {uid}: its grammar did not compile: {error}")
                failed.append((req, f"the grammar did not compile: {type(error).__name__}: {error}", None))
                continue
            req.grammar = new_matcher(future.result())
            self.num_constrained += 1
            done.append(req)
        return done, failed

    def wait(self, timeout: float) -> None:
        """Block until some compilation finishes or `timeout` seconds pass (a step with nothing else to do)."""
        if self.compiling:
            wait_futures([f for _, f in self.compiling.values()], timeout, FIRST_COMPLETED)

    def release(self, req: Req) -> None:
        """A constrained request ended: drop its matcher."""
        if req.grammar is not None:
            req.grammar = None
            self.num_constrained -= 1

    def rows(self, sampled: list[Req]) -> list[int] | None:
        """The indices of the constrained requests among a batch's sampled ones (None: none is)."""
        if not self.num_constrained:
            return None
        rows = [i for i, r in enumerate(sampled) if r.grammar is not None]
        return rows or None

    def mask(self, batch: Batch) -> TokenMask:
        """The batch's token mask, from the matchers' state now (call after the previous step's tokens
        were accepted). A verify step's row after proposals gets the mask after them."""
        rows = batch.grammar_rows
        assert rows is not None
        sampled = [r for r, s in zip(batch.reqs, batch.sample_mask) if s]
        drafts = None if batch.drafts is None else [batch.drafts[i] for i in rows]
        return self.masks.fill([sampled[i] for i in rows], rows, len(sampled), drafts)

    @staticmethod
    def allowed_drafts(req: Req, draft: list[int]) -> list[int]:
        """The longest start of a constrained request's proposals that its grammar accepts without
        completing (a completing token is the target's to sample); the matcher is left as it was."""
        matcher, n, keep = req.grammar, 0, 0
        for token in draft:
            if not matcher.accept_token(token):
                break
            n += 1
            if matcher.is_terminated():
                break
            keep = n
        if n:
            matcher.rollback(n)
        return draft[:keep]

    def shutdown(self) -> None:
        if self.compiler is not None:
            self.compiler.shutdown()
