"""The search for a program's chain of rule applications (``engine``: best-first over a
networkx state graph, with the cost model as its objective) and the canonical form that
makes two chains reaching one program meet (``canonical``)."""
from napkin.search.engine import (PATIENCE, SIGNIFICANT, Evaluator, Move, SearchResult,  # noqa: F401
                                  State, apply_move, eager_moves, enumerate_chains,
                                  forget_searches, kernel_per_box, moves, search, slow_note)

__all__ = ["Evaluator", "Move", "PATIENCE", "SIGNIFICANT", "SearchResult", "State",
           "apply_move", "eager_moves", "enumerate_chains", "forget_searches", "kernel_per_box",
           "moves", "search", "slow_note"]
