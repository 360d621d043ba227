"""The schedule: a streamed program as one loop nest, built once.

    s = build(program, "h100", dtype="bf16")
    s.root            # Loop: kernels, groups (grids), streams (folds), their sections
    s.memory          # {level: (values, bytes) peak candidates}
    s.tiles           # {g_q: TileInfo(...)}, the divisibility each tile needs

The walk that decides where every array lives, what moves when, and what is live at once
happens here and nowhere else: :func:`napkin.cost.cost` folds the nest into transfers,
memory, FLOPs and time, :func:`napkin.views.pseudocode.pseudocode` renders it.  See
:mod:`napkin.schedule.nest` for the data and :mod:`napkin.schedule.build` for the walk.
"""
from napkin.schedule.build import ScheduleError, build, bytes_per_value
from napkin.schedule.nest import (
    Assign, Buffer, ContractionRecord, Loop, Move, Peak, Schedule, Step, TileInfo, as_max,
    nonneg, prune,
)

__all__ = ["Assign", "Buffer", "ContractionRecord", "Loop", "Move", "Peak", "Schedule",
           "ScheduleError", "Step", "TileInfo", "as_max", "build", "bytes_per_value", "nonneg",
           "prune"]
