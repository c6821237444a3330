"""Data: the NLG sets (strict JSONL, raw-source converters), tokenizers, training batches, SST-2 and the embedded toy set."""
