"""PixArt-Σ low VRAM: a ComfyUI node pack (entry point below) over a ComfyUI-free library in ``core``.

ComfyUI imports this folder as a package and calls ``comfy_entrypoint``; importing the package
elsewhere (the command line, the tests) pulls in nothing from ComfyUI.
"""

__version__ = "0.1.0"


async def comfy_entrypoint():
    from .nodes import PixArtLowVRAMExtension

    return PixArtLowVRAMExtension()
