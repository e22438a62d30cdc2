"""``GenerationRequest.seeded``: the one place a missing seed is filled (the engine and the model pool both call it)."""

from __future__ import annotations

from omnicore.engine.request import MAX_SEED, GenerationRequest, SamplingParams


def _request(seed: int | None = None, n: int = 1) -> GenerationRequest:
    return GenerationRequest(prompt="p", params=SamplingParams(seed=seed, num_outputs=n))


def test_a_request_seed_is_kept() -> None:
    request = _request(seed=7)
    assert request.seeded(3) is request


def test_the_model_default_comes_before_a_draw() -> None:
    assert _request().seeded(3).params.seed == 3


def test_a_draw_leaves_room_for_every_output_seed() -> None:
    drawn = [_request(n=4).seeded().params.seed for _ in range(50)]
    assert all(s is not None and 0 <= s <= MAX_SEED - 3 for s in drawn)
    assert len(set(drawn)) > 1  # drawn, not a constant
