"""State every router shares: the block index and the load board, read under a budget."""
