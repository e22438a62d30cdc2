"""omnicore backend plugin for Ascend NPUs: the ``npu`` platform, the MindIE-SD attention paths (TND varlen,
prefix-K/V laser, masked) behind one op seam, and RainFusion block-sparse plans.

Importing this package imports neither torch nor torch_npu; the entry module is :mod:`omni_backends_npu.plugin`.
"""

__version__ = "0.1.0"
