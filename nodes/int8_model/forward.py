"""The pack's MODEL computing its forward with diffusers' PixArt-Σ blocks over ComfyUI's own layers.

ComfyUI's PixArt (``comfy/ldm/pixart``, the same code in v0.3.64, v0.8.0 and v0.33.0) and diffusers'
``PixArtTransformer2DModel`` are one architecture; diffusers' forward, the Quanto PixArt Sampler's, is the
faster of the two (one batch-2 forward at 1024² on an H200: 39.0 against 53.5 ms, in the history of
benchmarks/results/run_costs.json: its attention runs torch's own kernel order and its blocks do fewer
separate elementwise steps). ComfyUI's
PixArt takes no ``transformer_options`` (no attention override, block patch or wrapper reaches its blocks),
so running diffusers' blocks instead changes nothing a ComfyUI patch could have changed.

:class:`PackForward` is the MODEL's object patch of ``diffusion_model.forward_orig`` (ComfyUI's
``add_object_patch``: set while ComfyUI has the MODEL loaded, undone when it unloads it). ``PixArtMS.forward``
calls it as it calls its own ``forward_orig``, and takes its output as its own (the first ``in_channels``
where the model predicts its variance too). It runs diffusers' transformer whose every layer is ComfyUI's
module itself — the pack's int8 layers, with their LoRA patches and expanded weights, and ComfyUI's patch
embedding convolution — found through ComfyUI's own key map (``comfy.utils.pixart_to_diffusers``): q, k and
v (and the cross-attention's k and v) are ComfyUI's fused projections, which diffusers' fused attention
processor takes as they are. Nothing is copied but the blocks' small modulation tables, cast to the run's
dtype. The position embedding is diffusers' with ComfyUI's base size for the image
(``round(mean side / 64) * 64 // patch``) and interpolation: the same sinusoids ComfyUI computes. Its
attention runs on the backend measured fastest for the card (:mod:`~...core.attention`), whatever order
a ComfyUI attention call earlier in the process left torch's backends in; the cross-attention's choice
counts what a new key length costs, since ComfyUI's conditioning is as long as its prompt.

ComfyUI's own ``forward_orig`` still runs where this one would differ: a PixArt-α model with micro
conditions, a mask, or a position-embedding interpolation ComfyUI works out per image (uncompiled there)."""

from __future__ import annotations

import weakref

import comfy.utils
import torch

from ...core import attention, step_graph, transformer_run
from ...core.quant import block as fused_block
from ...core.quant import compute as compute_paths
from ...core.transformer import empty

# diffusers' leaf names of the projections that ComfyUI fuses into one layer, and the fused layer's name in
# diffusers' fused attention.
OBJECT = "diffusion_model.forward_orig"  # the object patch's name (ComfyUI's add_object_patch)
FUSED = {("to_q", "to_k", "to_v"): "to_qkv", ("to_k", "to_v"): "to_kv"}
NO_ADDED_CONDITIONS = {"resolution": None, "aspect_ratio": None}


class PackForward:
    """``diffusion_model.forward_orig`` of a pack MODEL: diffusers' forward over ``pixart``'s layers. ``fused``
    (an 8-bit ``compute``): its blocks quantize each layer's input with the op before it, as the sampler's
    do (:func:`~...core.quant.block.use_fused`); ``compiled``: the blocks run compiled (the sampler's
    :func:`~...core.transformer_run.compile_blocks`, the caption's length dynamic: ComfyUI's conditioning is
    as long as its prompt)."""

    def __init__(
        self,
        pixart: torch.nn.Module,
        config: dict,
        unet_config: dict,
        compute: str = compute_paths.FP16,
        compiled: bool = False,
        fused: bool = False,
    ):
        self.pixart = weakref.ref(pixart)
        self.config, self.unet_config = config, unet_config
        self.compute, self.compiled, self.fused = compute, compiled, fused
        key_map = comfy.utils.pixart_to_diffusers(unet_config)
        skeleton = empty(config)
        joined: dict[str, list[tuple[int, str]]] = {}
        for name, _module in list(skeleton.named_modules()):
            target = key_map.get(f"{name}.weight")
            if target is None:
                continue
            if isinstance(target, str):
                _swap(skeleton, name, pixart.get_submodule(target.removesuffix(".weight")))
            else:
                path, (_dim, offset, _size) = target
                joined.setdefault(path.removesuffix(".weight"), []).append((offset, name))
        for path, parts in joined.items():
            names = [name for _offset, name in sorted(parts)]
            owner = names[0].rpartition(".")[0]
            leaves = tuple(name.rpartition(".")[2] for name in names)
            if leaves not in FUSED or any(name.rpartition(".")[0] != owner for name in names):
                raise ValueError(f"ComfyUI's {path} joins {names}: not projections diffusers fuses")
            module = skeleton.get_submodule(owner)
            for leaf in leaves:
                delattr(module, leaf)
            setattr(module, FUSED[leaves], pixart.get_submodule(path))
        # The modulation tables: ComfyUI's parameters, cast to the run's dtype when it starts (ComfyUI's
        # blocks cast theirs on every call), held as plain attributes of diffusers' modules.
        self.tables = []
        for name, _parameter in list(skeleton.named_parameters()):
            target = key_map.get(name)
            if isinstance(target, str) and name.endswith("scale_shift_table"):
                owner, _, leaf = name.rpartition(".")
                module = skeleton.get_submodule(owner) if owner else skeleton
                delattr(module, leaf)
                self.tables.append((module, leaf, target))
        left = [name for name, tensor in skeleton.named_parameters() if tensor.is_meta]
        if left:
            raise ValueError(
                f"diffusers' PixArt has weights ComfyUI's has no place for: {', '.join(left[:5])}"
            )
        attention.install(skeleton)
        blocks = skeleton.transformer_blocks
        if fused:
            fused_block.use_fused(blocks, compute)
        if compiled:
            transformer_run.compile_blocks(blocks, captions_vary=True)
        # The position embedding is made for each image's size, on its device, once a run (:meth:`place`);
        # the native size's buffer is not kept.
        patches = skeleton.pos_embed
        self.embed_width = patches.pos_embed.shape[-1]
        patches.interpolation_scale = pixart.pe_interpolation
        self.skeleton, self.made_for = skeleton, None
        self.graphs: step_graph.Graphed | None = None
        self.unplace()

    def takes(self, pixart, mask) -> bool:
        """Whether diffusers' forward computes what ComfyUI's would for this call."""
        return (
            mask is None
            and not pixart.micro_conditioning
            and pixart.pe_interpolation is not None
            and pixart.pe_precision is None
        )

    def follow(self, _original, clone) -> None:
        """``ON_CLONE``: a clone holding another model than the one this forward runs (ComfyUI's MultiGPU
        deep clone gives its clone a fresh model, with the original's object patches) gets a forward over
        that model's layers."""
        model = clone.model.diffusion_model
        current = clone.object_patches.get(OBJECT)
        if isinstance(current, PackForward) and current.pixart() is not model:
            clone.object_patches[OBJECT] = PackForward(
                model, self.config, self.unet_config, self.compute, self.compiled, self.fused
            )

    def begin(self, graphed: bool) -> None:
        """A sampling run starts (``ON_PRE_RUN``): with ``graphed``, its calls replay a CUDA graph per call
        signature (:class:`~...core.step_graph.Graphed`: the first call of a signature runs as it is, the
        second is captured), dropped at its end (:meth:`reset`)."""
        self.graphs = step_graph.Graphed(self.skeleton, step_graph.cuda_capture) if graphed else None

    def reset(self) -> None:
        """Drop the run's graphs, the tables cast for it and its position embedding (the run's end)."""
        if self.graphs is not None:
            self.graphs.release()
            self.graphs = None
        for module, leaf, _target in self.tables:
            module.__dict__.pop(leaf, None)
        self.made_for = None
        self.unplace()

    def place(self, height: int, width: int, device: torch.device) -> None:
        """The position embedding for a ``height`` × ``width`` latent on ``device``, made once for as long as
        the size stays: diffusers' ``PatchEmbed`` makes it anew at every call for a size other than the one
        it holds (about 25 small GPU operations each step, at the step's start), and takes the one it holds
        as it is for that size. Made by diffusers' own function, as ``PatchEmbed`` makes it, with ComfyUI's
        base size for the image (``round(mean side / 64) * 64 // patch``, PixArtMS.forward_orig, and
        SMALLEST_MEAN_SIDE's)."""
        patches, patch = self.skeleton.pos_embed, self.skeleton.config.patch_size
        grid = (height // patch, width // patch)
        base_size = (round((height + width) // 2 / 64) * 64) // patch
        key = (grid, base_size, device)
        if self.placed == key:
            return
        from diffusers.models.embeddings import get_2d_sincos_pos_embed

        patches.base_size = base_size
        patches.pos_embed = (
            get_2d_sincos_pos_embed(
                self.embed_width,
                grid,
                base_size=base_size,
                interpolation_scale=patches.interpolation_scale,
                device=device,
                output_type="pt",
            )
            .float()
            .unsqueeze(0)
        )
        patches.height, patches.width = grid
        self.placed = key

    def unplace(self) -> None:
        """No position embedding held (a small placeholder, of no size diffusers would take as its own)."""
        patches = self.skeleton.pos_embed
        patches.pos_embed = torch.zeros(1, 1, self.embed_width)
        patches.height = patches.width = -1
        self.placed = None

    def __call__(self, x, timestep, y, mask=None, c_size=None, c_ar=None, **kwargs):
        pixart = self.pixart()
        if not self.takes(pixart, mask):
            return type(pixart).forward_orig(
                pixart, x, timestep, y, mask=mask, c_size=c_size, c_ar=c_ar, **kwargs
            )
        if self.made_for != (x.device, x.dtype):
            for module, leaf, target in self.tables:
                setattr(module, leaf, pixart.get_parameter(target).detach().to(x.device, x.dtype))
            self.made_for = (x.device, x.dtype)
        self.place(*x.shape[-2:], x.device)
        if self.compiled:  # the attention's choices before the blocks trace (ComfyUI's caption: no mask)
            transformer_run.settle_attention(
                self.skeleton.config,
                x.device,
                x.dtype,
                x.shape[0],
                *x.shape[-2:],
                keys=y.shape[-2],
                masked=False,
            )
        run = self.skeleton if self.graphs is None else self.graphs
        try:
            return run(
                hidden_states=x,
                encoder_hidden_states=y.squeeze(1),
                timestep=timestep,
                added_cond_kwargs=NO_ADDED_CONDITIONS,
                return_dict=False,
            )[0]
        except torch._dynamo.exc.BackendCompilerFailed as exc:
            raise transformer_run.compile_failed(exc) from exc


def _swap(skeleton: torch.nn.Module, name: str, module: torch.nn.Module) -> None:
    owner, _, leaf = name.rpartition(".")
    setattr(skeleton.get_submodule(owner) if owner else skeleton, leaf, module)
