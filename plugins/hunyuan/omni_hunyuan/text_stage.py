"""The autoregressive text stage of HunyuanImage-3: think / recaption before the image, and the ratio token.

HunyuanImage-3 is one language model that can first *write* — a chain of thought ``<think>…</think>`` and/or a
rewritten prompt ``<recaption>…</recaption>`` after ``"Assistant: "`` — and, when asked to choose the size, emit
``<boi> <img_size_B>`` and a ratio token ``<img_ratio_i>`` (restricted to the ratio tokens, greedy). The image
stage then draws in the same sequence. This module runs that stage on the pipeline's model:

- one causal prefill of the prompt prefix (every token up to the trigger tag) into K/V buffers, then one token per
  step against the cache (greedy, or temperature / top-k / top-p sampling from a CPU generator seeded with the
  request's seed, so a seed gives the same text on any device); requests whose prompts are equally long decode
  as one batch;
- ``think_recaption`` forces ``<recaption>`` after ``</think>``; the text ends at the task's closing tag or at the
  request's budget; with the ratio choice, the template's ``[<answer>] <boi> <img_size_B>`` is forced next and the
  ratio token is picked among the buckets the latent grid can tile;
- the image layout is built from the generated token ids (spliced where user-supplied CoT text goes), and the
  K/V the text stage computed is reused for the image stage's prefix: only positions the text stage did not see
  (the rest of the template, and the CFG row from its first ``<cfg>`` token on) are prefilled. The image stage's
  first denoise step then starts at its ``<timestep>``.

Only ids the tokenizer can decode are ever sampled (checkpoints pad ``vocab_size`` beyond the tokenizer).
For an edit, the prompt holds the condition images (VAE + ViT tokens, bidirectional spans, 2-D positions): the
prefill embeds them as the image stage does and such a request decodes alone.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import torch
from omnicore.plugin import raise_if_cancelled

from .kv_pool import PrefixKVPool, block_hashes
from .tokenizer import HunyuanTokenizer, LayoutSpec
from .transformer.layout import SequenceLayout
from .transformer.model import CondFeatures, HunyuanImage3, PrefixKV
from .transformer.rope import rope_table


@attrs.frozen
class TextPlan:
    """What the text stage does for one request (decided at admission, no model work)."""

    task: str | None  # "think" | "recaption" | "think_recaption" | None (no text)
    ratio: bool  # the model's ratio token chooses the bucket
    max_new_tokens: int
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0

    @property
    def active(self) -> bool:
        return self.task is not None or self.ratio


@attrs.frozen
class TextJob:
    """One request for the text stage: its layout spec, plan, seed, an edit's condition features, and the prefix
    identity the paged pool hashes with the tokens (edits: reference content and VAE seed; empty for T2I)."""

    spec: LayoutSpec
    plan: TextPlan
    seed: int
    cond: CondFeatures | None = None
    identity: str = ""


@attrs.frozen
class TextResult:
    """The text stage's outcome for one request: the image layout (built from its tokens), the prefix K/V of
    every CFG row ready for the first denoise step, the text (``None`` when only the ratio was chosen)."""

    spec: LayoutSpec
    layout: SequenceLayout
    past: PrefixKV
    text: str | None
    token_ids: tuple[int, ...]  # every token the stage appended (text, forced tokens, ratio token)
    cond: CondFeatures | None  # an edit's condition features (the image stage reuses them)
    reused_tokens: int  # prefix positions of the conditional row whose K/V came from the text stage
    metrics: dict[str, float]


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def pick_token(logits: torch.Tensor, temperature: float, top_k: int, top_p: float,
               generator: torch.Generator | None) -> int:
    """One token from float32 CPU ``logits [V]`` (masked entries are ``-inf``): argmax when ``temperature`` is 0,
    else a draw after temperature, top-k and top-p (nucleus; the most likely token always stays)."""
    if temperature <= 0.0:
        return int(torch.argmax(logits))
    scores = logits / temperature
    if 0 < top_k < scores.numel():
        kth = torch.topk(scores, top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if top_p < 1.0:
        order = torch.argsort(scores, descending=True)
        probs = torch.softmax(scores[order], dim=-1)
        cut = torch.cumsum(probs, dim=-1) - probs >= top_p  # the smallest set whose mass reaches top_p stays
        scores[order[cut]] = float("-inf")
    probs = torch.softmax(scores, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


@attrs.define
class _Row:
    """Decode state of one request."""

    index: int
    plan: TextPlan
    spec: LayoutSpec
    base: SequenceLayout  # the image layout without CoT (its first len(prompt) - len(trigger) tokens are the prompt)
    cond: CondFeatures | None
    identity: str
    prompt: list[int]
    trigger: list[int]  # the opening tag the prompt ends with (part of the CoT)
    tail: list[int]  # forced before the ratio token: [<answer>] <boi> <img_size_B>
    generator: torch.Generator
    tokens: list[int] = attrs.Factory(list)  # appended by the stage
    pending: list[int] = attrs.Factory(list)
    phase: str = "text"  # "text" -> ("ratio") -> "done"
    text_count: int = 0
    transitioned: bool = False
    fed: int = 0  # positions whose K/V the buffers hold

    @property
    def sequence(self) -> list[int]:
        return self.prompt + self.tokens


class TextStage:
    """Runs the text stage for a batch of requests on ``model`` (see the module docstring)."""

    def __init__(self, model: HunyuanImage3, tokenizer: HunyuanTokenizer, device: torch.device,
                 vocab_limit: int | None = None, pool: PrefixKVPool | None = None) -> None:
        self.model = model
        #: the paged prefix pool (``paged_scheduler`` mode): the prompt's resident blocks skip the prefill, and
        #: every CFG row's image prefix is published after the stage
        self.pool = pool
        self.tok = tokenizer
        self.device = device
        #: ids >= this are never sampled (the tokenizer's size; the LM's vocab is padded)
        self.vocab_limit = min(int(vocab_limit or len(tokenizer.tok)), model.config.vocab_size)
        ids = tokenizer.ids
        for key in ("think", "end_think", "recaption", "end_recaption"):
            if key not in ids:
                raise ValueError(f"the tokenizer lacks {key!r} ({'<' + key.replace('end_', '/') + '>'}), which the "
                                 "text stage needs")

    # ------------------------------------------------------------------------------------------ rules
    def stops(self, task: str) -> set[int]:
        """The tokens that end the text: ``</recaption>`` when the task recaptions, else ``</think>`` or
        ``</recaption>``."""
        ids = self.tok.ids
        if "recaption" in task:
            return {ids["end_recaption"]}
        return {ids["end_think"], ids["end_recaption"]}

    def end_tag(self, task: str) -> int:
        return self.tok.ids["end_recaption" if "recaption" in task else "end_think"]

    def ratio_candidates(self) -> list[int]:
        """Ratio token ids of the buckets the latent grid can tile (sides divisible by the VAE factor)."""
        factor = self.model.config.vae_downsample_factor[0]
        return [self.tok.ratio_ids[b.index] for b in self.tok.buckets.buckets
                if b.height % factor == 0 and b.width % factor == 0]

    def _row(self, index: int, job: TextJob) -> _Row:
        spec, plan, cond = job.spec, job.plan, job.cond
        gen = torch.Generator(device="cpu").manual_seed(int(job.seed))
        if plan.task is not None:
            base = self.tok.layout(attrs.evolve(spec, cot_ids=None, cot_text=None, cfg_factor=1))
            cot = base.cot_slice[0]
            row = base.tokens[0]
            trigger = [self.tok.ids["recaption" if plan.task == "recaption" else "think"]]
            return _Row(index, plan, spec, base, cond, job.identity, list(row[:cot]) + trigger, trigger,
                        list(row[base.cot_slice[1]:base.gen_timestep - 1]), gen)
        # the ratio only: the prompt is the image layout up to (not including) its ratio token
        base = self.tok.layout(attrs.evolve(spec, cfg_factor=1))
        return _Row(index, plan, spec, base, cond, job.identity, list(base.tokens[0][:base.gen_timestep - 1]), [], [],
                    gen,
                    phase="ratio")

    def _next(self, row: _Row, logits: torch.Tensor) -> None:
        """Choose and append ``row``'s next token from its ``logits`` (float32, CPU)."""
        plan, ids = row.plan, self.tok.ids
        if row.phase == "text":
            if row.pending:
                tok = row.pending.pop(0)
            else:
                masked = logits.clone()
                masked[self.vocab_limit:] = float("-inf")
                tok = pick_token(masked, plan.temperature, plan.top_k, plan.top_p, row.generator)
            row.tokens.append(tok)
            row.text_count += 1
            assert plan.task is not None
            if plan.task == "think_recaption" and tok == ids["end_think"] and not row.transitioned:
                row.transitioned = True
                row.pending = [ids["recaption"]]
            if tok in self.stops(plan.task) or row.text_count >= plan.max_new_tokens:
                row.phase = "ratio" if plan.ratio else "done"
                row.pending = list(row.tail) if plan.ratio else []
            return
        if row.phase == "ratio":
            if row.pending:
                row.tokens.append(row.pending.pop(0))
                return
            candidates = self.ratio_candidates()
            allowed = logits[torch.tensor(candidates)]
            row.tokens.append(candidates[int(torch.argmax(allowed))])  # greedy among the ratio tokens
            row.phase = "done"

    # ------------------------------------------------------------------------------------------ forwards
    def _rope(self, length: int, base: SequenceLayout | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The positions of ``base``'s condition images (when it has any), text positions ``p -> (p, p)``
        elsewhere: the image stage's table over the prompt, 1-D RoPE for the generated text."""
        pos = torch.arange(length)
        table = torch.stack([pos, pos], dim=1)
        if base is not None and base.cond:
            end = min(base.cond[-1].vit_end, length)
            table[:end] = base.positions()[:end]
        cos, sin = rope_table(table, self.model.config.attention_head_dim, self.model.config.rope_theta)
        return cos.to(self.device), sin.to(self.device)

    def _embed(self, layout: SequenceLayout, tokens: torch.Tensor, a: int, b: int,
               cond: CondFeatures | None) -> torch.Tensor:
        """Input embeddings of positions ``[a, b)`` of ``tokens`` (rows of ``layout``): token embeddings, plus the
        condition images where the range covers them (as the image stage embeds them)."""
        if not layout.cond or a > layout.cond[-1].vit_end:
            return self.model.model.wte(tokens[:, a:b])
        rows = tokens.shape[0]
        cfg = self.model.config
        latents = torch.zeros(rows, cfg.latent_channels, layout.gen_h, layout.gen_w, device=self.device)
        t = torch.zeros(rows, device=self.device)
        return self.model.embed_range(layout, tokens, a, b, latents, t, cond)

    def _buffers(self, rows: int, capacity: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer K/V buffers ``[rows, capacity, Hkv, D]``; ``Hkv`` is the layer's own (this rank's share of
        the key/value heads under tensor parallelism)."""
        out = []
        for layer in self.model.model.layers:
            attn: Any = layer.self_attn  # modules.Attention (kv_heads narrowed on a TP rank)
            shape = (rows, capacity, int(attn.kv_heads), int(attn.head_dim))
            out.append((torch.zeros(shape, device=self.device, dtype=self.model.dtype),
                        torch.zeros(shape, device=self.device, dtype=self.model.dtype)))
        return out

    def _forward(self, emb: torch.Tensor, past: PrefixKV, cos: torch.Tensor, sin: torch.Tensor,
                 spans: Sequence[tuple[int, int]] = ()) -> torch.Tensor:
        """Run embeddings ``[R, n, H]`` at positions ``[past.length, past.length + n)`` writing their K/V into
        ``past``'s buffers; returns the last hidden states ``[R, n, H]``."""
        start = past.length
        n = emb.shape[1]
        hidden, _ = self.model.run_layers(emb, cos[start:start + n], sin[start:start + n], spans, past, 0)
        past.length = start + n
        return hidden

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Text logits of the last position ``[R, V]`` (float32, CPU): ``lm_head(ln_f(h))``."""
        return self.model.lm_head(self.model.model.ln_f(hidden[:, -1])).float().cpu()

    # ------------------------------------------------------------------------------------------ the stage
    @torch.no_grad()
    def run(self, jobs: Sequence[TextJob], on_progress: Callable[[int, int, int], None] | None = None
            ) -> list[TextResult]:
        """One result per job, in order. Text-only prompts of equal length decode together (an edit decodes
        alone). ``on_progress(job_index, tokens_written, budget)`` is called as each job's text grows."""
        rows = [self._row(i, job) for i, job in enumerate(jobs)]
        groups: dict[tuple[int, int], list[_Row]] = {}
        for r in rows:
            groups.setdefault((len(r.prompt), r.index if r.base.cond else -1), []).append(r)
        done: dict[int, tuple[dict[str, float], list[tuple[torch.Tensor, torch.Tensor]]]] = {}
        for group in groups.values():
            done.update(self._decode(group, on_progress))
        return [self._finish(r, *done[r.index]) for r in rows]

    def _decode(self, group: list[_Row], on_progress: Callable[[int, int, int], None] | None = None
                ) -> dict[int, tuple[dict[str, float], list[tuple[torch.Tensor, torch.Tensor]]]]:
        """Prefill the group's prompts in one batch, then one token per step until every row is done; returns
        per row its timings and its K/V buffers (valid for its first ``fed`` positions)."""
        t0 = time.perf_counter()
        plen = len(group[0].prompt)
        budget = max(r.plan.max_new_tokens for r in group)
        extra = max(len(r.tail) for r in group) + 2
        capacity = plen + budget + extra
        first = group[0]
        cos, sin = self._rope(capacity, first.base)
        spans = first.base.joint_image_slices  # the condition images' bidirectional spans (edits decode alone)
        past = PrefixKV(self._buffers(len(group), capacity), 0)
        past.length = hit = self._from_pool(group, past)
        prompt = torch.tensor([r.prompt for r in group], dtype=torch.long, device=self.device)
        logits = self.logits(self._forward(self._embed(first.base, prompt, hit, plen, first.cond), past, cos, sin,
                                           spans))
        prefill_s = time.perf_counter() - t0
        for r in group:
            r.fed = plen
        reported = {r.index: -1 for r in group if r.plan.task is not None}
        steps = 0
        while True:
            for j, r in enumerate(group):
                if r.phase != "done":
                    self._next(r, logits[j])
            if on_progress is not None:
                for r in group:
                    if r.index in reported and reported[r.index] != r.text_count:
                        reported[r.index] = r.text_count
                        on_progress(r.index, r.text_count, r.plan.max_new_tokens)
            live = [r for r in group if r.phase != "done"]
            if not live:
                break
            raise_if_cancelled()  # between tokens, like between denoise steps
            feed = torch.tensor([[r.tokens[-1] if r.tokens else r.prompt[-1]] for r in group], dtype=torch.long,
                                device=self.device)
            logits = self.logits(self._forward(self.model.model.wte(feed), past, cos, sin, spans))
            steps += 1
            for r in live:
                r.fed += 1
        decode_s = time.perf_counter() - t0 - prefill_s
        rate = steps / decode_s if decode_s > 0 else 0.0
        return {r.index: ({"text_prefill_s": prefill_s, "text_decode_s": decode_s, "text_pool_hit_tokens": float(hit),
                           "text_tokens_per_s": rate,
                           "text_tokens": float(len(r.tokens)), "text_steps": float(steps),
                           "text_batch": float(len(group))},
                          [(k[j:j + 1], v[j:j + 1]) for k, v in past.layers]) for j, r in enumerate(group)}

    def _from_pool(self, group: list[_Row], past: PrefixKV) -> int:
        """Copy the prompt blocks every row of ``group`` finds resident in the pool into ``past``'s buffers (the
        last prompt token is always computed: its logits start the decode); returns the positions copied."""
        if self.pool is None:
            return 0
        bs = self.pool.block_size
        plen = len(group[0].prompt)
        hashes = [block_hashes(r.prompt, plen - 1, bs, r.identity) for r in group]
        hits = [self.pool.acquire(h) for h in hashes]
        n = min(hits)
        try:
            if n > 0:
                for (k, v), (pk, pv) in zip(past.layers, self.pool.gather_rows([h[:n] for h in hashes])):
                    k[:, :n * bs] = pk
                    v[:, :n * bs] = pv
        finally:
            for h, c in zip(hashes, hits):
                self.pool.release(h[:c])
        return n * bs

    def _publish(self, layout: SequenceLayout, past: PrefixKV, identity: str) -> None:
        """Publish every CFG row's full prefix blocks (what the image stage's first step publishes)."""
        if self.pool is None:
            return
        for r, row in enumerate(layout.tokens):
            hashes = block_hashes(row, layout.prefix_len, self.pool.block_size, identity)
            self.pool.publish(hashes, [k[r, :layout.prefix_len] for k, _ in past.layers],
                              [v[r, :layout.prefix_len] for _, v in past.layers])

    def _finish(self, row: _Row, metrics: dict[str, float], kv: list[tuple[torch.Tensor, torch.Tensor]]) -> TextResult:
        plan, spec = row.plan, row.spec
        text_ids: list[int] = []
        text = None
        if plan.task is not None:
            written = row.tokens[:row.text_count]
            end = self.end_tag(plan.task)
            if end in written:
                written = written[:written.index(end) + 1]
            text_ids = row.trigger + written
            text = self.tok.decode(text_ids)
            spec = attrs.evolve(spec, cot_ids=tuple(text_ids), cot_text=None)
            ids = self.tok.ids
            if (spec.drop_think and ids["think"] in text_ids and ids["recaption"] in text_ids
                    and spec.system_prompt):
                from .request_rules import SYSTEM_PROMPTS

                spec = attrs.evolve(spec, system_prompt=SYSTEM_PROMPTS["en_recaption"])
        if plan.ratio:
            ratio_id = row.tokens[-1]
            index = self.tok.ratio_ids.index(ratio_id)
            bucket = self.tok.buckets.buckets[index]
            factor = self.model.config.vae_downsample_factor[0]
            spec = attrs.evolve(spec, ratio_index=index, gen_h=bucket.height // factor,
                                gen_w=bucket.width // factor)
        layout = self.tok.layout(spec)
        past, reused = self._image_prefix(layout, row.sequence[:row.fed], kv, row.cond)
        self._publish(layout, past, row.identity)
        return TextResult(spec, layout, past, text, tuple(row.tokens), row.cond, reused, metrics)

    def _image_prefix(self, layout: SequenceLayout, seen: Sequence[int], kv: list[tuple[torch.Tensor, torch.Tensor]],
                      cond: CondFeatures | None) -> tuple[PrefixKV, int]:
        """K/V of every CFG row's prefix ``[0, prefix_len)`` in buffers of capacity ``gen_end``: the conditional
        row's from the text stage where its tokens match, the rest prefilled; the CFG row copies the
        conditional row up to its first differing token and prefills from there."""
        n = layout.prefix_len
        tokens = layout.token_tensor(self.device)
        cos, sin = self.model.rope(layout, self.device)
        buffers = self._buffers(layout.rows, layout.gen_end)
        reused = min(_common_prefix(seen, layout.tokens[0][:n]), n)
        for (k, v), (tk, tv) in zip(buffers, kv):
            k[0, :reused] = tk[0, :reused]
            v[0, :reused] = tv[0, :reused]
        spans = layout.joint_image_slices
        if reused < n:
            self._forward(self._embed(layout, tokens[:1], reused, n, cond),
                          PrefixKV([(k[:1], v[:1]) for k, v in buffers], reused), cos, sin, spans)
        for r in range(1, layout.rows):
            shared = min(_common_prefix(layout.tokens[r][:n], layout.tokens[0][:n]), n)
            for k, v in buffers:
                k[r, :shared] = k[0, :shared]
                v[r, :shared] = v[0, :shared]
            if shared < n:
                self._forward(self._embed(layout, tokens[r:r + 1], shared, n, cond),
                              PrefixKV([(k[r:r + 1], v[r:r + 1]) for k, v in buffers], shared), cos, sin, spans)
        return PrefixKV(buffers, n), reused


def reference_greedy(model: HunyuanImage3, prompt: Sequence[int], steps: int, vocab_limit: int,
                     device: torch.device | str = "cpu") -> list[int]:
    """Greedy decoding by a full recompute of the whole sequence at every step (no cache): the independent
    check of :class:`TextStage`'s cached decode (tests, benchmarks)."""
    seq = list(prompt)
    out: list[int] = []
    cfg = model.config
    for _ in range(steps):
        pos = torch.arange(len(seq))
        cos, sin = rope_table(torch.stack([pos, pos], dim=1), cfg.attention_head_dim, cfg.rope_theta)
        ids = torch.tensor([seq], dtype=torch.long, device=device)
        hidden, _ = model.run_layers(model.model.wte(ids), cos.to(device), sin.to(device), (), None, 0)
        logits = model.lm_head(model.model.ln_f(hidden[:, -1])).float()[0]
        logits[vocab_limit:] = float("-inf")
        tok = int(torch.argmax(logits))
        out.append(tok)
        seq.append(tok)
    return out

