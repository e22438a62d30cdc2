"""The LingBot-Video DiT: config, building blocks and the packed-sequence model.

Submodules are imported explicitly (``omni_lingbot.transformer.config`` stays torch-free so specs and
loaders can read a ``config.json`` without importing torch).
"""
