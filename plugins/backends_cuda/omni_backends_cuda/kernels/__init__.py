"""Triton kernels (import triton; loaded only through the op table or the attention backend)."""
