"""omnicore plugin for HunyuanImage-3.0: text-to-image and image edit inside a unified MoE language model.

Importing the package is cheap; the pipeline (torch, transformers) loads lazily through the model spec
registered in :mod:`omni_hunyuan.plugin`.
"""

__version__ = "0.1.0"
