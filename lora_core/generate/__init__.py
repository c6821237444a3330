"""Generation without tensors: beam-search bookkeeping and scoring, the preallocated cache layout, attention masks and positions, and generated ids to the evaluators' files."""
