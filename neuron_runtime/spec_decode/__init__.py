"""Speculative decoding: proposers (n-gram, draft model, EAGLE), verification, acceptance.

``decoder.SpecDecoder`` is what the engine holds; ``config.SpeculativeConfig`` what users set.
"""
