"""One memo for immutable values keyed by the objects they come from.

Diagrams, boxes, specs and array objects are immutable, and the search meets the
same ones in state after state; several places cache what they compute from them.
They compare by structure (wires by type, not name), so an equality-keyed cache
would hand back a result with another object's labels: the key is the objects'
``id``s.  Each entry holds its objects, so an id cannot be reused while the entry
lives.  Past ``limit`` entries the memo starts over (a bound on memory).
"""
from __future__ import annotations


class IdentityMemo:
    def __init__(self, limit: int = 50000):
        self.table, self.limit = {}, limit

    def get(self, objects: tuple, make, extra=None):
        """``make()``, computed once per ``objects`` (by identity) and ``extra``
        (a hashable value compared by equality)."""
        key = (tuple(map(id, objects)), extra)
        hit = self.table.get(key)
        if hit is not None:
            return hit[1]
        if len(self.table) > self.limit:
            self.table.clear()
        value = make()
        self.table[key] = (objects, value)
        return value
