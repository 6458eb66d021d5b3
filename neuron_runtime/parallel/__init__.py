"""One engine replica over several processes: parallel state, collectives, sharded layers,
the multiprocess executor (tensor, expert and data parallelism)."""
