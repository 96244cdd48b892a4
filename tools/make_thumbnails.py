"""Draw the templates-browser thumbnail of every UI workflow in workflows/: ``<name>.jpg`` beside
``<name>.json``, a picture of the graph: its nodes in execution order with their main settings, linked in the
canvas's colours for the links' types.

ComfyUI lists every ``*.json`` directly in a custom-node pack's ``workflows/`` folder in its
templates browser and asks for the thumbnail at the same path with ``.jpg`` in place of ``.json``. Run this
after changing a workflow's layout: ``python tools/make_thumbnails.py``. Needs Pillow only.

It lives here, not in workflows/: ComfyUI serves that whole folder over HTTP.
"""

from __future__ import annotations

import json
from pathlib import Path

from PIL import Image, ImageDraw, ImageFont

WORKFLOWS = Path(__file__).resolve().parents[1] / "workflows"
SIZE = 512  # px, square: the browser's cards crop to a square
MARGIN = 28
NOTES = ("MarkdownNote", "Note")
BACKGROUND = (32, 32, 32)
NODE = (58, 58, 58)
PACK_NODE = (45, 62, 92)
OUTLINE = (16, 16, 16)
TITLE_BAR = (30, 30, 30)
TEXT = (235, 235, 235)
CAPTION_TEXT = (255, 214, 0)
DETAIL_TEXT = (190, 200, 215)
# The canvas's default link colours.
LINK_COLOURS = {
    "LATENT": (255, 156, 249),
    "IMAGE": (100, 181, 246),
    "VAE": (255, 105, 105),
    "PIXART_EMBEDS": (255, 214, 0),
    "MODEL": (179, 157, 219),
    "CONDITIONING": (255, 169, 49),
}
OTHER_LINK = (160, 160, 160)
CAPTION = {
    "pixart_lowvram_basic": "basic",
    "pixart_lowvram_lora_ksampler": "LoRA + core KSampler",
    "pixart_lowvram_low_vram": "low VRAM",
    "pixart_lowvram_memory_debug": "memory debug",
    "pixart_lowvram_with_core_nodes": "with core nodes",
}
DISPLAY_NAMES = {
    "PixArtQ_T5Encode": "Quantized T5 Encode",
    "PixArtQ_Sampler": "Quanto PixArt Sampler",
    "PixArtQ_VAEDecode": "VAE Decode (PixArt-Σ)",
    "PixArtQ_FreeVRAM": "Free VRAM",
    "PixArtQ_MemorySnapshot": "Memory Snapshot",
    "PixArtQ_ModelLoader": "PixArt-Σ int8 Model Loader",
    "PixArtQ_LoRA": "PixArt-Σ LoRA",
    "SaveImage": "Save Image",
    "PreviewImage": "Preview Image",
    "VAELoader": "Load VAE",
    "VAEDecode": "VAE Decode",
    "LoraLoaderModelOnly": "Load LoRA",
    "EmptyLatentImage": "Empty Latent Image",
    "KSampler": "KSampler",
}


def ui_workflows(folder: Path = WORKFLOWS) -> list[Path]:
    """The UI-format (drag-and-drop) workflows: those with nodes and links."""
    found = []
    for path in sorted(folder.glob("*.json")):
        data = json.loads(path.read_text(encoding="utf-8"))
        if isinstance(data, dict) and "nodes" in data and "links" in data:
            found.append(path)
    return found


def _font(size: int, bold: bool = False) -> ImageFont.ImageFont:
    try:
        return ImageFont.truetype("DejaVuSans-Bold.ttf" if bold else "DejaVuSans.ttf", size)
    except OSError:  # no DejaVu on this machine: Pillow's own font (no Σ in it)
        return ImageFont.load_default(size=size)


def _fit(draw: ImageDraw.ImageDraw, text: str, width: float, font: ImageFont.ImageFont) -> str:
    """``text`` cut with an ellipsis to fit ``width`` pixels."""
    if draw.textlength(text, font=font) <= width:
        return text
    while text and draw.textlength(text + "…", font=font) > width:
        text = text[:-1]
    return text + "…" if text else ""


def settings(node: dict) -> str:
    """The node's settings that tell the workflows apart, in a few words."""
    values = node.get("widgets_values") or []
    kind = node["type"]
    if kind == "PixArtQ_T5Encode" and len(values) >= 4:
        return f"{values[3]}" + (" · low_vram" if len(values) > 6 and values[6] is True else "")
    if kind == "PixArtQ_Sampler" and len(values) >= 9:
        low = " · low_vram" if len(values) > 13 and values[13] is True else ""
        return f"{values[8]}{low} · {values[1]}×{values[2]} · {values[3]} steps"
    if kind == "PixArtQ_VAEDecode" and len(values) >= 3:
        return f"tiling {values[2]}"
    if kind == "VAELoader" and values:
        return str(values[0])
    if kind == "PixArtQ_ModelLoader" and len(values) >= 2:
        return str(values[1])
    if kind in ("LoraLoaderModelOnly", "PixArtQ_LoRA") and len(values) >= 2:
        return f"strength {values[1]} · {values[0]}"
    if kind == "EmptyLatentImage" and len(values) >= 2:
        return f"{values[0]}×{values[1]}"
    if kind == "KSampler" and len(values) >= 6:
        return f"{values[4]} · {values[5]} · {values[2]} steps"
    return ""


def render(workflow: dict, caption: str) -> Image.Image:
    """The workflow's nodes (notes left out) as boxes in execution order, two a row, linked by
    lines in the canvas's colours for their types."""
    nodes = sorted((n for n in workflow["nodes"] if n["type"] not in NOTES), key=lambda n: n["order"])
    columns = 2
    rows = -(-len(nodes) // columns)
    top, gap = 70, 22
    box_w = (SIZE - 2 * MARGIN - (columns - 1) * gap) / columns
    box_h = min(78, (SIZE - top - MARGIN - (rows - 1) * gap) / rows)
    height_used = rows * box_h + (rows - 1) * gap
    y_start = top + (SIZE - top - MARGIN - height_used) / 2

    boxes = {}
    for index, node in enumerate(nodes):
        row, column = divmod(index, columns)
        if row % 2:  # snake: every other row runs right to left, so each link stays short
            column = columns - 1 - column
        x0 = MARGIN + column * (box_w + gap)
        y0 = y_start + row * (box_h + gap)
        boxes[node["id"]] = (x0, y0, x0 + box_w, y0 + box_h)

    image = Image.new("RGB", (SIZE, SIZE), BACKGROUND)
    draw = ImageDraw.Draw(image)
    draw.text((SIZE / 2, 24), "PixArt-Σ low VRAM", fill=TEXT, font=_font(24, bold=True), anchor="mm")
    draw.text((SIZE / 2, 52), caption, fill=CAPTION_TEXT, font=_font(20), anchor="mm")

    def centre(box: tuple[float, float, float, float]) -> tuple[float, float]:
        return (box[0] + box[2]) / 2, (box[1] + box[3]) / 2

    for _link_id, source, _source_slot, target, _target_slot, kind in workflow["links"]:
        if source in boxes and target in boxes:
            colour = LINK_COLOURS.get(kind, OTHER_LINK)
            draw.line([centre(boxes[source]), centre(boxes[target])], fill=colour, width=6)

    title_font, detail_font = _font(16, bold=True), _font(13)
    for node in nodes:
        x0, y0, x1, y1 = boxes[node["id"]]
        body = PACK_NODE if node["type"].startswith("PixArtQ_") else NODE
        draw.rounded_rectangle((x0, y0, x1, y1), radius=8, fill=body, outline=OUTLINE, width=2)
        draw.rounded_rectangle((x0, y0, x1, y0 + 28), radius=8, fill=TITLE_BAR)
        title = node.get("title") or DISPLAY_NAMES.get(node["type"], node["type"])
        draw.text(
            (x0 + 10, y0 + 14),
            _fit(draw, title, x1 - x0 - 20, title_font),
            fill=TEXT,
            font=title_font,
            anchor="lm",
        )
        detail = settings(node)
        if detail:
            text = _fit(draw, detail, x1 - x0 - 20, detail_font)
            draw.text((x0 + 10, (y0 + 28 + y1) / 2), text, fill=DETAIL_TEXT, font=detail_font, anchor="lm")
    return image


def main() -> None:
    for path in ui_workflows():
        workflow = json.loads(path.read_text(encoding="utf-8"))
        image = render(workflow, CAPTION.get(path.stem, path.stem))
        target = path.with_suffix(".jpg")
        image.save(target, "JPEG", quality=88)
        print(target.name)


if __name__ == "__main__":
    main()
