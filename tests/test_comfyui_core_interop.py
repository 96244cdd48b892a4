"""Interop with ComfyUI core's own PixArt-Σ, in a real server and in core's own code: Quantized T5 Encode's
CONDITIONING drives core's Load Diffusion Model + KSampler on a tiny PixArt-Σ in the original single-file
format (the converter's output), equals what core's PixArt T5 encoder makes from the same T5 weights, and
the pack's sampler loads the same single file. Needs COMFYUI_PATH; run with ComfyUI's Python."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from comfyui_support import MODEL, running_server
from safetensors.torch import load_file, save_file
from transformers import T5Config, T5EncoderModel

from pixart_lowvram.cli.random_model import build_random_pixart, save_single_file_transformer
from pixart_lowvram.core import text_encoder
from pixart_lowvram.core.conditioning import core_conditioning
from pixart_lowvram.core.models import resolve_model

pytestmark = pytest.mark.comfyui

PROBE = Path(__file__).with_name("core_pixart_probe.py")
CORE_FILE = "tiny-pixart-sigma.safetensors"
SIZE = 512  # tiny-core's native size; core's position embedding needs about 320 px or more
PROMPT = "a photo of a red cat in a garden"
FP32 = {"quantization": "none", "device": "cpu", "precision": torch.float32}


@pytest.fixture(scope="module")
def core_folder(tmp_path_factory) -> Path:
    """The smallest PixArt-Σ core loads (1152-wide blocks, 4096-wide captions), one block."""
    return build_random_pixart(tmp_path_factory.mktemp("model") / "tiny-core", "tiny-core")


@pytest.fixture(scope="module")
def core_file(core_folder, tmp_path_factory) -> Path:
    return save_single_file_transformer(core_folder, tmp_path_factory.mktemp("single") / CORE_FILE)


@pytest.fixture(scope="module")
def core_server(request, tmp_path_factory, core_folder, core_file):
    """A server whose models/diffusers holds tiny-core (as MODEL) and models/diffusion_models its
    transformer as one file."""
    base = tmp_path_factory.mktemp("comfyui")
    (base / "models" / "diffusion_models").mkdir(parents=True)
    (base / "models" / "diffusion_models" / CORE_FILE).write_bytes(core_file.read_bytes())
    with running_server(request, base, core_folder) as started:
        yield started


def probe(tmp_path: Path, job: dict) -> tuple[dict[str, torch.Tensor], dict]:
    """Run core's own PixArt code on ``job`` in ComfyUI's Python."""
    (tmp_path / "job.json").write_text(json.dumps(job))
    out = tmp_path / "core.safetensors"
    subprocess.run(
        [os.environ.get("COMFYUI_PYTHON") or sys.executable, str(PROBE), os.environ["COMFYUI_PATH"],
         str(tmp_path / "job.json"), str(out)],
        check=True, timeout=600, env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )  # fmt: skip
    return load_file(out), json.loads(Path(str(out) + ".json").read_text())


def test_conditioning_equals_cores_pixart_t5(tmp_path):
    """Same T5 weights, ComfyUI's own T5 tokenizer on both sides (the pack falls back to it when the
    model folder has none): core's encoder output equals the pack's CONDITIONING."""
    config = dict(d_model=64, d_kv=32, d_ff=128, num_layers=2, num_heads=2, vocab_size=32128,
                  relative_attention_num_buckets=32, relative_attention_max_distance=128,
                  feed_forward_proj="gated-gelu")  # fmt: skip
    torch.manual_seed(0)
    state = T5EncoderModel(T5Config(is_encoder_decoder=False, use_cache=False, **config)).state_dict()
    del state["encoder.embed_tokens.weight"]  # a t5xxl file holds shared.weight only
    save_file({key: value.contiguous() for key, value in state.items()}, tmp_path / "t5.safetensors")
    core_config = {**config, "dense_act_fn": "gelu_pytorch_tanh", "is_gated_act": True, "model_type": "t5",
                   "layer_norm_epsilon": 1e-6, "eos_token_id": 1, "pad_token_id": 0}  # fmt: skip
    (tmp_path / "t5_config.json").write_text(json.dumps(core_config))
    prompts = [PROMPT, ""]
    core, info = probe(
        tmp_path,
        {
            "t5_file": str(tmp_path / "t5.safetensors"),
            "t5_config": str(tmp_path / "t5_config.json"),
            "prompts": prompts,
        },
    )
    assert info["t5.0"] == ["pooled_output"]
    (tmp_path / "no-tokenizer").mkdir()
    (tmp_path / "no-tokenizer" / "model_index.json").write_text("{}")
    tokenizer = Path(os.environ["COMFYUI_PATH"]) / "comfy" / "text_encoders" / "t5_tokenizer"
    settings = text_encoder.EncoderSettings(
        resolve_model(str(tmp_path / "no-tokenizer")), **FP32,
        t5_file=tmp_path / "t5.safetensors", tokenizer_fallback=tokenizer,
    )  # fmt: skip
    embeds = text_encoder.encode(settings, PROMPT, "")
    positive, negative = core_conditioning(embeds)
    assert core["t5.1"].shape[1] == negative[0][0].shape[1] == 1
    assert core["t5.0"].shape == positive[0][0].shape
    torch.testing.assert_close(positive[0][0], core["t5.0"], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(negative[0][0], core["t5.1"], rtol=1e-4, atol=1e-4)


def test_core_loads_the_converted_file_and_predicts_as_diffusers(tmp_path, core_folder, core_file):
    """Load Diffusion Model's loader on the converter's output: detected as PixArt-Σ with the file's depth,
    SDXL latent format, and its prediction on the unpadded CONDITIONING equals diffusers' on the padded,
    masked embeddings."""
    from diffusers import PixArtTransformer2DModel

    source = resolve_model(str(core_folder))
    embeds = text_encoder.encode(text_encoder.EncoderSettings(source, **FP32), PROMPT, "")
    ((context, _),) = core_conditioning(embeds)[0]
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(1, 4, SIZE // 8, SIZE // 8, generator=generator)
    t = torch.tensor([500.0])
    save_file({"x": x, "t": t, "context": context}, tmp_path / "inputs.safetensors")
    core, info = probe(
        tmp_path, {"transformer_file": str(core_file), "inputs": str(tmp_path / "inputs.safetensors")}
    )
    assert (info["model"], info["depth"], info["scale_factor"]) == ("PixArtSigma", 1, 0.13025)
    model = PixArtTransformer2DModel.from_pretrained(core_folder, subfolder="transformer").eval()
    with torch.inference_mode():
        want = model(
            x, encoder_hidden_states=embeds.prompt_embeds, encoder_attention_mask=embeds.prompt_mask,
            timestep=t, added_cond_kwargs={"resolution": None, "aspect_ratio": None},
        ).sample[:, :4]  # fmt: skip
    torch.testing.assert_close(core["eps"], want, rtol=1e-3, atol=1e-3)


def latent_of(server, prefix: str) -> torch.Tensor:
    (path,) = sorted((server.output / "latents").glob(f"{prefix}_*.latent"))
    return load_file(path)["latent_tensor"]


def core_ksampler_prompt(prompt: str, quantization: str, prefix: str) -> dict:
    return {
        "1": {"class_type": "PixArtQ_T5Encode", "inputs": {
            "model": MODEL, "prompt": prompt, "negative_prompt": "", "quantization": quantization,
            "keep_loaded": False}},
        "2": {"class_type": "UNETLoader", "inputs": {"unet_name": CORE_FILE, "weight_dtype": "default"}},
        "3": {"class_type": "EmptyLatentImage", "inputs": {"width": SIZE, "height": SIZE, "batch_size": 1}},
        "4": {"class_type": "KSampler", "inputs": {
            "model": ["2", 0], "positive": ["1", 1], "negative": ["1", 2], "latent_image": ["3", 0],
            "seed": 7, "steps": 2, "cfg": 4.5, "sampler_name": "euler", "scheduler": "normal", "denoise": 1.0}},
        "5": {"class_type": "SaveLatent", "inputs": {"samples": ["4", 0], "filename_prefix": f"latents/{prefix}"}},
    }  # fmt: skip


def test_our_conditioning_drives_core_unetloader_and_ksampler(core_server):
    for prefix, prompt, quantization in (
        ("cat", PROMPT, "none"),
        ("dog", "a dog", "none"),
        ("nf4", PROMPT, "nf4"),
    ):
        run = core_server.run(core_ksampler_prompt(prompt, quantization, prefix))
        assert run.status == "success", run.error
        assert {"1", "4"} <= set(run.executed)  # Load Diffusion Model runs once (cached after)
    cat, dog, nf4 = (latent_of(core_server, prefix) for prefix in ("cat", "dog", "nf4"))
    assert cat.shape == (1, 4, SIZE // 8, SIZE // 8) and torch.isfinite(cat).all()
    assert not torch.allclose(cat, dog, atol=1e-3)  # the prompt reaches core's model
    cosine = torch.nn.functional.cosine_similarity(cat.flatten(), nf4.flatten(), dim=0)
    assert cosine > 0.99  # 4-bit T5's CONDITIONING steers core's sampler as the full T5's does


def our_sampler_prompt(transformer_file: str, prefix: str) -> dict:
    return {
        "1": {"class_type": "PixArtQ_T5Encode", "inputs": {
            "model": MODEL, "prompt": PROMPT, "negative_prompt": "", "quantization": "none",
            "keep_loaded": False}},
        "2": {"class_type": "PixArtQ_Sampler", "inputs": {
            "model": MODEL, "embeds": ["1", 0], "width": 1024, "height": 1024, "steps": 2, "cfg": 4.5,
            "seed": 7, "batch_size": 1, "quantization": "none", "keep_loaded": False, "resolution": "native",
            "transformer_file": transformer_file}},
        "3": {"class_type": "SaveLatent", "inputs": {"samples": ["2", 0], "filename_prefix": f"latents/{prefix}"}},
    }  # fmt: skip


def test_our_sampler_loads_the_single_file(core_server):
    """The file from models/diffusion_models gives the folder's latents; 'native' is the model's 512 px."""
    info = core_server.get("/object_info/PixArtQ_Sampler")["PixArtQ_Sampler"]["input"]["optional"]
    assert CORE_FILE in info["transformer_file"][0] or CORE_FILE in str(info["transformer_file"])
    for prefix, choice in (("folder", "(from model)"), ("file", CORE_FILE)):
        run = core_server.run(our_sampler_prompt(choice, prefix))
        assert run.status == "success", run.error
    folder, file = latent_of(core_server, "folder"), latent_of(core_server, "file")
    assert folder.shape == (1, 4, SIZE // 8, SIZE // 8)
    assert torch.equal(folder, file)  # exact: the same weights bit for bit, so the same computation


def test_a_pickle_in_diffusion_models_is_not_offered(core_server):
    (core_server.base / "models" / "diffusion_models" / "pixart.pth").write_bytes(b"not read")
    info = core_server.get("/object_info/PixArtQ_Sampler")["PixArtQ_Sampler"]["input"]["optional"]
    assert "pixart.pth" not in str(info["transformer_file"])
