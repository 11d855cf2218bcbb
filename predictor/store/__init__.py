"""Where accepted observations and published models live: in memory by default, in Redis when shared."""
