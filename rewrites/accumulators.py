"""The accumulators the stream partition recognises, in one list (``rewrites.STREAMABILITY``):
a module of its own, so that the stream partition reads it without importing the package
that imports the stream partition."""
from rewrites.base import Streamability
from rewrites.logsumexp import LogSumExp
from rewrites.max_reduce import MaxReduce
from rewrites.softmax_contraction import SoftmaxContraction
from rewrites.sum_contraction import SumContraction

STREAMABILITY: list[Streamability] = [SoftmaxContraction(), LogSumExp(), MaxReduce(), SumContraction()]
