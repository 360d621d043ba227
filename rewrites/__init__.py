"""The rule library: one module per rule, each naming the proof that backs it.

``RULES`` are rewrites (check/apply at a site); ``STREAMABILITY`` are the
accumulators the stream partition recognises (it offers boxes to the rules with
the largest claims first: ``Streamability.boxes_per_claim``).
"""
from rewrites.accumulators import STREAMABILITY
from rewrites.base import Claim, Rule, Streamability
from rewrites.group_partition import GroupPartition
from rewrites.head_grouping import HeadGrouping
from rewrites.normalized_contraction import NormalizedContraction
from rewrites.recognize import Recognize
from rewrites.recompute import Recompute, RecomputeProduct, RecomputeWide
from rewrites.relabel_level import RelabelLevel
from rewrites.softmax_lse import SoftmaxLse
from rewrites.split_stream import SplitStream
from rewrites.split_sum import SplitSum
from rewrites.stream_partition import StreamPartition
from rewrites.untie import UntieTiles

RULES: dict[str, Rule] = {r.name: r for r in (
    GroupPartition(), StreamPartition(), NormalizedContraction(), HeadGrouping(), RelabelLevel(),
    Recognize(), Recompute(), RecomputeProduct(), RecomputeWide(), SoftmaxLse(), SplitStream(), SplitSum(), UntieTiles())}


def get_rule(name: str) -> Rule:
    if name not in RULES:
        from napkin.core.errors import RuleError
        raise RuleError(f"unknown rule {name!r}; known: {', '.join(RULES)}")
    return RULES[name]


__all__ = ["Claim", "RULES", "Rule", "STREAMABILITY", "Streamability", "get_rule"]
