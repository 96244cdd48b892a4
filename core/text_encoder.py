"""Prompt -> T5 embeddings, with T5 loaded quantized and freed afterwards."""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from . import estimates, memory, quant_cache, streaming
from .cache import cache
from .devices import as_device, resolve_dtype
from .models import ModelSource, T5File, check_weights, read_t5_file
from .quant import TEXT_ENCODER_SCHEMES, Quantization

logger = logging.getLogger(__name__)

MAX_TOKENS = 300  # PixArt-Σ's caption length
DROPPED_SHOWN = 80  # characters of the dropped text quoted in the truncation warning


@dataclass(frozen=True)
class PixArtEmbeds:
    """What the encoder hands the sampler: padded embeddings and masks, kept on the CPU."""

    prompt_embeds: torch.Tensor  # [B, 300, C]
    prompt_mask: torch.Tensor  # [B, 300]
    negative_embeds: torch.Tensor
    negative_mask: torch.Tensor
    model: str  # which weights produced them
    quantization: str
    dtype: torch.dtype

    @property
    def width(self) -> int:
        return self.prompt_embeds.shape[-1]

    @property
    def batch(self) -> int:
        return self.prompt_embeds.shape[0]


def t5_class(quant: Quantization) -> type:
    """The T5 encoder class ``quant`` loads: transformers' own, which keeps T5's ``wo`` projections out of
    quantization, or one that quantizes every linear layer (:func:`_t5_quantizing_every_linear`)."""
    from transformers import T5EncoderModel

    return T5EncoderModel if quant.keeps_fp32_modules() else _t5_quantizing_every_linear()


@functools.cache
def _t5_quantizing_every_linear() -> type:
    """T5EncoderModel whose FFN output projections (``wo``, 1.0 B of T5-XXL's 4.8 B parameters) are
    quantized like every other linear layer.

    transformers exempts ``wo`` through ``_keep_in_fp32_modules``, collected from the sub-models in
    ``post_init``; this clears it there, per instance. T5's feed-forward also casts its activations
    to ``wo.weight.dtype`` — uint8 for a packed 4-bit layer, which would wreck them — so the
    feed-forward blocks become a subclass without that cast (the quantized layer casts its input to
    its compute dtype itself).
    """
    from transformers import T5EncoderModel
    from transformers.models.t5.modeling_t5 import T5DenseActDense, T5DenseGatedActDense

    class GatedFeedForward(T5DenseGatedActDense):
        def forward(self, hidden_states):
            hidden_states = self.act(self.wi_0(hidden_states)) * self.wi_1(hidden_states)
            return self.wo(self.dropout(hidden_states))

    class FeedForward(T5DenseActDense):
        def forward(self, hidden_states):
            return self.wo(self.dropout(self.act(self.wi(hidden_states))))

    replacements = {T5DenseGatedActDense: GatedFeedForward, T5DenseActDense: FeedForward}

    class T5EncoderQuantizedWo(T5EncoderModel):
        def post_init(self):
            super().post_init()
            self._keep_in_fp32_modules = set()
            for module in self.modules():
                module.__class__ = replacements.get(type(module), type(module))

    return T5EncoderQuantizedWo


def _load(
    weights: ModelSource | T5File,
    quant: Quantization,
    dtype: torch.dtype,
    device: torch.device,
    cache_dir: Path | None,
    low_vram: bool = False,
):
    """T5 from a model's text_encoder/ folder or from a single file, quantized (through the cache).
    With ``low_vram`` it is loaded (and quantized) into CPU memory and its layers are streamed to
    ``device`` one at a time (:mod:`streaming`); the token embeddings stay on the CPU."""

    model_class = t5_class(quant)
    settings = {"scheme": quant.scheme, "dtype": dtype, "class": model_class.__name__}
    if isinstance(weights, T5File):
        origin = weights.path
        settings["config"] = weights.config  # inferred, so a change in the inference is a new entry

        def pretrained() -> dict:
            return weights.pretrained_kwargs(dtype)
    else:
        origin = check_weights(weights.folder(["text_encoder"]) / "text_encoder", weights.name)

        def pretrained() -> dict:
            return {"pretrained_model_name_or_path": origin}

    load_device = torch.device("cpu") if low_vram else device

    def from_pretrained(pretrained_model_name_or_path, **kwargs):
        model = model_class.from_pretrained(
            pretrained_model_name_or_path,
            dtype=dtype,
            device_map={"": str(load_device)},
            use_safetensors=True,
            **kwargs,
        )
        return model.eval()

    def quantize():
        return quant.after_load(from_pretrained(**pretrained(), **quant.load_kwargs(dtype)))

    if cache_dir is None or not quant.enabled:
        model = quantize()
    else:
        model = quant_cache.load_or_build(
            quant_cache.entry(cache_dir, "text_encoder", origin, settings),
            load=from_pretrained,  # the saved config carries the quantization
            build=quantize,
            save=lambda model, path: model.save_pretrained(path, safe_serialization=True),
        )
    if low_vram:
        encoder = model.encoder
        streaming.stream_blocks(
            model, encoder.block, device, keep_on_cpu=[model.shared, encoder.embed_tokens]
        )
    return model


def _load_tokenizer(source: ModelSource, fallback: Path | None):
    """The model's own tokenizer/, else ``fallback`` (a T5 tokenizer folder, e.g. the one ComfyUI ships)."""
    from transformers import AutoTokenizer

    try:
        folder = source.folder(["tokenizer"])
    except FileNotFoundError as exc:
        if fallback is None or not fallback.is_dir():
            raise FileNotFoundError(
                f"model {source.name!r} has no tokenizer ({exc}) and the fallback T5 tokenizer folder "
                f"{str(fallback) if fallback else '(none given)'} does not exist. Put PixArt-Σ's tokenizer/ "
                f"folder into the model's folder, or pass a folder holding a T5 tokenizer (tokenizer.json or "
                f"spiece.model with tokenizer_config.json)."
            ) from exc
        logger.info("model %r has no tokenizer/; using the T5 tokenizer in %s", source.name, fallback)
        return AutoTokenizer.from_pretrained(fallback)
    return AutoTokenizer.from_pretrained(folder, subfolder="tokenizer")


def encode(
    source: ModelSource,
    prompt: str,
    negative_prompt: str = "",
    quantization: str = "nf4",
    device: torch.device | str | None = None,
    dtype: str | torch.dtype | None = None,
    keep_loaded: bool = False,
    quant_cache_dir: Path | None = None,
    report: memory.MemoryReport | None = None,
    t5_file: str | os.PathLike | None = None,
    tokenizer_fallback: Path | None = None,
    low_vram: bool = False,
    on_warning: Callable[[str], None] | None = None,
    on_progress: Callable[[int, int], None] | None = None,
) -> PixArtEmbeds:
    """Encode ``prompt`` and ``negative_prompt`` to 300-token embeddings; T5 is unloaded afterwards
    unless ``keep_loaded``. An empty prompt is allowed (it encodes as the empty string).

    T5 comes from ``source``'s text_encoder/, or from ``t5_file`` (one safetensors file, e.g. ComfyUI's
    t5xxl_fp16.safetensors); the tokenizer from ``source``'s tokenizer/, else ``tokenizer_fallback``.
    With ``quant_cache_dir`` the quantized T5 is saved there on first use and read back later
    (see :mod:`quant_cache`). ``low_vram`` keeps T5 in CPU memory and streams its layers to the GPU one
    at a time: a few hundred MB of GPU memory instead of the whole quantized model, for some speed.
    A prompt longer than 300 tokens is cut there; the warning is logged and given to ``on_warning``.
    ``on_progress(done, total)`` is called when T5 is ready (loaded or kept) and when the prompts are
    encoded; an exception it raises (a cancel) ends the stage like any other."""
    if not isinstance(low_vram, bool):
        raise TypeError(f"low_vram must be true or false, got {low_vram!r}.")
    for name, text in (("prompt", prompt), ("negative_prompt", negative_prompt)):
        if not isinstance(text, str):
            raise TypeError(f"{name} must be text, got {type(text).__name__}.")
    device = as_device(device)
    quant = Quantization(quantization, device, TEXT_ENCODER_SCHEMES)
    # bf16 has fp32's range, so T5's activations do not overflow as they can in fp16.
    dtype = resolve_dtype(dtype, device, cuda_default=torch.bfloat16, cpu_default=torch.bfloat16)
    weights = read_t5_file(t5_file) if t5_file is not None else source
    tokenizer = _load_tokenizer(source, tokenizer_fallback)
    if isinstance(weights, T5File) and len(tokenizer) > weights.config["vocab_size"]:
        raise ValueError(
            f"t5_file {weights.path.name!r} has {weights.config['vocab_size']} token embeddings but the tokenizer "
            f"({tokenizer.name_or_path}) has {len(tokenizer)} tokens: they do not belong together. Use a "
            f"T5-XXL file (32128 embeddings) with a T5 v1.1 tokenizer."
        )
    for name, text in (("prompt", prompt), ("negative_prompt", negative_prompt)):
        warning = truncation_warning(tokenizer, name, text)
        if warning is not None:
            logger.warning("%s", warning)
            if on_warning is not None:
                on_warning(warning)
    with memory.stage("t5_encode", device, report):
        return _encode(
            source,
            weights,
            tokenizer,
            prompt,
            negative_prompt,
            quant,
            dtype,
            device,
            keep_loaded,
            quant_cache_dir,
            low_vram,
            on_progress or _no_progress,
        )


def _no_progress(_done: int, _total: int) -> None:
    pass


def truncation_warning(tokenizer, name: str, text: str) -> str | None:
    """What is cut from ``text`` (the prompt or the negative prompt) past T5's 300 tokens; None if nothing."""
    ids = tokenizer(text, add_special_tokens=True).input_ids
    if len(ids) <= MAX_TOKENS:
        return None
    dropped = tokenizer.decode(ids[MAX_TOKENS - 1 : -1], skip_special_tokens=True)
    if len(dropped) > DROPPED_SHOWN:
        dropped = dropped[:DROPPED_SHOWN] + "…"
    return (
        f"{name} is {len(ids)} tokens long; T5 reads the first {MAX_TOKENS}, so the end was left out: "
        f"{dropped!r}. Shorten the {name} to keep all of it."
    )


def _encode(
    source,
    weights,
    tokenizer,
    prompt,
    negative_prompt,
    quant,
    dtype,
    device,
    keep_loaded,
    cache_dir,
    low_vram,
    on_progress,
) -> PixArtEmbeds:
    # Its own frame: once it has returned or raised, nothing here keeps T5 alive.
    from diffusers import PixArtSigmaPipeline

    key = ("text_encoder", weights.key, quant.scheme, dtype, str(device), low_vram)
    load = lambda: _load(weights, quant, dtype, device, cache_dir, low_vram)  # noqa: E731
    # (weights, work) bytes, for the host to make room
    room = estimates.text_encoder(quant.scheme, dtype, low_vram)
    with cache.use(key, load, keep_loaded, device, *room) as text_encoder:
        on_progress(1, 2)
        # The pipeline's own encode_prompt keeps tokenization, padding and masks identical to diffusers.
        pipe = PixArtSigmaPipeline(
            tokenizer=tokenizer, text_encoder=text_encoder, vae=None, transformer=None, scheduler=None
        )
        embeds, mask, neg_embeds, neg_mask = pipe.encode_prompt(
            prompt,
            do_classifier_free_guidance=True,
            negative_prompt=negative_prompt,
            device=device,
            clean_caption=False,
            max_sequence_length=MAX_TOKENS,
        )
        on_progress(2, 2)
    return PixArtEmbeds(
        prompt_embeds=embeds.cpu(),
        prompt_mask=mask.cpu(),
        negative_embeds=neg_embeds.cpu(),
        negative_mask=neg_mask.cpu(),
        model=source.key,
        quantization=quant.describe(),
        dtype=embeds.dtype,
    )
