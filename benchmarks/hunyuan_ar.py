"""HunyuanImage-3's text stage (think / recaption): tokens per second, and what reusing its K/V saves.

Arm A is what omnicore does for a ``bot_task="think"`` request: ``encode()`` runs the text stage (one prefill of
the prompt, then one token per step against the cache) and hands its K/V to the image stage, whose first denoise
step computes only the positions the text stage did not see. Arm B re-prefills: the same text stage, then the
image stage computes the whole sequence again at its first step (``pipeline.reuse_text_kv = False``; the same
tokens, so the same sequence length). Both arms end after denoise step 0: the ratio is time to the first denoise
step, and ``max_abs_diff`` shows the latents after it agree.

Cases: a mid-size model (hidden 256, 8 heads of 32 with 2 K/V heads, 4 MoE layers of 8 experts top-2) with a
~1k-token prompt and 32 generated tokens (greedy; random weights: the text is noise, the lengths are what count),
and a 4-request batch decode vs the same 4 one by one (tokens per second of the stage).

Goal: ``ratio <= 0.6`` for reuse vs re-prefill. Run: ``python benchmarks/hunyuan_ar.py [--threads 1]``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import Case, Goal, main, ratio_at_most

MID = {"hidden_size": 256, "num_attention_heads": 8, "num_key_value_heads": 2, "attention_head_dim": 32,
       "num_hidden_layers": 4, "intermediate_size": 512, "moe_intermediate_size": 256, "num_experts": 8,
       "moe_topk": 2, "patch_embed_hidden_dim": 64}
WORDS = ("a lighthouse on a rocky cape at dusk warm light in the lantern room long exposure clouds streaming over "
         "a violet sky waves breaking white against black basalt a narrow path with a wooden railing gulls resting "
         "on the rail a small red boat moored in the cove reflections on wet stones").split()
NEW_TOKENS = 32


def load(root: Path, **opts: Any) -> Any:
    from omni_hunyuan.pipeline import HunyuanImage3Pipeline
    from omnicore.engine.protocol import LoadOptions
    from omnicore.platforms.cpu import CpuPlatform

    return HunyuanImage3Pipeline.from_pretrained(root, LoadOptions(platform=CpuPlatform(), model_options=opts))


def prompt_of(pipe: Any, tokens: int) -> str:
    """A prompt of about ``tokens`` tokens under the checkpoint's tokenizer."""
    words: list[str] = []
    while len(pipe.tokenizer.encode_text(" ".join(words))) < tokens:
        words.extend(WORDS)
    while len(pipe.tokenizer.encode_text(" ".join(words))) > tokens:
        words.pop()
    return " ".join(words)


def request(prompt: str, size: int, seed: int = 5, **extra: Any) -> Any:
    from omnicore.engine.request import GenerationRequest, SamplingParams

    return GenerationRequest(prompt, SamplingParams(height=size, width=size, num_inference_steps=8, seed=seed,
                                                    guidance_scale=4.0), extra=extra)


def first_step(pipe: Any, req: Any) -> Any:
    state = pipe.encode([pipe.preprocess(req)])
    return pipe.denoise_step(state, 0)


def reuse_case(pipe: Any, prompt: str, size: int, reps: int) -> Case:
    think = request(prompt, size, bot_task="think", max_new_tokens=NEW_TOKENS)
    state = pipe.encode([pipe.preprocess(think)])

    def run_a() -> Any:
        return first_step(pipe, think).latents

    def run_b() -> Any:
        pipe.reuse_text_kv = False  # the same text stage, then the image stage prefills everything again
        try:
            return first_step(pipe, think).latents
        finally:
            pipe.reuse_text_kv = True

    def compare(a: torch.Tensor, b: torch.Tensor) -> dict[str, Any]:
        return {"max_abs_diff": float((a - b).abs().max())}

    item = state.extras["items"][0]
    metrics = item["text_metrics"]
    extra = {"prompt_tokens": len(pipe.tokenizer.encode_text(prompt)), "new_tokens": int(metrics["text_tokens"]),
             "sequence": item["layout"].gen_end, "text_reused_tokens": int(metrics["text_reused_tokens"]),
             "text_tokens_per_s": round(metrics["text_tokens_per_s"], 1), "hidden_size": pipe.config.hidden_size,
             "layers": pipe.config.num_hidden_layers, "threads": torch.get_num_threads()}
    return Case("hunyuan_ar", f"mid_h256_l4_{extra['prompt_tokens']}tok_prompt_{size}px", "text_kv_reused",
                "re_prefill", run_a, run_b, goal=(ratio_at_most(0.6), Goal("<=", 1e-4, "max_abs_diff")), reps=reps,
                warmup=1, compare=compare, extra=extra)


def batch_case(pipe: Any, prompt: str, size: int, reps: int) -> Case:
    from omni_hunyuan.text_stage import TextJob

    resolved = pipe.preprocess(request(prompt, size, bot_task="think", max_new_tokens=NEW_TOKENS)).plan
    jobs = [TextJob(resolved.spec, resolved.text, seed) for seed in range(4)]
    tokens = 4 * NEW_TOKENS

    def run_a() -> Any:
        return pipe.text_stage.run(jobs)

    def run_b() -> Any:
        return [pipe.text_stage.run([j])[0] for j in jobs]

    def compare(a: Any, b: Any) -> dict[str, Any]:
        return {"same_tokens": [r.token_ids for r in a] == [r.token_ids for r in b], "tokens": tokens}

    return Case("hunyuan_ar", "mid_text_stage_4_requests", "batched_decode", "one_by_one", run_a, run_b,
                goal=ratio_at_most(1.0), reps=reps, warmup=1, compare=compare,
                extra={"prompt_tokens": len(pipe.tokenizer.encode_text(prompt))})


def cases(args: argparse.Namespace) -> Any:
    from omni_hunyuan.presets import build_tiny

    torch.set_num_threads(args.threads)
    with torch.no_grad(), tempfile.TemporaryDirectory(prefix="hunyuan-ar-") as tmp:
        mid = load(build_tiny(Path(tmp) / "mid", overrides=MID))
        prompt = prompt_of(mid, args.prompt_tokens)
        yield reuse_case(mid, prompt, 256, args.reps)
        yield batch_case(mid, prompt_of(mid, 256), 256, args.reps)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--prompt-tokens", type=int, default=1000)
    known, rest = parser.parse_known_args()
    raise SystemExit(main(lambda: cases(known), rest))
