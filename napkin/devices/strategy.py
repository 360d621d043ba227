"""What a device strategy is: its kind, the axes it cuts over the devices, and how each
array is laid out under it (shared by the pricing, napkin.devices.plan, and the lowering,
napkin.devices.spmd)."""
from __future__ import annotations

import math
from dataclasses import dataclass

from napkin.core.errors import NapkinError

ONE = "one"


@dataclass(frozen=True)
class Strategy:
    kind: str                   # "one" | "shard" | "ring" | "gather"
    devices: int = 1
    shard: str | None = None    # the woven axis cut over the devices (shard, ring's queries)
    stream: str | None = None   # the streamed axis cut over the devices (ring, gather)
    zigzag: bool = False        # a ring's axes in 2n chunks, device i holding i and 2n−1−i
    # further woven axes, each cut over a mesh axis of its own: ((axis, devices), …) — a
    # 2-D mesh such as heads × ring; the strategy above runs within each of their blocks
    outer: tuple = ()

    def __str__(self):
        return self._own() + "".join(f"; × {a} cut over {k} (a {self.mesh_text()} mesh)"
                                     for a, k in self.outer)

    def _own(self) -> str:
        if self.kind == ONE:
            return "one device"
        if self.kind == "shard":
            return f"shard {self.shard} over {self.devices} devices"
        if self.kind == "ring":
            order = (f" in zigzag order (2 × {self.devices} chunks, device i holding i and "
                     f"{2 * self.devices - 1}−i)") if self.zigzag else ""
            return (f"ring over {self.devices} devices: {self.shard} cut, {self.stream} "
                    f"passed round{order}")
        return f"gather over {self.devices} devices: {self.stream} cut, partial states merged"

    @property
    def mesh(self) -> tuple:
        """The mesh's shape: the outer axes' device counts, then the strategy's own."""
        return (*(k for _, k in self.outer), self.devices)

    @property
    def total(self) -> int:
        """Every device the strategy runs on."""
        return math.prod(self.mesh)

    def mesh_text(self) -> str:
        return " × ".join(map(str, self.mesh))

    def cuts(self) -> dict:
        """{axis: devices it is cut over} — the outer axes, the shard and the stream."""
        out = dict(self.outer)
        for a in (self.shard, self.stream):
            if a is not None and self.kind != ONE:
                out[a] = self.devices * self.pieces
        return out

    @property
    def pieces(self) -> int:
        """The chunks of each cut axis a device holds (zigzag: 2, the per-device program
        run on each pair of them)."""
        return 2 if self.zigzag else 1

    def chunk(self, device, piece: int):
        """The index, among ``devices × pieces`` equal chunks of a cut axis, of ``device``'s
        ``piece``-th (zigzag: device i holds chunks i and 2n − 1 − i, so under a causal
        mask every device keeps about as many entries as any other); works on ints and
        traced device indices alike."""
        return device if piece == 0 else 2 * self.devices - 1 - device

    def order(self) -> list:
        """The chunks of a cut axis in the order the devices hold them (device 0's, then
        device 1's, …): a global array permuted by it is cut into equal contiguous shares."""
        return [self.chunk(i, k) for i in range(self.devices) for k in range(self.pieces)]


def mesh_axis(axis: str) -> str:
    """The name of the mesh axis an outer woven axis is cut over."""
    return f"{axis}_devices"


def layout(s: Strategy, t) -> str | None:
    """The axis an input (or output) of type ``t`` is cut along over the strategy's own mesh
    axis (None: whole along it; :attr:`Strategy.outer` axes are cut over theirs besides)."""
    if s.kind == ONE:
        return None
    cut = [a for a in (s.shard, s.stream) if a is not None and t.has(a)]
    if len(cut) > 1:
        raise NapkinError(f"{t} carries both {cut[0]} and {cut[1]}, which {s} cuts over the "
                          f"same devices")
    return cut[0] if cut else None


def mergeable_stream(program):
    """(outer groups, the stream box) where ``program`` is one box: groups, each the whole
    body of the one around it, around one stream whose accumulator has a merge; else
    (None, why)."""
    from napkin.core.ir import ops as op_order, view
    from rewrites.split_stream import lone_groups
    g = view(program)
    order = op_order(g)
    if len(order) != 1:
        return None, f"the program is {len(order)} kernels, not one stream"
    outers, box, why = lone_groups(g.nodes[order[0]]["box"])
    if why:
        return None, why
    if getattr(box.spec, "kind", None) != "stream":
        return None, f"{box.name} is no stream"
    if box.spec.merge is None:
        return None, f"the accumulator of {box.name} ({box.spec.rule}) has no merge"
    return (outers, box), ""
