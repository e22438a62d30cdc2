"""Audio of diffusers video pipelines (LTX-2, Kandinsky 6 TI2VA): which pipelines carry it (read from their output
dataclass), the card says so, and the returned waveforms become each Output's ``[channels, samples]`` at the
pipeline's rate — on diffusers' own output classes. No tiny audio-video pipeline is built here (their components
are large): the end-to-end call of such a pipeline is not exercised."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("omni_diffusers")
diffusers = pytest.importorskip("diffusers")
torch = pytest.importorskip("torch")

from omni_diffusers.audio import audio_rows, returns_audio, sample_rate  # noqa: E402


def test_video_pipelines_with_an_audio_output_are_found_and_others_are_not() -> None:
    from diffusers import FluxPipeline, LTX2Pipeline, WanPipeline

    assert returns_audio(LTX2Pipeline)
    assert not returns_audio(WanPipeline) and not returns_audio(FluxPipeline)


def test_the_card_of_an_audio_video_pipeline_lists_audio_among_its_outputs() -> None:
    from diffusers import LTX2Pipeline, WanPipeline
    from omni_diffusers.signature import describe
    from omnicore.plugin import ModelCapabilities, RequestDefaults

    for cls, outputs in ((LTX2Pipeline, ("video", "audio")), (WanPipeline, ("video",))):
        card = describe(object.__new__(cls), ModelCapabilities(), RequestDefaults())  # (signature only)
        assert card.capabilities.outputs == outputs, cls.__name__


def test_waveforms_become_per_row_channels_by_samples() -> None:
    from diffusers.pipelines.ltx2.pipeline_output import LTX2PipelineOutput

    frames = np.zeros((2, 3, 8, 8, 3), dtype=np.float32)
    stereo = torch.linspace(-2, 2, 2 * 2 * 50).reshape(2, 2, 50)
    rows = audio_rows(LTX2PipelineOutput(frames=frames, audio=stereo), 2)
    assert [r.shape for r in rows if r is not None] == [(2, 50), (2, 50)]
    assert rows[1] is not None and rows[1].dtype == np.float32 and rows[1].max() == 1.0  # clipped to [-1, 1]
    np.testing.assert_array_equal(rows[0], stereo[0].clamp(-1, 1).numpy())
    mono = audio_rows(LTX2PipelineOutput(frames=frames, audio=np.zeros((2, 40))), 2)
    assert [r.shape for r in mono if r is not None] == [(1, 40), (1, 40)]
    assert audio_rows(LTX2PipelineOutput(frames=frames, audio=None), 2) == [None, None]  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="for 3 outputs"):
        audio_rows(LTX2PipelineOutput(frames=frames, audio=stereo), 3)


def test_the_sample_rate_is_the_vocoders_output_rate_first() -> None:
    from diffusers.configuration_utils import FrozenDict

    class Vocoder:
        config = FrozenDict(sampling_rate=16000, output_sampling_rate=24000)

    class Pipe:
        vocoder = Vocoder()
        audio_sample_rate = 44100

    assert sample_rate(Pipe()) == 24000  # LTX-2: the vocoder's output rate, not its mel rate
    del Vocoder.config
    assert sample_rate(Pipe()) == 44100
    assert sample_rate(object()) is None
