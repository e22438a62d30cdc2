"""omnicore backend plugin for NVIDIA GPUs: the ``cuda`` platform, attention backends (torch SDPA, flash-attn
varlen when installed, a Triton packed-varlen kernel) and fused Triton platform ops.

Importing this package imports neither torch nor triton; the entry module is :mod:`omni_backends_cuda.plugin`.
"""

__version__ = "0.1.0"
