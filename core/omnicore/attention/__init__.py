"""Attention: the reference implementation (SDPA per document) and packed-sequence metadata.

Every attention backend takes the reference signature of :func:`omnicore.attention.reference.sdpa_attention`
and is tested against it.
"""
