"""What a device strategy is: its kind, the axes it cuts over the devices, and how each
array is laid out under it (shared by the pricing, napkin.devices.plan, and the lowering,
napkin.devices.spmd)."""
from __future__ import annotations

from dataclasses import dataclass

from napkin.core.errors import NapkinError

ONE = "one"


@dataclass(frozen=True)
class Strategy:
    kind: str                   # "one" | "shard" | "ring" | "gather"
    devices: int = 1
    shard: str | None = None    # the woven axis cut over the devices (shard, ring's queries)
    stream: str | None = None   # the streamed axis cut over the devices (ring, gather)

    def __str__(self):
        if self.kind == ONE:
            return "one device"
        if self.kind == "shard":
            return f"shard {self.shard} over {self.devices} devices"
        if self.kind == "ring":
            return (f"ring over {self.devices} devices: {self.shard} cut, {self.stream} "
                    f"passed round")
        return f"gather over {self.devices} devices: {self.stream} cut, partial states merged"


def layout(s: Strategy, t) -> str | None:
    """The axis an input (or output) of type ``t`` is cut along under ``s`` (None: whole)."""
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
