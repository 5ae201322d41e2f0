"""The paged KV pool and the prefix caches (naive, radix), picked by name (`--cache`)."""

from minisgl.utils import Registry

from .base import BasePrefixCache, MatchResult
from .naive import NaivePrefixCache
from .pool import KVPool
from .radix import RadixPrefixCache

PREFIX_CACHES: Registry[type] = Registry("prefix cache")
PREFIX_CACHES.register("naive")(NaivePrefixCache)
PREFIX_CACHES.register("radix")(RadixPrefixCache)

__all__ = [
    "PREFIX_CACHES",
    "BasePrefixCache",
    "KVPool",
    "MatchResult",
    "NaivePrefixCache",
    "RadixPrefixCache",
]
