"""Training without tensors: the loop and its tasks, recipes, data order, schedules, the AdamW spec, precision, data parallelism and the run folder's files."""
