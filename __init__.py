"""PixArt-Σ low VRAM: a ComfyUI node pack (entry point below) over a ComfyUI-free library in ``core``.

ComfyUI imports this folder as a package and calls ``comfy_entrypoint``; importing the package
elsewhere (the command line, the tests) pulls in nothing from ComfyUI.
"""

import logging
import re
import sys

__version__ = "0.1.0"

# The oldest ComfyUI the pack runs on (tested on 0.3.64, 0.8.0 and 0.33.0; pyproject's requires-comfyui).
MIN_COMFYUI = (0, 3, 64)
_logger = logging.getLogger(__name__)


def unsupported_comfyui(version: str | None) -> str | None:
    """One line saying why this ComfyUI is too old for the pack and how to update it; None when it is
    recent enough (or its version cannot be read: an unreleased checkout is taken to be recent)."""
    numbers = re.match(r"(\d+)\.(\d+)\.(\d+)", version or "")
    if numbers is None or tuple(map(int, numbers.groups())) >= MIN_COMFYUI:
        return None
    needed = ".".join(map(str, MIN_COMFYUI))
    return (
        f"PixArt-Σ low VRAM needs ComfyUI {needed} or newer and found ComfyUI {version}: its nodes are not "
        f"loaded. Update ComfyUI (`git pull` in its folder, or Update ComfyUI in ComfyUI-Manager) and restart."
    )


def _running_comfyui() -> str | None:
    # ComfyUI's server has imported its version module by the time custom nodes load; nothing is imported
    # here, so the command line and the tests are unaffected.
    return getattr(sys.modules.get("comfyui_version"), "__version__", None)


# A ComfyUI too old to call comfy_entrypoint (before its V3 node API) would skip the pack in silence.
if (_too_old := unsupported_comfyui(_running_comfyui())) is not None:
    _logger.error("%s", _too_old)


async def comfy_entrypoint():
    from comfy_api.latest import ComfyExtension

    from .core.quant.bitsandbytes import quiet_optional_kernel_notice

    if unsupported_comfyui(_running_comfyui()) is not None:

        class NoNodes(ComfyExtension):  # the line above was logged when ComfyUI imported the pack
            async def get_node_list(self) -> list:
                return []

        return NoNodes()
    quiet_optional_kernel_notice()  # before any node imports bitsandbytes (on_load comes later, or never)
    from .nodes import PixArtLowVRAMExtension

    return PixArtLowVRAMExtension()
