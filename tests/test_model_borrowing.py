"""Which folder lends a model the tokenizer/, text_encoder/ and vae/ it lacks: only to a folder that lacks
all three (the shape the 512 and 2K models ship in; one that lacks some is damaged and borrows nothing),
and only a complete folder of the same pipeline class beside it (a sibling) that passes its own checks,
never one found deeper down or under another root; the borrowing is said at WARNING level; and
check_complete finds a missing or broken part of the whole model (own or lent) before anything loads."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from pixart_lowvram.core import models
from pixart_lowvram.core.models import (
    COMPONENTS,
    CONFIG_FILES,
    HUB_1024,
    HUB_IDS,
    SHARED_PARTS,
    WEIGHTED,
    ModelSource,
    resolve_model,
)

SIGMA = "PixArtSigmaPipeline"
BORROW_RULE = "borrows them from a complete PixArt-Σ 1024 folder"


def minimal(
    folder: Path,
    components: tuple[str, ...] = COMPONENTS,
    class_name: str | None = SIGMA,
    sample_size: int = 128,
) -> Path:
    """A model folder that is never loaded: model_index.json, and each component with its config file, a
    tokenizer vocabulary and one tiny .safetensors file where the component has weights."""
    folder.mkdir(parents=True)
    index = {"_class_name": class_name} if class_name else {}
    (folder / models.MODEL_INDEX).write_text(json.dumps(index))
    for component in components:
        (folder / component).mkdir()
        config = {"sample_size": sample_size} if component == "transformer" else {}
        (folder / component / CONFIG_FILES[component]).write_text(json.dumps(config))
        if component == "tokenizer":
            (folder / component / "tokenizer.json").write_text("{}")
        if component in WEIGHTED:
            save_file({"weight": torch.zeros(1)}, folder / component / "diffusion_pytorch_model.safetensors")
    return folder


def linked_copy(tiny_folder: Path, folder: Path, without: tuple[str, ...] = ()) -> Path:
    """A copy of the tiny model (its component folders symlinked, not copied: its vae/ is ~320 MB)."""
    folder.mkdir(parents=True)
    shutil.copy(tiny_folder / models.MODEL_INDEX, folder)
    for component in COMPONENTS:
        if component not in without:
            (folder / component).symlink_to(tiny_folder / component, target_is_directory=True)
    return folder


@pytest.fixture
def no_loading(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any model or tokenizer load, or a download, fails the test."""
    import diffusers
    import huggingface_hub
    import transformers

    def refuse(*_args, **_kwargs):
        raise AssertionError("a model was loaded (or downloaded) during the check")

    monkeypatch.setattr(diffusers.ModelMixin, "from_pretrained", classmethod(refuse))
    monkeypatch.setattr(transformers.PreTrainedModel, "from_pretrained", classmethod(refuse))
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", refuse)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", refuse)


# --- an incomplete copy never borrows from an unrelated folder deeper down ----------------------


def test_an_incomplete_copy_does_not_borrow_from_a_folder_deeper_down(tiny_folder, tmp_path, no_loading):
    work = tmp_path / "work"
    model = linked_copy(tiny_folder, work / "tiny-transformer-only", without=SHARED_PARTS)
    leftover = linked_copy(tiny_folder, work / "leftover-test" / "run-3" / "tiny")
    other_root = tmp_path / "diffusers"
    linked_copy(tiny_folder, other_root / "sigma-1024")

    source = resolve_model(str(model), [other_root])
    assert source.base is None
    assert source.shared_parts() == {} and source.shared_parts_note() is None
    with pytest.raises(FileNotFoundError) as error:
        source.check_complete()
    message = str(error.value)
    assert f"folder {model.resolve()} has no tokenizer/, text_encoder/, vae/ subfolders." in message
    assert BORROW_RULE in message and str(work) in message and "no other model folder there" in message
    for unrelated in ("leftover-test", str(leftover), str(other_root)):
        assert unrelated not in message
    # The borrowing rule once, then one pointer: not the general layout paragraph after it.
    assert message.count("borrows") == 1 and models.LAYOUT_HINT not in message
    assert message.endswith(models.LAYOUT_POINTER)
    # Where a stage would look, the error is the same.
    with pytest.raises(FileNotFoundError, match="no vae/ subfolder") as later:
        source.folder(["vae"])
    assert "leftover-test" not in str(later.value)


def test_nothing_below_a_sibling_or_under_another_root_lends(tmp_path):
    root, other_root = tmp_path / "diffusers", tmp_path / "more-diffusers"
    minimal(root / "sigma-2k", ("transformer", "scheduler"), sample_size=256)
    minimal(root / "group" / "sigma-1024")  # below a sibling that is no model
    minimal(other_root / "sigma-1024")  # in another of the model folders
    minimal(tmp_path / "sigma-1024")  # beside the model folders
    source = resolve_model("sigma-2k", [root, other_root])
    assert source.base is None
    with pytest.raises(FileNotFoundError, match=BORROW_RULE) as error:
        source.check_complete()
    assert "group" not in str(error.value) and str(other_root) not in str(error.value)


# --- the rule: a complete sibling of the same family; only what is missing ------------------------------


def test_a_complete_sibling_lends_a_transformer_only_folder_all_three(tmp_path):
    root = tmp_path / "diffusers"
    base = minimal(root / "sigma-1024").resolve()
    part = minimal(root / "sigma-2k", ("transformer", "scheduler"), sample_size=256)
    source = resolve_model("sigma-2k", [root])
    assert source.base is not None and source.base.path == base
    assert source.shared_parts() == dict.fromkeys(SHARED_PARTS, base)
    assert source.folder(["transformer"]) == part.resolve()
    assert source.folder(["text_encoder"]) == source.folder(["tokenizer"]) == source.folder(["vae"]) == base
    source.check_complete()


@pytest.mark.parametrize(
    "has",
    [("tokenizer", "text_encoder"), ("vae",), ("text_encoder",)],
    ids=["no-vae", "no-t5", "no-tokenizer"],
)
def test_a_folder_with_some_of_the_parts_is_damaged_and_borrows_nothing(tmp_path, caplog, has):
    root = tmp_path / "diffusers"
    minimal(root / "sigma-1024")  # a complete sibling that could lend
    folder = minimal(root / "damaged", ("transformer", "scheduler", *has))
    with caplog.at_level(logging.WARNING):
        source = resolve_model("damaged", [root])
    assert source.base is None and source.shared_parts() == {} and source.shared_parts_note() is None
    assert not caplog.records
    lacking = [component for component in SHARED_PARTS if component not in has]
    with pytest.raises(FileNotFoundError) as error:
        source.check_complete()
    message = str(error.value)
    names = ", ".join(f"{component}/" for component in lacking)
    assert f"folder {folder.resolve()} has no {names} subfolder" in message
    assert "a whole model with a part missing" in message and "it borrows nothing" in message
    assert f"Copy {names} again from the model's download" in message
    assert "sigma-1024" not in message and BORROW_RULE not in message
    # The one pointer to the layout, not the general paragraph after the fix.
    assert message.endswith(models.LAYOUT_POINTER) and models.LAYOUT_HINT not in message


def test_a_1024_sibling_comes_first_then_the_name(tmp_path):
    root = tmp_path / "diffusers"
    minimal(root / "a-sigma-512", sample_size=64)
    minimal(root / "b-sigma-1024")
    minimal(root / "c-sigma-1024")
    minimal(root / "sigma-2k", ("transformer", "scheduler"), sample_size=256)
    assert resolve_model("sigma-2k", [root]).base.path == (root / "b-sigma-1024").resolve()


@pytest.mark.parametrize(
    ("borrower", "sibling", "lends"),
    [
        (SIGMA, SIGMA, True),
        (None, SIGMA, True),  # a model_index.json without a class: a PixArt-Σ base
        (SIGMA, "PixArtAlphaPipeline", False),
        (None, "PixArtAlphaPipeline", False),
        (SIGMA, None, False),
        (None, None, False),
        ("PixArtAlphaPipeline", SIGMA, False),
    ],
)
def test_only_a_sibling_of_the_same_family_lends(tmp_path, borrower, sibling, lends):
    root = tmp_path / "diffusers"
    minimal(root / "other", class_name=sibling)
    minimal(root / "sigma-2k", ("transformer", "scheduler"), class_name=borrower)
    source = resolve_model("sigma-2k", [root])
    assert (source.base is not None) == lends
    if lends:
        source.check_complete()
        return
    with pytest.raises(FileNotFoundError, match=BORROW_RULE) as error:
        source.check_complete()
    why = f"a {sibling}, not a" if sibling else "its model_index.json names no"
    assert f"other ({why}" in str(error.value)


def test_an_incomplete_sibling_does_not_lend_and_is_named(tmp_path):
    root = tmp_path / "diffusers"
    minimal(root / "sigma-512", ("tokenizer", "text_encoder", "transformer", "scheduler"), sample_size=64)
    broken = minimal(root / "sigma-1024")
    (broken / "vae" / "config.json").unlink()
    minimal(root / "sigma-2k", ("transformer", "scheduler"), sample_size=256)
    source = resolve_model("sigma-2k", [root])
    assert source.base is None
    with pytest.raises(FileNotFoundError) as error:
        source.check_complete()
    message = str(error.value)
    assert "has no tokenizer/, text_encoder/, vae/ subfolders" in message
    assert f"sigma-1024 (fails its own check: {broken.resolve() / 'vae'} has no config.json" in message
    assert "sigma-512 (no vae/)" in message


def test_a_damaged_copy_of_the_tiny_model_beside_a_broken_one_is_refused_with_the_fix(
    tiny_folder, tmp_path, no_loading
):
    """The case met on a first hour: the demo model copied without vae/, beside a copy whose transformer
    file was truncated. The first is damaged (it has T5 and the tokenizer), so it borrows nothing; the
    second fails its own check, so it lends nothing, not even to a transformer-only folder."""
    work = tmp_path / "work"
    novae = linked_copy(tiny_folder, work / "tiny-novae", without=("vae",))
    corrupt = linked_copy(tiny_folder, work / "tiny-corrupt", without=("transformer",))
    (
        corrupt / "transformer"
    ).mkdir()  # its own folder, with the weights cut short as a failed copy leaves them
    shutil.copy(tiny_folder / "transformer" / "config.json", corrupt / "transformer")
    original = (tiny_folder / "transformer" / "diffusion_pytorch_model.safetensors").read_bytes()
    (corrupt / "transformer" / "diffusion_pytorch_model.safetensors").write_bytes(
        original[: len(original) // 2]
    )
    source = resolve_model(str(novae))
    assert source.base is None and source.shared_parts_note() is None
    with pytest.raises(FileNotFoundError) as error:
        source.check_complete()
    message = str(error.value)
    assert (
        "has no vae/ subfolder" in message and "Copy vae/ again" in message and "tiny-corrupt" not in message
    )

    transformer_only = linked_copy(
        tiny_folder, work / "tiny-2k", without=("tokenizer", "text_encoder", "vae")
    )
    source = resolve_model(str(transformer_only))
    assert source.base is None
    with pytest.raises(FileNotFoundError, match=BORROW_RULE) as error:
        source.check_complete()
    weights = corrupt.resolve() / "transformer" / "diffusion_pytorch_model.safetensors"
    assert f"tiny-corrupt (fails its own check: {weights} is not a readable safetensors file" in str(
        error.value
    )


# --- check_complete: the whole model, before the first stage ----------------------------------------------


@pytest.mark.parametrize("component", ["transformer", "scheduler"])
def test_a_missing_transformer_or_scheduler_is_found_before_anything_loads(tmp_path, no_loading, component):
    root = tmp_path / "diffusers"
    minimal(root / "sigma-1024")  # a base for T5, tokenizer and VAE, which cannot lend the others
    folder = minimal(root / "half", tuple(c for c in ("transformer", "scheduler") if c != component))
    source = resolve_model("half", [root])
    assert set(source.shared_parts()) == set(SHARED_PARTS)
    with pytest.raises(FileNotFoundError) as error:
        source.check_complete()
    message = str(error.value)
    assert f"folder {folder.resolve()} has no {component}/ subfolder." in message
    assert "must be in the model's own folder" in message and "model_index.json" in message
    assert BORROW_RULE not in message


def test_the_tiny_model_without_its_transformer_fails_the_check_not_a_stage(
    tiny_folder, tmp_path, no_loading
):
    folder = linked_copy(tiny_folder, tmp_path / "copy", without=("transformer",))
    with pytest.raises(FileNotFoundError, match="has no transformer/ subfolder"):
        resolve_model(str(folder)).check_complete()
    resolve_model(str(folder)).check_complete(["tokenizer", "text_encoder", "vae", "scheduler"])


def test_a_complete_tiny_model_passes(tiny, no_loading):
    tiny.check_complete()


def broken_config(folder: Path) -> None:
    (folder / "vae" / "config.json").unlink()


def unreadable_config(folder: Path) -> None:
    (folder / "scheduler" / "scheduler_config.json").write_text("{not json")


def pickled_weights(folder: Path) -> None:
    (folder / "text_encoder" / "diffusion_pytorch_model.safetensors").unlink()
    (folder / "text_encoder" / "pytorch_model.bin").write_bytes(b"pickle")


def truncated_weights(folder: Path) -> None:
    (folder / "transformer" / "diffusion_pytorch_model.safetensors").write_bytes(
        b"\x40\x00\x00\x00\x00\x00\x00\x00{"
    )


def no_vocabulary(folder: Path) -> None:
    (folder / "tokenizer" / "tokenizer.json").unlink()


@pytest.mark.parametrize(
    ("damage", "error", "parts"),
    [
        (broken_config, FileNotFoundError, ("vae", "has no config.json", "Copy it again")),
        (unreadable_config, ValueError, ("scheduler_config.json", "download it")),
        (pickled_weights, FileNotFoundError, ("text_encoder", "pytorch_model.bin, a pickle format")),
        (truncated_weights, ValueError, ("transformer", "not a readable safetensors file")),
        (no_vocabulary, FileNotFoundError, ("tokenizer", "neither tokenizer.json nor spiece.model")),
    ],
)
def test_a_damaged_part_is_named(tmp_path, no_loading, damage, error, parts):
    folder = minimal(tmp_path / "model")
    damage(folder)
    with pytest.raises(error) as raised:
        resolve_model(str(folder)).check_complete()
    message = str(raised.value)
    assert "'" + str(folder) + "'" in message  # the model, as the user named it
    assert all(part in message for part in parts), message


@pytest.mark.parametrize("part", ["vae", "transformer"])
def test_a_sibling_that_fails_its_own_check_lends_nothing(tmp_path, no_loading, part):
    """Even a part the borrower does not take (its transformer) makes the sibling no base."""
    root = tmp_path / "diffusers"
    broken = minimal(root / "sigma-1024")
    (broken / part / "diffusion_pytorch_model.safetensors").unlink()
    source = resolve_model(str(minimal(root / "sigma-2k", ("transformer", "scheduler"), sample_size=256)))
    assert source.base is None
    source.check_complete(["transformer", "scheduler"])
    with pytest.raises(FileNotFoundError, match=BORROW_RULE) as error:
        source.check_complete()
    reason = f"sigma-1024 (fails its own check: {broken.resolve() / part} holds no .safetensors weights)"
    assert reason in str(error.value)


def test_a_lent_part_is_checked_where_it_is_used(tmp_path, no_loading):
    """A base damaged after the model was resolved: the check names the lent part and its folder."""
    root = tmp_path / "diffusers"
    base = minimal(root / "sigma-1024")
    source = resolve_model(str(minimal(root / "sigma-2k", ("transformer", "scheduler"), sample_size=256)))
    assert source.base is not None
    (base / "vae" / "diffusion_pytorch_model.safetensors").unlink()
    source.check_complete(["tokenizer", "text_encoder", "transformer", "scheduler"])
    with pytest.raises(FileNotFoundError, match=r"no \.safetensors weights") as error:
        source.check_complete()
    assert str(base.resolve() / "vae") in str(error.value)


def test_a_hub_id_is_not_checked_and_nothing_downloads(no_loading):
    for hub_id in HUB_IDS:
        source = resolve_model(hub_id)
        source.check_complete()
        assert source.shared_parts() == {}
    assert resolve_model(HUB_1024).shared_parts_note() is None
    note = resolve_model(HUB_IDS[2]).shared_parts_note()
    assert note is not None and HUB_1024 in note and all(f"{c}/" in note for c in SHARED_PARTS)


def test_a_source_made_without_resolve_model_still_says_what_is_beside_it(tmp_path):
    folder = minimal(tmp_path / "diffusers" / "sigma-2k", ("transformer", "scheduler"))
    minimal(tmp_path / "diffusers" / "alpha", class_name="PixArtAlphaPipeline")
    with pytest.raises(FileNotFoundError, match=BORROW_RULE) as error:
        ModelSource("sigma-2k", folder).check_complete()
    assert "alpha (a PixArtAlphaPipeline" in str(error.value)


# --- said without -v ---------------------------------------------------------------------------------------


def test_the_borrowing_is_logged_as_a_warning_once(tmp_path, caplog):
    root = tmp_path / "diffusers"
    base = minimal(root / "sigma-1024").resolve()
    minimal(root / "sigma-2k", ("transformer", "scheduler"), sample_size=256)
    with caplog.at_level(logging.WARNING):
        source = resolve_model("sigma-2k", [root])
        resolve_model("sigma-1024", [root])  # complete: nothing to say
    records = [r for r in caplog.records if r.name == models.logger.name]
    assert [(r.levelno, r.getMessage()) for r in records] == [(logging.WARNING, source.shared_parts_note())]
    assert records[0].getMessage() == (
        f"model 'sigma-2k' has no tokenizer/, text_encoder/, vae/: they come from {base}"
    )
