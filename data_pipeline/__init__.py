"""Corpus readers, tokenizer training, memory-mapped shards and sample builders."""
