"""Test helpers: the tiny tokenizer, tiny random checkpoints and the embedded tiny model."""
