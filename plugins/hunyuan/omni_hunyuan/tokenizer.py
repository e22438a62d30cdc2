"""Tokenizer wrapper: templates, special tokens and the generated/condition image sections.

Segments are tokenised independently (no merges across boundaries) and concatenated:

- ``pretrain``: ``<bos> [system] [cond images] prompt [cot] <gen image>``
- ``instruct``: ``<bos> [system "\\n\\n"] "User: " [cond images] prompt "\\n\\n" "Assistant: " [cot] "<answer>"
  <gen image> "</answer>" "\\n\\n"``

Generated image: ``<boi> <img_size_B> <img_ratio_i> <timestep> [<guidance>] [<timestep_r>] <img>*N <eoi>``;
condition image: ``<boi> <img_size_B> <img_ratio_i> <timestep> <img>*N_vae <joint_img_sep> <img>*N_vit <eoi>``.
The CFG row replaces the prompt's (and the CoT body's) tokens with ``<cfg>`` one for one; system and role text
stay, so both rows are equally long.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs

from .buckets import ResolutionGroup, instruct_extras
from .transformer.layout import CondSection, SequenceLayout

SPECIAL_TOKENS = {
    "bos": "<|startoftext|>", "eos": "<|endoftext|>", "pad": "<pad>", "boi": "<boi>", "eoi": "<eoi>",
    "img": "<img>", "cfg": "<cfg>", "timestep": "<timestep>", "guidance": "<guidance>", "timestep_r": "<timestep_r>",
    "joint_sep": "<joint_img_sep>", "answer": "<answer>", "end_answer": "</answer>", "think": "<think>",
    "end_think": "</think>", "recaption": "<recaption>", "end_recaption": "</recaption>",
}
#: The tokens a checkpoint's tokenizer must know for the diffusion path.
REQUIRED = ("bos", "boi", "eoi", "img", "cfg", "timestep", "joint_sep")
INSTRUCT_EXTRA_RATIOS = 4


@attrs.frozen
class CondImageInfo:
    """A condition image's token grids: VAE latent ``(h, w)`` and ViT patch grid ``(h, w)``."""

    ratio_index: int
    vae_h: int
    vae_w: int
    vit_h: int
    vit_w: int


@attrs.frozen
class LayoutSpec:
    """Everything the token layout depends on (hashable; the prepared layout is a function of it)."""

    prompt: str
    ratio_index: int
    gen_h: int
    gen_w: int
    template: str = "pretrain"
    system_prompt: str | None = None
    cot_text: str | None = None
    #: the CoT as token ids (the text stage's own tokens, tags included): used instead of ``cot_text`` so the
    #: image stage sees exactly the sequence whose K/V the text stage computed
    cot_ids: tuple[int, ...] | None = None
    cond_images: tuple[CondImageInfo, ...] = ()
    cfg_factor: int = 1
    guidance_token: bool = False
    timestep_r_token: bool = False
    drop_think: bool = False


class HunyuanTokenizer:
    """Wraps a Hugging Face tokenizer holding the Hunyuan special tokens."""

    def __init__(self, tokenizer: Any, image_base_size: int) -> None:
        self.tok = tokenizer
        vocab = tokenizer.get_vocab()
        self.ids: dict[str, int] = {k: vocab[v] for k, v in SPECIAL_TOKENS.items() if v in vocab}
        missing = [SPECIAL_TOKENS[k] for k in REQUIRED if k not in self.ids]
        size_token = f"<img_size_{image_base_size}>"
        if size_token not in vocab:
            missing.append(size_token)
        if missing:
            raise ValueError(f"the tokenizer lacks the special tokens {missing}")
        self.size_id = vocab[size_token]
        self.ratio_ids: list[int] = []
        while f"<img_ratio_{len(self.ratio_ids)}>" in vocab:
            self.ratio_ids.append(vocab[f"<img_ratio_{len(self.ratio_ids)}>"])
        base = ResolutionGroup(image_base_size)
        extras = instruct_extras(image_base_size) if len(self.ratio_ids) >= len(base) + INSTRUCT_EXTRA_RATIOS else ()
        self.buckets = ResolutionGroup(image_base_size, extras=extras)
        if len(self.ratio_ids) < len(self.buckets):
            raise ValueError(f"the tokenizer has {len(self.ratio_ids)} <img_ratio_i> tokens; the base size "
                             f"{image_base_size} needs {len(self.buckets)}")
        self.image_base_size = image_base_size

    @classmethod
    def from_dir(cls, path: Path, image_base_size: int) -> HunyuanTokenizer:
        if (Path(path) / "tokenizer.json").is_file():
            from transformers import PreTrainedTokenizerFast

            return cls(PreTrainedTokenizerFast.from_pretrained(str(path)), image_base_size)
        from transformers import AutoTokenizer  # pragma: no cover - checkpoints without tokenizer.json

        return cls(AutoTokenizer.from_pretrained(str(path)), image_base_size)

    def encode_text(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False)) if text else []

    # ------------------------------------------------------------------------------------------ layout
    def _image_head(self, ratio_index: int) -> list[int]:
        return [self.ids["boi"], self.size_id, self.ratio_ids[ratio_index], self.ids["timestep"]]

    def _cot(self, text: str, uncond: bool, drop_think: bool) -> list[int]:
        """CoT text: the tags stay, the bodies become ``<cfg>`` in the CFG row."""
        for open_tag, close_tag in (("<think>", "</think>"), ("<recaption>", "</recaption>")):
            if open_tag in text and close_tag in text:
                before, rest = text.split(open_tag, 1)
                body, after = rest.split(close_tag, 1)
                inner = [] if drop_think and open_tag == "<think>" else (
                    self.encode_text(open_tag) + self._maybe_cfg(self.encode_text(body), uncond)
                    + self.encode_text(close_tag))
                return self._cot(before, uncond, drop_think) + inner + self._cot(after, uncond, drop_think)
        return self._maybe_cfg(self.encode_text(text), uncond)

    def _cot_ids(self, ids: Sequence[int], uncond: bool, drop_think: bool) -> list[int]:
        """:meth:`_cot` over token ids: tag pairs are the special tokens; bodies become ``<cfg>`` in the CFG row,
        a think section is dropped with ``drop_think``; ids outside a complete pair are treated as plain text."""
        ids = list(ids)
        for open_key, close_key in (("think", "end_think"), ("recaption", "end_recaption")):
            o, c = self.ids.get(open_key), self.ids.get(close_key)
            if o is None or c is None or o not in ids:
                continue
            i = ids.index(o)
            if c not in ids[i + 1:]:
                continue
            j = ids.index(c, i + 1)
            inner = [] if drop_think and open_key == "think" else [o] + self._maybe_cfg(ids[i + 1:j], uncond) + [c]
            return (self._cot_ids(ids[:i], uncond, drop_think) + inner
                    + self._cot_ids(ids[j + 1:], uncond, drop_think))
        return self._maybe_cfg(ids, uncond)

    def _maybe_cfg(self, ids: list[int], uncond: bool) -> list[int]:
        return [self.ids["cfg"]] * len(ids) if uncond else ids

    def _row(self, spec: LayoutSpec, uncond: bool) -> tuple[list[int], dict[str, Any]]:
        instruct = spec.template == "instruct"
        seq: list[int] = [self.ids["bos"]]
        marks: dict[str, Any] = {"cond": []}
        if spec.system_prompt:
            seq += self.encode_text(spec.system_prompt) + (self.encode_text("\n\n") if instruct else [])
        if instruct:
            seq += self.encode_text("User: ")
        for info in spec.cond_images:
            seq += self._image_head(info.ratio_index)
            timestep = len(seq) - 1
            vae_start = len(seq)
            seq += [self.ids["img"]] * (info.vae_h * info.vae_w) + [self.ids["joint_sep"]]
            vit_start = len(seq)
            seq += [self.ids["img"]] * (info.vit_h * info.vit_w) + [self.ids["eoi"]]
            marks["cond"].append(CondSection(timestep, vae_start, info.vae_h, info.vae_w, vit_start, info.vit_h,
                                             info.vit_w))
        prompt_start = len(seq)
        seq += self._maybe_cfg(self.encode_text(spec.prompt), uncond)
        marks["prompt"] = (prompt_start, len(seq))
        if instruct:
            seq += self.encode_text("\n\n") + self.encode_text("Assistant: ")
        cot_start = len(seq)
        if spec.cot_ids:
            seq += self._cot_ids(spec.cot_ids, uncond, spec.drop_think)
        elif spec.cot_text:
            seq += self._cot(spec.cot_text, uncond, spec.drop_think)
        marks["cot"] = (cot_start, len(seq))
        if instruct:
            seq += self.encode_text("<answer>")
        seq += self._image_head(spec.ratio_index)
        marks["timestep"] = len(seq) - 1
        if spec.guidance_token:
            marks["guidance"] = len(seq)
            seq.append(self.ids["guidance"])
        if spec.timestep_r_token:
            marks["timestep_r"] = len(seq)
            seq.append(self.ids["timestep_r"])
        marks["gen_start"] = len(seq)
        seq += [self.ids["img"]] * (spec.gen_h * spec.gen_w) + [self.ids["eoi"]]
        if instruct:
            seq += self.encode_text("</answer>") + self.encode_text("\n\n")
        return seq, marks

    def layout(self, spec: LayoutSpec) -> SequenceLayout:
        """The token rows and indices for ``spec`` (``cfg_factor`` rows: ``[cond]`` or ``[cond, uncond]``)."""
        if spec.cfg_factor not in (1, 2):
            raise ValueError(f"cfg_factor must be 1 or 2, got {spec.cfg_factor}")
        if spec.template not in ("pretrain", "instruct"):
            raise ValueError(f"sequence template must be 'pretrain' or 'instruct', got {spec.template!r}")
        rows, marks = [], None
        for r in range(spec.cfg_factor):
            seq, m = self._row(spec, uncond=r == 1)
            rows.append(tuple(seq))
            if marks is None:
                marks = m
            elif m != marks:  # pragma: no cover - the substitution keeps lengths
                raise ValueError("the CFG row's layout differs from the conditional row's")
        assert marks is not None
        return SequenceLayout(
            tokens=tuple(rows), template=spec.template, image_base_size=self.image_base_size,
            ratio_index=spec.ratio_index, gen_h=spec.gen_h, gen_w=spec.gen_w, gen_timestep=marks["timestep"],
            gen_start=marks["gen_start"], guidance_pos=marks.get("guidance"), timestep_r_pos=marks.get("timestep_r"),
            cond=tuple(marks["cond"]), prompt_slice=marks["prompt"], cot_slice=marks["cot"],
        )

    def decode(self, ids: Sequence[int]) -> str:
        return self.tok.decode(list(ids))
