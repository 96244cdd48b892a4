"""Which folder lends a model the tokenizer/, text_encoder/ and vae/ it lacks: only a complete folder of
the same pipeline class beside it (a sibling), never one found deeper down or under another root; the
borrowing is said at WARNING level; and check_complete finds a missing or broken part of the whole model
(own or lent) before anything loads."""

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
    BORROWED,
    COMPONENTS,
    CONFIG_FILES,
    HUB_1024,
    HUB_IDS,
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


# --- the issue: an incomplete copy borrowed from an unrelated folder deeper down ----------------------


def test_an_incomplete_copy_does_not_borrow_from_a_folder_deeper_down(tiny_folder, tmp_path, no_loading):
    work = tmp_path / "work"
    model = linked_copy(tiny_folder, work / "tiny-without-vae", without=("vae",))
    leftover = linked_copy(tiny_folder, work / "leftover-test" / "run-3" / "tiny")
    other_root = tmp_path / "diffusers"
    linked_copy(tiny_folder, other_root / "sigma-1024")

    source = resolve_model(str(model), [other_root])
    assert source.lender is None
    assert source.borrowed() == {} and source.borrowing_note() is None
    with pytest.raises(FileNotFoundError) as error:
        source.check_complete()
    message = str(error.value)
    assert f"folder {model.resolve()} has no vae/ subfolder." in message
    assert BORROW_RULE in message and str(work) in message and "no other model folder there" in message
    for unrelated in ("leftover-test", str(leftover), str(other_root)):
        assert unrelated not in message
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
    assert source.lender is None
    with pytest.raises(FileNotFoundError, match=BORROW_RULE) as error:
        source.check_complete()
    assert "group" not in str(error.value) and str(other_root) not in str(error.value)


# --- the rule: a complete sibling of the same family; only what is missing ------------------------------


def test_a_complete_sibling_lends_exactly_what_is_missing(tmp_path):
    root = tmp_path / "diffusers"
    lender = minimal(root / "sigma-1024").resolve()
    part = minimal(root / "part", ("transformer", "scheduler", "vae"), sample_size=256)
    source = resolve_model("part", [root])
    assert source.lender is not None and source.lender.path == lender
    assert source.borrowed() == {"tokenizer": lender, "text_encoder": lender}
    assert (
        source.borrowing_note() == f"model 'part' has no tokenizer/, text_encoder/: they come from {lender}"
    )
    assert source.folder(["vae"]) == part.resolve()  # its own vae/ is kept
    assert source.folder(["text_encoder"]) == source.folder(["tokenizer"]) == lender
    source.check_complete()

    only_vae = resolve_model(
        str(minimal(root / "no-vae", ("tokenizer", "text_encoder", "transformer", "scheduler")))
    )
    assert only_vae.borrowed() == {"vae": lender}
    assert only_vae.borrowing_note() == f"model {str(root / 'no-vae')!r} has no vae/: it comes from {lender}"


def test_a_1024_sibling_comes_first_then_the_name(tmp_path):
    root = tmp_path / "diffusers"
    minimal(root / "a-sigma-512", sample_size=64)
    minimal(root / "b-sigma-1024")
    minimal(root / "c-sigma-1024")
    minimal(root / "sigma-2k", ("transformer", "scheduler"), sample_size=256)
    assert resolve_model("sigma-2k", [root]).lender.path == (root / "b-sigma-1024").resolve()


@pytest.mark.parametrize(
    ("borrower", "sibling", "lends"),
    [
        (SIGMA, SIGMA, True),
        (None, SIGMA, True),  # a model_index.json without a class: a PixArt-Σ lender
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
    assert (source.lender is not None) == lends
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
    assert source.lender is None
    with pytest.raises(FileNotFoundError) as error:
        source.check_complete()
    message = str(error.value)
    assert "has no tokenizer/, text_encoder/, vae/ subfolders" in message
    assert "sigma-1024 (no vae/config.json)" in message and "sigma-512 (no vae/)" in message


# --- check_complete: the whole model, before the first stage ----------------------------------------------


@pytest.mark.parametrize("component", ["transformer", "scheduler"])
def test_a_missing_transformer_or_scheduler_is_found_before_anything_loads(tmp_path, no_loading, component):
    root = tmp_path / "diffusers"
    minimal(root / "sigma-1024")  # a lender for vae/, which cannot lend the transformer or scheduler
    folder = minimal(root / "half", tuple(c for c in COMPONENTS if c not in (component, "vae")))
    source = resolve_model("half", [root])
    assert set(source.borrowed()) == {"vae"}
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


def test_a_lent_part_is_checked_too(tmp_path, no_loading):
    root = tmp_path / "diffusers"
    lender = minimal(root / "sigma-1024")
    (lender / "vae" / "diffusion_pytorch_model.safetensors").unlink()
    source = resolve_model(str(minimal(root / "sigma-2k", ("transformer", "scheduler"), sample_size=256)))
    assert source.lender is not None
    source.check_complete(["tokenizer", "text_encoder", "transformer", "scheduler"])
    with pytest.raises(FileNotFoundError, match=r"no \.safetensors weights") as error:
        source.check_complete()
    assert str(lender.resolve() / "vae") in str(error.value)


def test_a_hub_id_is_not_checked_and_nothing_downloads(no_loading):
    for hub_id in HUB_IDS:
        source = resolve_model(hub_id)
        source.check_complete()
        assert source.borrowed() == {}
    assert resolve_model(HUB_1024).borrowing_note() is None
    note = resolve_model(HUB_IDS[2]).borrowing_note()
    assert note is not None and HUB_1024 in note and all(f"{c}/" in note for c in BORROWED)


def test_a_source_made_without_resolve_model_still_says_what_is_beside_it(tmp_path):
    folder = minimal(tmp_path / "diffusers" / "sigma-2k", ("transformer", "scheduler"))
    minimal(tmp_path / "diffusers" / "alpha", class_name="PixArtAlphaPipeline")
    with pytest.raises(FileNotFoundError, match=BORROW_RULE) as error:
        ModelSource("sigma-2k", folder).check_complete()
    assert "alpha (a PixArtAlphaPipeline" in str(error.value)


# --- said without -v ---------------------------------------------------------------------------------------


def test_the_borrowing_is_logged_as_a_warning_once(tmp_path, caplog):
    root = tmp_path / "diffusers"
    lender = minimal(root / "sigma-1024").resolve()
    minimal(root / "sigma-2k", ("transformer", "scheduler"), sample_size=256)
    with caplog.at_level(logging.WARNING):
        source = resolve_model("sigma-2k", [root])
        resolve_model("sigma-1024", [root])  # complete: nothing to say
    records = [r for r in caplog.records if r.name == models.logger.name]
    assert [(r.levelno, r.getMessage()) for r in records] == [(logging.WARNING, source.borrowing_note())]
    assert records[0].getMessage() == (
        f"model 'sigma-2k' has no tokenizer/, text_encoder/, vae/: they come from {lender}"
    )
