"""Prompt template and default negative prompts as deployment settings (issue 14 §5): model option > checkpoint
file > built-in text, read once at load."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _lingbot_helpers import load, request
from omni_lingbot.prompts import (
    DEFAULT_NEGATIVE_PROMPT_IMAGE,
    DEFAULT_NEGATIVE_PROMPT_VIDEO,
    PROMPT_TEMPLATE,
    load_prompt_texts,
)
from omnicore.errors import ConfigError

TEMPLATE = "<|im_start|>system\nDescribe the clip.<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
NEGATIVE = json.dumps({"universal_negative": {"visual_quality": ["blurry", "low quality"]}})


def test_built_in_texts_when_nothing_is_given(tmp_path):
    texts = load_prompt_texts(tmp_path, {})
    assert (texts.template, texts.negative_video, texts.negative_image) == (
        PROMPT_TEMPLATE, DEFAULT_NEGATIVE_PROMPT_VIDEO, DEFAULT_NEGATIVE_PROMPT_IMAGE)
    assert set(texts.sources.values()) == {"built-in"}
    assert texts.negative_prompt("t2i") == DEFAULT_NEGATIVE_PROMPT_IMAGE
    assert texts.negative_prompt("ti2v") == texts.negative_prompt("t2v") == DEFAULT_NEGATIVE_PROMPT_VIDEO


def test_checkpoint_files_replace_the_built_in_texts(tmp_path):
    (tmp_path / "prompt_template.txt").write_text(TEMPLATE)
    (tmp_path / "default_negative_prompt.json").write_text(NEGATIVE + "\n")
    (tmp_path / "default_negative_prompt_image.txt").write_text("  blurry still  \n")
    texts = load_prompt_texts(tmp_path, {})
    assert texts.template == TEMPLATE  # byte for byte: its final newline ends the assistant turn
    assert texts.negative_video == NEGATIVE and texts.negative_image == "blurry still"
    assert texts.sources["negative_prompt"] == str(tmp_path / "default_negative_prompt.json")


def test_model_options_beat_checkpoint_files(tmp_path):
    (tmp_path / "default_negative_prompt.json").write_text(NEGATIVE)
    neg_file = tmp_path / "neg.txt"
    neg_file.write_text("from a file\n")
    texts = load_prompt_texts(tmp_path, {"negative_prompt": "ugly", "negative_prompt_image": f"@{neg_file}",
                                         "prompt_template": TEMPLATE})
    assert (texts.negative_video, texts.negative_image, texts.template) == ("ugly", "from a file", TEMPLATE)
    assert texts.sources == {"negative_prompt": "option", "negative_prompt_image": str(neg_file),
                             "prompt_template": "option"}


@pytest.mark.parametrize("template", ["no slot", "{} twice {}"])
def test_a_template_needs_one_caption_slot(tmp_path, template):
    with pytest.raises(ConfigError, match="caption slot") as info:
        load_prompt_texts(tmp_path, {"prompt_template": template})
    assert info.value.name == "model_options.prompt_template"


def test_unreadable_option_file_names_the_option(tmp_path):
    with pytest.raises(ConfigError) as info:
        load_prompt_texts(tmp_path, {"negative_prompt": f"@{tmp_path / 'missing.txt'}"})
    assert info.value.name == "model_options.negative_prompt"


@pytest.fixture(scope="module")
def custom_dir(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny checkpoint with the prompt files a real checkpoint may ship."""
    root = tmp_path_factory.mktemp("tiny-lingbot-prompts")
    for item in tiny_dir.iterdir():
        (root / item.name).symlink_to(item)
    (root / "prompt_template.txt").write_text(TEMPLATE)
    (root / "default_negative_prompt.json").write_text(NEGATIVE)
    return root


def test_the_pipeline_uses_the_checkpoint_texts(custom_dir, pipe):
    custom = load(custom_dir)
    assert custom.prompts.template == TEMPLATE and custom.text_encoder.template == TEMPLATE
    # the cropped prefix is the new template's, so the DiT still sees only the user turn
    prefix = TEMPLATE.split("{}")[0]
    assert custom.text_encoder.crop_start == len(custom.text_encoder.tokenizer(prefix, add_special_tokens=False)
                                                 ["input_ids"]) != pipe.text_encoder.crop_start
    prepared = custom.preprocess(request())
    assert prepared.negative_prompt == NEGATIVE  # the deployment's default negative for video modes
    assert custom.preprocess(request(modalities=("image",))).negative_prompt == DEFAULT_NEGATIVE_PROMPT_IMAGE
    assert custom.preprocess(request(negative_prompt="")).negative_prompt == ""  # an explicit one still wins
    assert pipe.preprocess(request()).negative_prompt == DEFAULT_NEGATIVE_PROMPT_VIDEO


def test_engine_model_options_reach_the_pipeline(tmp_path):
    """``Engine(..., model_options=...)`` (CLI ``--model-option``) sets the deployment's default negative prompt."""
    from omnicore.config import Settings
    from omnicore.engine.api import Engine
    from omnicore.plugin_host.host import PluginHost

    host = PluginHost(Settings(cache_dir=str(tmp_path / "cache"), plugins=("lingbot",)))
    with Engine("tiny:lingbot", host=host, settings=Settings(cache_dir=str(tmp_path / "cache")),
                model_options={"negative_prompt": "grainy"}) as engine:
        assert engine.pipeline.prompts.negative_video == "grainy"
        assert engine.pipeline.prompts.sources["negative_prompt"] == "option"
        assert engine.pipeline.preprocess(request()).negative_prompt == "grainy"
