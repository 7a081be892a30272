"""Data: batches of token ids and next-token targets (`batches`), split over data-parallel ranks
and microbatches; the one place a real dataset and a context-parallel split plug in."""
