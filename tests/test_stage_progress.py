"""T5 Encode and VAE Decode report progress when their model is ready and when they are done (the nodes
drive ComfyUI's progress bar with it); a callback that raises — ComfyUI's Cancel — ends the stage and
frees its model."""

from __future__ import annotations

import pytest
import torch

from pixart_lowvram.core import text_encoder, vae

FP32 = {"device": "cpu", "precision": torch.float32}


def test_encode_and_decode_report_progress(tiny, reference):
    seen: list[tuple[str, int, int]] = []
    text_encoder.encode(
        text_encoder.EncoderSettings(tiny, quantization="none", **FP32),
        "a cat",
        on_progress=lambda d, t, _latents: seen.append(("t5", d, t)),
    )
    vae.decode(
        vae.DecoderSettings(tiny, **FP32),
        reference.latents,
        on_progress=lambda d, t, _latents: seen.append(("vae", d, t)),
    )
    assert seen == [("t5", 1, 2), ("t5", 2, 2), ("vae", 1, 2), ("vae", 2, 2)]


class Cancelled(RuntimeError):
    pass


def cancel(done: int, _total: int, _latents: torch.Tensor | None) -> None:
    if done == 1:
        raise Cancelled


@pytest.mark.parametrize("stage", ["text_encoder", "vae"])
def test_a_cancel_at_the_progress_point_frees_the_model(tiny, reference, load_spy, stage):
    with pytest.raises(Cancelled):
        if stage == "text_encoder":
            settings = text_encoder.EncoderSettings(tiny, quantization="none", keep_loaded=True, **FP32)
            text_encoder.encode(settings, "a cat", on_progress=cancel)
        else:
            settings = vae.DecoderSettings(tiny, keep_loaded=True, **FP32)
            vae.decode(settings, reference.latents, on_progress=cancel)
    assert load_spy.alive(stage) == [False], "a cancelled stage keeps nothing, even with keep_loaded"
