"""The diagram core: arrays with named axes, diagrams (DisCoPy Markov), the primitives and
their declared facts, the array backend they are written against, streamed bodies (groups,
streams), regions and the networkx view of a diagram, the pattern matcher, the semantics and
FLOP functors.  It knows nothing of rules, search or kernels."""
