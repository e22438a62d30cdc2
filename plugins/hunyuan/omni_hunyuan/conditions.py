"""Condition-image preprocessing for edits: the VAE input (resize-and-center-crop with
LANCZOS to the bucket of the nearest ratio, ``[-1, 1]``) and the SigLIP2 input (transformers' image
processor configured from ``config.json``'s ``vit_processor``).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import numpy as np
import torch
from omnicore.plugin import InvalidRequest
from PIL import Image


def load_image(data: Any, index: int = 0) -> Image.Image:
    """A PIL RGB image from a PIL image, a path or encoded bytes."""
    field = f"inputs[{index}]"
    try:
        if isinstance(data, Image.Image):
            image = data
        elif isinstance(data, (str, Path)):
            image = Image.open(data)
        elif isinstance(data, (bytes, bytearray)):
            import io

            image = Image.open(io.BytesIO(bytes(data)))
        else:
            raise InvalidRequest(field, f"must be a PIL image, a path or image bytes, got {type(data).__name__}")
        image.load()
    except InvalidRequest:
        raise
    except Exception as exc:
        raise InvalidRequest(field, f"cannot read the image: {exc}") from exc
    return image.convert("RGB")


def image_digest(image: Image.Image) -> str:
    """Content hash of the decoded pixels (size + RGB bytes): the same picture in another container hashes
    the same."""
    h = hashlib.sha256(f"{image.width}x{image.height}".encode())
    h.update(image.tobytes())
    return h.hexdigest()


def resize_center_crop(image: Image.Image, width: int, height: int) -> Image.Image:
    w, h = image.size
    if h / w < height / width:
        new_h, new_w = height, round(height / h * w)
    else:
        new_w, new_h = width, round(width / w * h)
    image = image.resize((new_w, new_h), resample=Image.Resampling.LANCZOS)
    top, left = round((new_h - height) / 2.0), round((new_w - width) / 2.0)
    return image.crop((left, top, left + width, top + height))


def vae_pixels(image: Image.Image, width: int, height: int) -> torch.Tensor:
    """``[1, 3, H, W]`` float32 in [-1, 1]."""
    arr = np.asarray(resize_center_crop(image, width, height), dtype=np.float32) / 255.0
    return (torch.from_numpy(arr).permute(2, 0, 1)[None] - 0.5) / 0.5


def make_vit_processor(config: dict[str, Any] | None) -> Any:
    """transformers' SigLIP2 image processor (the PIL backend when torchvision is absent)."""
    fields = {k: v for k, v in (config or {}).items() if k not in ("image_processor_type", "processor_class")}
    cls: Any
    try:
        from transformers import Siglip2ImageProcessorPil as cls
    except ImportError:  # pragma: no cover - older transformers
        from transformers import Siglip2ImageProcessor as cls
    return cls(**fields)


def vit_inputs(processor: Any, image: Image.Image) -> dict[str, torch.Tensor]:
    """``pixel_values [1, P, 3*p*p]``, ``pixel_attention_mask [1, P]``, ``spatial_shapes [1, 2]``."""
    out = processor(images=[image], return_tensors="pt")
    return {"pixel_values": out["pixel_values"], "pixel_attention_mask": out["pixel_attention_mask"],
            "spatial_shapes": out["spatial_shapes"]}
