"""Sequence layout, buckets and request rules."""

from __future__ import annotations

import pytest
from omnicore.errors import InvalidRequest


@pytest.fixture(scope="module")
def tok(micro_dir):
    from omni_hunyuan.tokenizer import HunyuanTokenizer

    return HunyuanTokenizer.from_dir(micro_dir, 64)


def _spec(**kw):
    from omni_hunyuan.tokenizer import LayoutSpec

    base = {"prompt": "a lighthouse at dusk", "ratio_index": 16, "gen_h": 16, "gen_w": 16, "template": "instruct",
            "cfg_factor": 2}
    return LayoutSpec(**{**base, **kw})


def test_instruct_layout_matches_the_reference_example(tok):
    """instruct template, 20-token prompt, 16x16 grid -> 305 tokens, prompt at 7..26,
    <timestep> at 44, image tokens 45..300 (the tiny tokenizer is byte-level: 20 characters = 20 tokens)."""
    lay = tok.layout(_spec())
    assert (lay.seq_len, lay.prompt_slice, lay.gen_timestep, lay.gen_start, lay.gen_end) == (305, (7, 27), 44, 45, 301)
    cond, uncond = lay.tokens
    ids = tok.ids
    assert cond[0] == ids["bos"] and tok.decode(cond[1:7]) == "User: "
    assert tok.decode(cond[7:27]) == "a lighthouse at dusk"
    assert cond[40:45] == (ids["answer"], ids["boi"], tok.size_id, tok.ratio_ids[16], ids["timestep"])
    assert set(cond[45:301]) == {ids["img"]} and cond[301] == ids["eoi"]
    assert tok.decode(cond[302:]) == "</answer>\n\n"
    # the CFG row: only the user prompt becomes <cfg>, one for one
    assert uncond[7:27] == (ids["cfg"],) * 20
    assert uncond[:7] == cond[:7] and uncond[27:] == cond[27:]
    assert lay.spans == ((45, 301),) and lay.prefix_len == 44 and lay.target_len == 257


def test_pretrain_template_has_no_roles_and_cot_keeps_its_tags(tok):
    lay = tok.layout(_spec(template="pretrain", cot_text="<think>go</think>", system_prompt="sys", cfg_factor=2))
    cond, uncond = lay.tokens
    text = tok.decode(cond[:lay.gen_timestep - 3])
    assert text.endswith("sysa lighthouse at dusk<think>go</think>") and "User" not in text
    think = tok.encode_text("<think>")
    start = cond.index(think[0])
    assert uncond[start] == cond[start] and uncond[start + 1: start + 3] == (tok.ids["cfg"],) * 2
    assert uncond[1:4] == cond[1:4]  # the system prompt stays in the CFG row
    assert cond[lay.gen_end] == tok.ids["eoi"] and lay.seq_len == lay.gen_end + 1


def test_condition_image_section_and_indices(tok):
    from omni_hunyuan.tokenizer import CondImageInfo

    lay = tok.layout(_spec(cond_images=(CondImageInfo(16, 2, 3, 2, 2),), cfg_factor=1))
    (sec,) = lay.cond
    row = lay.tokens[0]
    assert row[sec.timestep - 3: sec.timestep + 1] == (tok.ids["boi"], tok.size_id, tok.ratio_ids[16],
                                                       tok.ids["timestep"])
    assert sec.vae_start == sec.timestep + 1 and sec.vae_end == sec.vae_start + 6
    assert row[sec.vae_end] == tok.ids["joint_sep"] and sec.vit_start == sec.vae_end + 1
    assert row[sec.vit_end] == tok.ids["eoi"]
    assert lay.spans == ((sec.vae_start, sec.vit_end), (lay.gen_start, lay.gen_end))
    assert lay.cond_vae_image_mask[0].nonzero().flatten().tolist() == list(range(sec.vae_start, sec.vae_end))
    assert lay.cond_timestep_scatter_index.tolist() == [[sec.timestep]]
    assert lay.rope_images() == ((sec.vae_start, 2, 3), (sec.vit_start, 2, 2), (lay.gen_start, 16, 16))


def test_distilled_layout_adds_the_guidance_token(tok):
    lay = tok.layout(_spec(guidance_token=True, cfg_factor=1))
    assert lay.guidance_pos == lay.gen_timestep + 1 and lay.gen_start == lay.gen_timestep + 2
    assert lay.tokens[0][lay.guidance_pos] == tok.ids["guidance"] and lay.target_len == 2 + 256


def test_bad_specs_are_rejected(tok):
    with pytest.raises(ValueError, match="cfg_factor"):
        tok.layout(_spec(cfg_factor=3))
    with pytest.raises(ValueError, match="template"):
        tok.layout(_spec(template="chat"))


# ---------------------------------------------------------------------------------------------- buckets
def test_release_buckets_base_1024():
    from omni_hunyuan.buckets import ResolutionGroup

    group = ResolutionGroup(1024)
    assert len(group) == 33
    assert (group.buckets[0].height, group.buckets[0].width) == (512, 2048)
    assert (group.buckets[16].height, group.buckets[16].width) == (1024, 1024)
    assert (group.buckets[-1].height, group.buckets[-1].width) == (2048, 512)
    ratios = [b.ratio for b in group.buckets]
    assert ratios == sorted(ratios) and all(b.height % 64 == 0 and b.width % 64 == 0 for b in group.buckets)


@pytest.mark.parametrize("base", [1024, 256])
def test_every_bucket_snaps_to_itself(base):
    from omni_hunyuan.buckets import ResolutionGroup
    from omni_hunyuan.request_rules import snap_size

    group = ResolutionGroup(base)
    for b in group.buckets:
        assert snap_size(b.height, b.width, group) == b
        # a near size snaps to the same bucket
        assert group.nearest(b.height + 1, b.width).index in (b.index, b.index + 1)


def test_instruct_extras_follow_the_base_buckets():
    from omni_hunyuan.buckets import ResolutionGroup, instruct_extras

    group = ResolutionGroup(1024, extras=instruct_extras(1024))
    assert len(group) == 37
    assert [(b.height, b.width) for b in group.buckets[33:]] == [(768, 1024), (720, 1280), (1024, 768), (1280, 720)]


def test_size_outside_the_buckets_is_one_clear_error():
    from omni_hunyuan.buckets import ResolutionGroup
    from omni_hunyuan.request_rules import snap_size

    with pytest.raises(InvalidRequest) as info:
        snap_size(1024, 200, ResolutionGroup(1024))
    assert info.value.field == "params.height" and "outside the model's resolution buckets" in str(info.value)
    with pytest.raises(InvalidRequest, match="multiple of 16"):
        snap_size(64, 90, ResolutionGroup(64))  # base 64 has buckets the latent grid cannot tile


# ---------------------------------------------------------------------------------------------- rules
@pytest.mark.parametrize("value,expected", [(None, "auto"), ("none", None), ("NONE", None), ("auto", "auto"),
                                            ("image", "image"), ("think", "think"), ("recaption", "recaption"),
                                            ("img_ratio", "img_ratio"), ("think_recaption", "think"),
                                            ("vanilla", "image")])
def test_bot_task_table(value, expected):
    from omni_hunyuan.request_rules import normalize_bot_task

    assert normalize_bot_task(value) == expected


def test_bot_task_rejects_the_rest():
    from omni_hunyuan.request_rules import normalize_bot_task

    with pytest.raises(InvalidRequest, match="Unsupported HunyuanImage3 single-stage bot_task") as info:
        normalize_bot_task("draw")
    assert info.value.field == "extra.bot_task"


def test_cot_gets_its_opening_tag():
    from omni_hunyuan.request_rules import normalize_cot

    assert normalize_cot("plan</think>") == "<think>plan</think>"
    assert normalize_cot("x</recaption>") == "<recaption>x</recaption>"
    assert normalize_cot("<think>a</think>") == "<think>a</think>" and normalize_cot("") is None


def test_guidance_default_and_cfg_rows():
    from omni_hunyuan.request_rules import resolve_guidance

    assert resolve_guidance(None, False) == (5.0, 2)
    assert resolve_guidance(1.0, False) == (1.0, 1)
    assert resolve_guidance(3.0, True) == (3.0, 1)  # CFG-distilled: the <guidance> token path
