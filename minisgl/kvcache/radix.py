"""The radix prefix cache: a tree of token sequences whose nodes hold the KV slots of their tokens.

Edges are page-aligned (every key is a multiple of page_size long), so a shared prefix is always whole
pages. Requests lock the node at the end of the prefix they use; locks count up the path to the root.
Unlocked leaves are evicted least-recently-used first when the pool runs short.

Eviction never walks the tree: a heap holds an entry for every node that became an unlocked leaf (when it
was inserted, unlocked, or lost its last child), keyed by its last access then. An entry is checked when it
comes up: a node evicted since, or locked or given a child, is skipped (it gets a new entry when it is an
unlocked leaf again); one touched since goes back in under its new time. Every unlocked leaf thus has an
entry no later than its last access, so the first valid entry is the least recently used leaf."""

from __future__ import annotations

import heapq
import itertools

import torch

from .base import BasePrefixCache, MatchResult

_clock = itertools.count()


class RadixNode:
    __slots__ = ("children", "key", "last_access", "parent", "ref", "value")
    # parent: None for the root and for an evicted node

    def __init__(self, key: list[int], value: torch.Tensor, parent: RadixNode | None) -> None:
        self.key = key  # tokens on the edge from the parent
        self.value = value  # [len(key)] int32 KV slots
        self.children: dict[tuple, RadixNode] = {}
        self.parent = parent
        self.ref = 0
        self.last_access = next(_clock)

    def is_leaf(self) -> bool:
        return not self.children


def _common_len(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class RadixPrefixCache(BasePrefixCache):
    heap_slack = 64  # entries beyond 4 per node before the heap is rebuilt from the tree

    def __init__(self, page_size: int) -> None:
        super().__init__(page_size)
        self.root = RadixNode([], torch.empty(0, dtype=torch.int32), None)
        self.root.ref = 1  # never evicted
        self._cached_tokens = 0
        self._evictable_tokens = 0
        self._num_nodes = 1
        self._heap: list[tuple[int, int, RadixNode]] = []  # (last access, tiebreak, node), see above
        self._tiebreak = itertools.count()

    # ---- lookup and insert -----------------------------------------------------------------------
    def _walk(self, tokens: list[int], split: bool) -> tuple[RadixNode, int, list[torch.Tensor]]:
        """Follow `tokens` down the tree page by page; returns (deepest node, matched length, slot parts).
        A partial match inside an edge splits the edge there (page-aligned) when `split`."""
        ps, node, pos, parts = self.page_size, self.root, 0, []
        now = next(_clock)
        node.last_access = now
        while pos + ps <= len(tokens):
            child = node.children.get(tuple(tokens[pos : pos + ps]))
            if child is None:
                break
            common = _common_len(child.key, tokens[pos : pos + len(child.key)]) // ps * ps
            if common < len(child.key):
                if not split:
                    parts.append(child.value[:common])
                    pos += common
                    break
                child = self._split(child, common)
            child.last_access = now
            parts.append(child.value)
            node, pos = child, pos + len(child.key)
        return node, pos, parts

    def _split(self, node: RadixNode, at: int) -> RadixNode:
        """Cut node's edge at `at`: a new parent holds the first part; returns that parent."""
        parent = node.parent
        mid = RadixNode(node.key[:at], node.value[:at], parent)
        self._num_nodes += 1
        mid.ref = node.ref
        mid.last_access = node.last_access
        parent.children[tuple(node.key[: self.page_size])] = mid
        node.key, node.value, node.parent = node.key[at:], node.value[at:], mid
        mid.children[tuple(node.key[: self.page_size])] = node
        return mid

    def match_prefix(self, token_ids: list[int]) -> MatchResult:
        node, length, parts = self._walk(token_ids, split=True)
        slots = torch.cat(parts) if parts else torch.empty(0, dtype=torch.int32)
        return MatchResult(node, length, slots)

    def insert(self, token_ids: list[int], slots: torch.Tensor) -> tuple[RadixNode, torch.Tensor]:
        assert len(token_ids) % self.page_size == 0 and len(slots) == len(token_ids)
        node, pos, parts = self._walk(token_ids, split=True)
        if pos < len(token_ids):
            leaf = RadixNode(list(token_ids[pos:]), slots[pos:].clone(), node)
            node.children[tuple(leaf.key[: self.page_size])] = leaf
            self._num_nodes += 1
            self._cached_tokens += len(leaf.key)
            self._evictable_tokens += len(leaf.key)  # unlocked until someone locks it
            self._push(leaf)
            parts.append(leaf.value)
            node = leaf
        held = torch.cat(parts) if parts else torch.empty(0, dtype=torch.int32)
        return node, held

    # ---- locks -----------------------------------------------------------------------------------
    def lock(self, handle: RadixNode | None) -> None:
        node = handle
        while node is not None and node is not self.root:
            if node.ref == 0:
                self._evictable_tokens -= len(node.key)
            node.ref += 1
            node = node.parent

    def unlock(self, handle: RadixNode | None) -> None:
        node = handle
        while node is not None and node is not self.root:
            assert node.ref > 0, "unlock without lock"
            node.ref -= 1
            if node.ref == 0:
                self._evictable_tokens += len(node.key)
                if node.is_leaf():
                    self._push(node)
            node = node.parent

    # ---- eviction --------------------------------------------------------------------------------
    def _nodes(self) -> list[RadixNode]:
        out, stack = [], [self.root]
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out

    def _push(self, node: RadixNode) -> None:
        """An entry for `node`, now an unlocked leaf (the heap is rebuilt once stale entries outnumber the
        nodes several times over, so it stays within a few entries per node)."""
        if len(self._heap) > 4 * self._num_nodes + self.heap_slack:
            self._heap = [
                (n.last_access, next(self._tiebreak), n)
                for n in self._nodes()
                if n.is_leaf() and n.ref == 0 and n is not self.root
            ]
            heapq.heapify(self._heap)
        heapq.heappush(self._heap, (node.last_access, next(self._tiebreak), node))

    def evict(self, num_pages: int) -> list[int]:
        ps = self.page_size
        freed: list[int] = []
        while self._heap and len(freed) < num_pages:
            when, _, node = heapq.heappop(self._heap)
            if node.parent is None or node.ref or node.children:
                continue  # evicted, locked or a parent since its entry: skipped
            if when != node.last_access:  # touched since: back in under its new time
                heapq.heappush(self._heap, (node.last_access, next(self._tiebreak), node))
                continue
            freed.extend((node.value[::ps] // ps).tolist())
            parent = node.parent
            del parent.children[tuple(node.key[:ps])]
            node.parent = None
            self._num_nodes -= 1
            self._cached_tokens -= len(node.key)
            self._evictable_tokens -= len(node.key)
            if parent is not self.root and parent.is_leaf() and parent.ref == 0:
                self._push(parent)
        return freed

    @property
    def evictable_pages(self) -> int:
        return self._evictable_tokens // self.page_size

    @property
    def cached_pages(self) -> int:
        return self._cached_tokens // self.page_size

    def all_pages(self) -> list[int]:
        ps = self.page_size
        return [p for n in self._nodes() for p in (n.value[::ps] // ps).tolist()]

    def has_locks(self) -> bool:
        return any(n.ref > 0 for n in self._nodes() if n is not self.root)
