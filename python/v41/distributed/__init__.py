"""Tensor parallelism: the group the model sees (:mod:`.group`), collective backends (:mod:`.torch_backend`).

Kept import-light on purpose: the model imports :mod:`.group`, so nothing here may import the engine.
"""
