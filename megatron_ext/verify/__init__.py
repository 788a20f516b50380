"""Checks of our trainer against other libraries: the parity check (our run recorded through the
trainer's public hooks, replayed by a plain transformers loop, compared step by step)."""
