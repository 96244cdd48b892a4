"""Prompt -> T5 embeddings, with T5 loaded quantized and freed afterwards."""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from . import estimates, inputs, measure, quant_cache, streaming
from .contract import PixArtEmbeds, ProgressCallback, WarningCallback, warn
from .devices import as_device, resolve_dtype
from .estimates import Workload
from .models import ModelSource, check_weights
from .pool import cache
from .quant import TEXT_ENCODER_SCHEMES, Scheme, choose
from .single_files import T5File, read_t5_file

logger = logging.getLogger(__name__)

MAX_TOKENS = 300  # PixArt-Σ's caption length
DROPPED_SHOWN = 80  # characters of the dropped text quoted in the truncation warning
# The T5 stage's inputs in its node's order (see inputs.py).
INPUTS = inputs.Inputs(
    inputs.slot("model"),
    inputs.Input(
        "prompt",
        inputs.TEXT,
        "",
        "What the image shows.",
        multiline=True,
        setting=False,  # encode()'s
        unset="a photo of a red cat in a garden",  # the command line's demo prompt
        help="what the image shows",
    ),
    inputs.Input(
        "negative_prompt",
        inputs.TEXT,
        "",
        "What to steer away from (may be empty).",
        multiline=True,
        setting=False,
        flags=("--negative-prompt", "--negative"),
        help="what to steer away from (`--negative` before)",
    ),
    # `--t5-quant` is the command line's name of earlier versions.
    inputs.quantization(TEXT_ENCODER_SCHEMES, "T5's weights.", flags=("--t5-quantization", "--t5-quant")),
    inputs.KEEP_LOADED,
    inputs.slot("t5_file", optional=True),
    # The help of the command line's one --low-vram, which every stage's low_vram follows.
    inputs.low_vram(
        "T5's 24 layers",
        help="stream T5 layers and transformer blocks from CPU memory and decode in tiles (< 1 GB at 1024²)",
    ),
)


@dataclass(frozen=True)
class EncoderSettings:
    """Every choice of the T5 stage, checked when it is made (before anything loads): what a node or the
    command line builds once and hands to :func:`encode`. Derived values (``scheme``, ``dtype``,
    ``weights``) are worked out here and nowhere else.

    T5 comes from ``model``'s text_encoder/, or from ``t5_file`` (one safetensors file, e.g. ComfyUI's
    t5xxl_fp16.safetensors); the tokenizer from ``model``'s tokenizer/, else ``tokenizer_fallback`` (a T5
    tokenizer folder). With ``quant_cache`` (a folder) the quantized T5 is saved there on first use and read
    back later (:mod:`quant_cache`). ``low_vram`` keeps T5 in CPU memory and streams its layers to the GPU one
    at a time: a few hundred MB of GPU memory instead of the whole quantized model, for some speed.
    ``keep_loaded`` keeps T5 for the next prompt instead of unloading it."""

    model: ModelSource
    quantization: str = INPUTS.field_default("quantization")
    device: torch.device | str | None = None
    precision: str | torch.dtype | None = None
    keep_loaded: bool = INPUTS.field_default("keep_loaded")
    low_vram: bool = INPUTS.field_default("low_vram")
    t5_file: str | os.PathLike | None = None
    quant_cache: str | os.PathLike | None = None
    tokenizer_fallback: Path | None = None
    scheme: Scheme = field(init=False)
    dtype: torch.dtype = field(init=False)
    weights: ModelSource | T5File = field(init=False)

    def __post_init__(self) -> None:
        INPUTS.check(self)
        if self.quant_cache is not None:
            object.__setattr__(self, "quant_cache", Path(self.quant_cache))
        device = as_device(self.device)
        # T5's folder there and readable before anything loads (the tokenizer is found, or the fallback
        # named, by encode() before T5 loads).
        if self.t5_file is None:
            self.model.check_complete(["text_encoder"])
        derived = {
            "device": device,
            "scheme": choose(self.quantization, TEXT_ENCODER_SCHEMES, device),
            # bf16 has fp32's range, so T5's activations do not overflow as they can in fp16.
            "dtype": resolve_dtype(
                self.precision, device, cuda_default=torch.bfloat16, cpu_default=torch.bfloat16
            ),
            "weights": read_t5_file(self.t5_file) if self.t5_file is not None else self.model,
        }
        for name, value in derived.items():
            object.__setattr__(self, name, value)

    def cache_key(self, work: Workload) -> tuple:
        """What a kept T5 is found by: the same weights, quantized and placed the same way (for any
        ``work``: 300 tokens whatever the image)."""
        return (
            "text_encoder",
            self.weights.key,
            self.scheme.name,
            self.dtype,
            str(self.device),
            self.low_vram,
        )

    def device_bytes(self, work: Workload) -> tuple[int, int]:
        """(weights, work) bytes the stage holds on its device, for the host to make room (the same for
        any ``work``)."""
        return estimates.text_encoder(self.scheme, self.dtype, self.low_vram)

    def out_of_memory_advice(self) -> str:
        steps = [] if self.low_vram else ["turn on low_vram (T5's layers streamed from CPU memory)"]
        if self.scheme.if_out_of_memory:
            steps.append(self.scheme.if_out_of_memory)
        return ", ".join([*steps, measure.FREE_OTHERS])


def t5_class(scheme: Scheme) -> type:
    """The T5 encoder class ``scheme`` loads: transformers' own, which keeps T5's ``wo`` projections out of
    quantization, or one that quantizes every linear layer (:func:`_t5_quantizing_every_linear`)."""
    from transformers import T5EncoderModel

    return T5EncoderModel if scheme.keeps_fp32_modules() else _t5_quantizing_every_linear()


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


def _origin(settings: EncoderSettings) -> Path:
    """Where T5's weights are: the single file, or the model's text_encoder/ folder (:func:`_load` checks
    its files when it reads them)."""
    if isinstance(settings.weights, T5File):
        return settings.weights.path
    return settings.weights.folder(["text_encoder"]) / "text_encoder"


@contextlib.contextmanager
def quiet_progress_bars() -> Iterator[None]:
    """transformers' progress bars off for the block ("Loading weights" as T5 loads, "Writing model shards"
    as it is saved pre-quantized): in ComfyUI's log they are lines of noise each prompt, on the command line
    they break its one line a step. transformers' own switch, which turns huggingface_hub's bars off and on
    with it; both are as they were afterwards (hub's per-group settings aside, which its switch clears). A
    hub download happens before, with its bars."""
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars
    from transformers.utils import logging as transformers_logging

    shown, hub_shown = transformers_logging.is_progress_bar_enabled(), not are_progress_bars_disabled()
    with warnings.catch_warnings():  # hub's note that HF_HUB_DISABLE_PROGRESS_BARS=0 overrides the switch
        warnings.simplefilter("ignore")
        transformers_logging.disable_progress_bar()
    try:
        yield
    finally:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if shown:
                transformers_logging.enable_progress_bar()
            if hub_shown and are_progress_bars_disabled():
                enable_progress_bars()
            elif not hub_shown and not are_progress_bars_disabled():
                disable_progress_bars()


def _load(settings: EncoderSettings):
    """T5 from a model's text_encoder/ folder or from a single file, quantized (through the cache).
    With ``low_vram`` it is loaded (and quantized) into CPU memory and its layers are streamed to the
    device one at a time (:mod:`streaming`); the token embeddings stay on the CPU."""
    weights, scheme, dtype = settings.weights, settings.scheme, settings.dtype
    model_class = t5_class(scheme)
    recipe = {"scheme": scheme.name, "dtype": dtype, "class": model_class.__name__}
    origin = _origin(settings)
    if isinstance(weights, T5File):
        recipe["config"] = weights.config  # inferred, so a change in the inference is a new entry

        def pretrained() -> dict:
            return weights.pretrained_kwargs(dtype)
    else:
        check_weights(origin, weights.name)

        def pretrained() -> dict:
            return {"pretrained_model_name_or_path": origin}

    load_device = torch.device("cpu") if settings.low_vram else settings.device

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
        return scheme.after_load(from_pretrained(**pretrained(), **scheme.load_kwargs(dtype)))

    with quiet_progress_bars():
        if settings.quant_cache is None or not scheme.quantized:
            model = quantize()
        else:
            model = quant_cache.load_or_build(
                quant_cache.entry(settings.quant_cache, "text_encoder", origin, recipe),
                load=from_pretrained,  # the saved config carries the quantization
                build=quantize,
                save=lambda model, path: model.save_pretrained(path, safe_serialization=True),
            )
    encoder = model.encoder
    if settings.low_vram:
        streaming.stream_blocks(
            model, encoder.block, settings.device, keep_on_cpu=[model.shared, encoder.embed_tokens]
        )
    else:
        # Moved back from host memory for a later run, its layers' copies run under the encode.
        streaming.copy_ahead(model, encoder.block)
    return model


def _tokenizer_folder(source: ModelSource, fallback: Path | None) -> Path:
    """The model's own tokenizer/, else ``fallback`` (a T5 tokenizer folder, e.g. the one ComfyUI ships)."""
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
        return fallback
    return folder / "tokenizer"


def _signature(folder: Path) -> tuple:
    """The files of a tokenizer folder (names, sizes, modification times): a change makes a new key."""
    files = sorted(p for p in folder.iterdir() if p.is_file())
    return tuple((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files)


@functools.lru_cache(maxsize=8)
def _read_tokenizer(folder: Path, signature: tuple):
    """A tokenizer, read once per process for each folder and signature (the encode only reads it)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


def encode(
    settings: EncoderSettings,
    prompt: str,
    negative_prompt: str = "",
    report: measure.MemoryReport | None = None,
    on_warning: WarningCallback | None = None,
    on_progress: ProgressCallback | None = None,
) -> PixArtEmbeds:
    """Encode ``prompt`` and ``negative_prompt`` to 300-token embeddings; T5 is unloaded afterwards
    unless ``settings.keep_loaded``. An empty prompt is allowed (it encodes as the empty string).

    A prompt longer than 300 tokens is cut there; the warning is logged and given to ``on_warning``.
    ``on_progress(done, total, None)`` is called when T5 is ready (loaded or kept) and when the prompts are
    encoded; an exception it raises (a cancel) ends the stage like any other."""
    for name, text in (("prompt", prompt), ("negative_prompt", negative_prompt)):
        if not isinstance(text, str):
            raise TypeError(f"{name} must be text, got {type(text).__name__}.")
    folder = _tokenizer_folder(settings.model, settings.tokenizer_fallback)
    signature = _signature(folder)
    tokenizer = _read_tokenizer(folder, signature)
    tokenizer_key = (str(folder), signature)
    weights = settings.weights
    if isinstance(weights, T5File) and len(tokenizer) > weights.config["vocab_size"]:
        raise ValueError(
            f"t5_file {weights.path.name!r} has {weights.config['vocab_size']} token embeddings but the tokenizer "
            f"({tokenizer.name_or_path}) has {len(tokenizer)} tokens: they do not belong together. Use a "
            f"T5-XXL file (32128 embeddings) with a T5 v1.1 tokenizer."
        )
    for name, text in (("prompt", prompt), ("negative_prompt", negative_prompt)):
        warn(logger, truncation_warning(tokenizer, name, text), on_warning)
    with measure.stage("t5_encode", settings.device, report, settings.out_of_memory_advice()):
        return _encode(
            settings, tokenizer, tokenizer_key, prompt, negative_prompt, on_progress or _no_progress
        )


def _no_progress(_done: int, _total: int, _latents: torch.Tensor | None) -> None:
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
    settings: EncoderSettings,
    tokenizer,
    tokenizer_key: tuple,
    prompt: str,
    negative_prompt: str,
    on_progress: ProgressCallback,
) -> PixArtEmbeds:
    """Each text's embeddings, remembered with the model (:meth:`ModelCache.recall`): T5 loads only for the
    texts it has not encoded yet, and not at all when it has encoded both."""
    device = settings.device
    work = Workload()
    model_key = settings.cache_key(work)
    # The weights' files as they are now: weights changed on disk are not the ones that made the embeddings.
    weights = tuple(quant_cache.files_signature(_origin(settings)))
    keys = {
        text: ("t5_embeddings", model_key, weights, tokenizer_key, text) for text in (prompt, negative_prompt)
    }
    encoded = {text: cache.recall(key) for text, key in keys.items()}
    missing = [text for text, value in encoded.items() if value is None]
    # A kept T5 whose stage now runs without keep_loaded is let go as after any run, even with nothing to do.
    if missing or (model_key in cache and not settings.keep_loaded):
        with cache.use(
            model_key, lambda: _load(settings), settings.keep_loaded, device, *settings.device_bytes(work)
        ) as text_encoder:
            on_progress(1, 2, None)
            for text in missing:
                encoded[text] = cache.remember(
                    keys[text], _encode_text(text_encoder, tokenizer, text, device)
                )
    else:
        logger.info(
            "t5_encode: the prompt's and the negative prompt's embeddings were remembered; T5 not loaded"
        )
        on_progress(1, 2, None)
    on_progress(2, 2, None)
    (embeds, mask), (neg_embeds, neg_mask) = encoded[prompt], encoded[negative_prompt]
    # Copies: the remembered tensors stay as they were made, whatever a later node does with these.
    return PixArtEmbeds(
        prompt_embeds=embeds.clone(),
        prompt_mask=mask.clone(),
        negative_embeds=neg_embeds.clone(),
        negative_mask=neg_mask.clone(),
        model=settings.model.key,
        quantization=settings.scheme.describe(),
        dtype=embeds.dtype,
    )


def _encode_text(
    text_encoder, tokenizer, text: str, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """One text's padded embeddings and mask, on the CPU. The pipeline's own encode_prompt keeps tokenization,
    padding and masks identical to diffusers; it encodes a negative prompt exactly as a prompt (the same
    tokens, mask and call), so a text's embeddings are the same bits in either place."""
    from diffusers import PixArtSigmaPipeline

    pipe = PixArtSigmaPipeline(
        tokenizer=tokenizer, text_encoder=text_encoder, vae=None, transformer=None, scheduler=None
    )
    with _without_diffusers_truncation_warning():
        embeds, mask, _, _ = pipe.encode_prompt(
            text,
            do_classifier_free_guidance=False,
            device=device,
            clean_caption=False,
            max_sequence_length=MAX_TOKENS,
        )
    return embeds.cpu(), mask.cpu()


# diffusers' encode_prompt logs the whole cut text of a long prompt (kilobytes); :func:`truncation_warning`
# has already said what was cut, shortened.
_PIPELINE_LOGGER = "diffusers.pipelines.pixart_alpha.pipeline_pixart_sigma"
_TRUNCATED = "The following part of your input was truncated"


def _not_truncation(record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith(_TRUNCATED)


@contextlib.contextmanager
def _without_diffusers_truncation_warning() -> Iterator[None]:
    pipeline_logger = logging.getLogger(_PIPELINE_LOGGER)
    pipeline_logger.addFilter(_not_truncation)
    try:
        yield
    finally:
        pipeline_logger.removeFilter(_not_truncation)
