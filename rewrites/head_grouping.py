"""Head grouping for GQA / MQA: one group per KV head, all its query heads inside.

Matches: a region (as for group partition).  Parameters: ``axis`` — the
KV-head axis (K and V carry it).  Premise: some other axis of the region (the
query heads of a group, r) is *broadcast* for an input that carries ``axis``
(K and V lack r), and the group partition over ``axis`` holds.  Replacement:
a group partition over ``axis`` of size ``size`` (default 1), which keeps the r
query heads sharing a KV head in one group, so K and V are read once for all r.
Proof: that of group partition (this rule only restricts where it applies).
"""
from __future__ import annotations

from napkin.core.errors import RuleError
from napkin.core.ir import view
from napkin.core.region import body_at, region
from rewrites.base import Rule, ob
from rewrites.group_partition import GroupPartition


class HeadGrouping(Rule):
    name = "head_grouping"
    params = ("axis", "size", "level")
    summary = "GQA/MQA: group the KV-head axis so the r query heads sharing it stay together"
    proof = "proofs.group_partition"
    groups_axis = True
    # a group partition of size 1, which the tile optimiser already reaches through the
    # group size of group_partition: searching both would only duplicate states
    subsumed_by = "group_partition"

    def shared_axes(self, program, site, axis):
        g = view(body_at(program, site.path))
        reg = region(g, site.ops)
        kv = [v for v in reg.inputs if ob(g, v).type.has(axis)]
        all_axes = {a for v in reg.inputs for a in ob(g, v).type.names}
        return sorted(a for a in all_axes - {axis}
                      if any(not ob(g, v).type.has(a) for v in kv)
                      and any(ob(g, v).type.has(a) for v in reg.inputs)
                      and any(ob(g, v).type.has(a) and ob(g, v).type.has(axis) for v in reg.inputs))

    def check(self, program, site, params):
        axis = params.get("axis")
        GroupPartition().check(program, site, {**params, "level": params.get("level", "smem")})
        shared = self.shared_axes(program, site, axis)
        if not shared:
            raise RuleError(f"head grouping over {axis}: no query-head axis is broadcast for the "
                            f"inputs that carry {axis} (nothing is shared; use group_partition)")

    def apply(self, program, site, params):
        self.check(program, site, params)
        return GroupPartition().apply(program, site, {"size": 1, **params})

    def candidates(self, program, path=()):
        for site, params in GroupPartition().candidates(program, path):
            try:
                self.check(program, site, params)
            except RuleError:
                continue
            yield site, {**params, "size": 1}
