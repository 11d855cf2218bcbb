"""Scorers: each turns one view of the candidates into a score in [0, 1] per candidate (llm-d's contract)."""
