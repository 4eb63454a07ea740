"""The engine: scheduler-driven steps over the paged model runner, sampling, detokenization."""
