"""Read-only facts of the captured graph, computed once per compile: graph facts, sharding
propagation, FLOP/byte costs, the recompute set and the graph partition. Nothing here
changes a graph or decides a layout (docs/architecture.md)."""
