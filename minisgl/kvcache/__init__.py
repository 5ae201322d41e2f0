"""The paged KV pool and the prefix caches (naive, radix)."""

from .pool import KVPool

__all__ = ["KVPool"]
