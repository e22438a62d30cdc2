"""omnicore plugin for LingBot-Video (text-to-image, text-to-video, text-and-image-to-video).

Importing the package is cheap; the pipeline (torch, diffusers, transformers) loads lazily through the
model spec registered in :mod:`omni_lingbot.plugin`.
"""

__version__ = "0.1.0"
