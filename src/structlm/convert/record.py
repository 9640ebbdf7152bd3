"""A converted model's record, saved and restored: ``save_pretrained`` of a converted
model writes the conversion into ``config.json`` (``structlm_conversion``) **and** into
the safetensors metadata of its weight files; ``from_pretrained`` (once structlm is
imported) and :func:`load_converted` convert the loaded model again as recorded.

A folder whose weights carry a record that ``config.json`` lacks (or contradicts) is
**refused**, never loaded as the dense model: the message names
:func:`restore_record`, which copies the record from the weights back into
``config.json``. Folders saved before the weights carried a record load as before.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import struct
import warnings
from pathlib import Path
from typing import Any

from torch import nn

from structlm.atomic import atomic_path, atomic_write_text
from structlm.convert.algebra_config import CONFIG_KEY, AlgebraConfig
from structlm.convert.convert import _apply, _atomic, _plan, conversion_info

__all__ = ["install_from_pretrained_hook", "load_converted", "restore_conversion",
           "restore_record", "saved_record", "write_record_metadata"]

_DEFINING = ("algebra", "schedule", "targets", "custom_algebra", "groups", "modules")
"""The record's keys that decide the loaded function (the rest is a summary)."""


def _weight_files(folder: Path) -> list[Path]:
    """The safetensors weight files ``save_pretrained`` wrote (one, or the shards)."""
    return sorted(p for p in Path(folder).glob("model*.safetensors") if p.is_file())


def _read_header(path: Path) -> dict[str, Any]:
    with open(path, "rb") as fh:
        (n,) = struct.unpack("<Q", fh.read(8))
        return json.loads(fh.read(n))


def write_record_metadata(folder: str | Path, record: dict[str, Any]) -> list[Path]:
    """Add ``record`` (JSON) under ``structlm_conversion`` to the safetensors metadata
    of every weight file in ``folder``: the header is rewritten, the tensor bytes copied
    unchanged (a temporary file, then one rename); returns the files."""
    files = _weight_files(Path(folder))
    value = json.dumps(record, sort_keys=True)
    for path in files:
        with open(path, "rb") as src:
            (n,) = struct.unpack("<Q", src.read(8))
            header = json.loads(src.read(n))
            header["__metadata__"] = {**(header.get("__metadata__") or {}), CONFIG_KEY: value}
            raw = json.dumps(header, separators=(",", ":")).encode()
            raw += b" " * (-len(raw) % 8)  # the spec's padding: the data stays aligned
            with atomic_path(path) as tmp, open(tmp, "wb") as dst:
                dst.write(struct.pack("<Q", len(raw)))
                dst.write(raw)
                shutil.copyfileobj(src, dst, 1 << 24)
    return files


def saved_record(folder: str | Path) -> dict[str, Any] | None:
    """The conversion record stored in the weights' safetensors metadata of ``folder``
    (``None``: none there, e.g. a dense model or a folder of an earlier version)."""
    for path in _weight_files(Path(folder)):
        try:
            meta = _read_header(path).get("__metadata__") or {}
            if CONFIG_KEY in meta:
                return json.loads(meta[CONFIG_KEY])
        except (OSError, ValueError, struct.error):  # unreadable: the loader names it
            continue
    return None


def _describe(record: dict[str, Any]) -> str:
    return (f"{record.get('algebra')} on {len(record.get('modules') or [])} modules, "
            f"targets {record.get('targets')!r}, {record.get('schedule')} types")


def check_folder_record(folder: str | Path, config_record: Any) -> None:
    """Refuse a folder whose weights carry a conversion record that its config lacks or
    contradicts (it would load as another function).

    Raises:
        ValueError: naming the folder, both records and :func:`restore_record`.
    """
    saved = saved_record(folder)
    if saved is None:
        return
    how = (f"restore it with structlm.convert.restore_record({str(folder)!r}) (it copies the "
           "record saved with the weights into config.json)")
    if not isinstance(config_record, dict):
        raise ValueError(f"{folder}: its weights were saved from a model converted by "
                         f"structlm ({_describe(saved)}), but config.json has no "
                         f"{CONFIG_KEY!r} record, so it would load as the DENSE model (a "
                         f"different function); {how}")
    diff = [k for k in _DEFINING if config_record.get(k) != saved.get(k)]
    if diff:
        raise ValueError(f"{folder}: config.json's {CONFIG_KEY!r} record differs from the one "
                         f"saved with the weights in {diff} (config: "
                         f"{_describe(config_record)}; weights: {_describe(saved)}); {how}")


def restore_record(folder: str | Path) -> dict[str, Any]:
    """Write the conversion record saved in ``folder``'s weights back into its
    ``config.json`` (what a folder refused for a lost record needs); returns it.

    Raises:
        ValueError: no ``config.json`` there, or weights without a record.
    """
    folder = Path(folder)
    config = folder / "config.json"
    if not config.is_file():
        raise ValueError(f"{str(folder)!r}: no config.json there (expected a folder written "
                         "by save_pretrained after convert_)")
    saved = saved_record(folder)
    if saved is None:
        raise ValueError(f"{str(folder)!r}: its weight files carry no {CONFIG_KEY!r} record "
                         "(a dense model, or saved before structlm stored it there)")
    data = json.loads(config.read_text())
    data[CONFIG_KEY] = saved
    atomic_write_text(config, json.dumps(data, indent=2, sort_keys=True) + "\n")
    return saved


def restore_conversion(model: nn.Module) -> nn.Module:
    """Convert ``model`` again as its config records (``save_pretrained`` of a converted
    model writes the record into ``config.json``); a model without a record is returned
    as it is. Called on every ``from_pretrained`` once structlm is imported, so a saved
    converted model never silently loads as the dense model it came from. Atomic: the
    recorded modules are checked before the first change.

    A record of a custom :class:`Algebra` cannot be rebuilt from its name: the model is
    returned dense with a :class:`UserWarning` saying how to convert it.

    Raises:
        ValueError: the record names modules the model does not have (nothing changed).
    """
    record = getattr(model.config, CONFIG_KEY, None)
    if not isinstance(record, dict) or getattr(model, "_structlm_conversion", None) is not None:
        return model
    if record.get("custom_algebra"):
        warnings.warn(f"this model was saved after structlm.convert_ with a custom algebra "
                      f"{record['algebra']!r}, which cannot be rebuilt from its name: it "
                      "loaded as the DENSE model (a different function); convert_ it with "
                      "the same Algebra object", UserWarning, stacklevel=3)
        return model
    modules = set(record.get("modules") or [])
    cfg = AlgebraConfig(**{k: record[k] for k in ("algebra", "schedule", "targets", "init",
                                                  "ridge", "permute", "groups")
                           if k in record})
    plan = _plan(model, cfg, filter_fn=lambda _m, name: name in modules)  # the saved weights
    if {p.fqn for p in plan} != modules:
        raise ValueError(f"the recorded converted modules {sorted(modules)} are not what the "
                         f"model offers ({sorted(p.fqn for p in plan)})")
    with _atomic(model) as undo:
        _apply(model, cfg, plan, undo)
        if "calibration" in record:
            model.config.__dict__[CONFIG_KEY]["calibration"] = record["calibration"]
    return model


def _local_folder(path: Any) -> Path | None:
    try:
        return Path(path) if path is not None and Path(path).is_dir() else None
    except TypeError:
        return None


def install_from_pretrained_hook() -> None:
    """Make ``PreTrainedModel.from_pretrained`` (and so ``AutoModelForCausalLM``'s) end
    with :func:`restore_conversion` (after refusing a local folder whose weights carry a
    record its config lacks), and ``save_pretrained`` of a converted model also store its
    record in the weights' safetensors metadata (idempotent; ``import structlm``
    installs both)."""
    from transformers import PreTrainedModel

    current = PreTrainedModel.__dict__["from_pretrained"]
    if not getattr(current.__func__, "_structlm_restores", False):
        original = current.__func__

        @functools.wraps(original)
        def from_pretrained(cls: Any, *args: Any, **kwargs: Any) -> Any:
            out = original(cls, *args, **kwargs)
            model = out[0] if isinstance(out, tuple) else out  # output_loading_info=True
            folder = _local_folder(args[0] if args
                                   else kwargs.get("pretrained_model_name_or_path"))
            if folder is not None:
                check_folder_record(folder, getattr(model.config, CONFIG_KEY, None))
            restore_conversion(model)
            return out

        from_pretrained._structlm_restores = True  # type: ignore[attr-defined]
        PreTrainedModel.from_pretrained = classmethod(from_pretrained)  # type: ignore[assignment]
    save = PreTrainedModel.__dict__["save_pretrained"]
    if not getattr(save, "_structlm_records", False):

        @functools.wraps(save)
        def save_pretrained(self: Any, save_directory: Any, *args: Any, **kwargs: Any) -> Any:
            out = save(self, save_directory, *args, **kwargs)
            main = kwargs.get("is_main_process", args[0] if args else True)
            record = self.config.__dict__.get(CONFIG_KEY)
            if main and conversion_info(self) is not None and isinstance(record, dict) \
                    and os.path.isdir(save_directory):
                write_record_metadata(save_directory, record)
            return out

        save_pretrained._structlm_records = True  # type: ignore[attr-defined]
        PreTrainedModel.save_pretrained = save_pretrained  # type: ignore[method-assign]


def load_converted(path: str | Path, **from_pretrained_kwargs: Any) -> nn.Module:
    """A model saved after :func:`~structlm.convert.convert_` (``save_pretrained``),
    converted again as it was recorded: the same modules, algebra and schedule (the
    weights are the saved ones: conversion keeps parameter names and shapes). Plain
    ``from_pretrained`` does the same once structlm is imported; this one also refuses a
    folder without a record.

    Raises:
        ValueError: no saved model at ``path``; no conversion record, or one of a custom
            algebra; weights whose record ``config.json`` lacks or contradicts.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    import structlm.models  # noqa: F401  (registers model_type "structlm")

    if Path(path).exists() and not Path(path).is_dir():
        raise ValueError(f"load_converted: {str(path)!r} is a file, not a folder written by "
                         "save_pretrained")
    try:
        config = AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise ValueError(f"load_converted: cannot read a saved model at {str(path)!r}: "
                         "expected a folder with the config.json that save_pretrained wrote "
                         f"after convert_ ({type(e).__name__}: {e})") from None
    record = getattr(config, CONFIG_KEY, None)
    if Path(path).is_dir():
        check_folder_record(path, record)
    if not isinstance(record, dict):
        raise ValueError(f"{path}: config.json has no {CONFIG_KEY!r} record: not a model "
                         "saved after structlm.convert_")
    if record.get("custom_algebra"):
        raise ValueError(f"{path}: converted with a custom algebra {record['algebra']!r}, "
                         "which cannot be rebuilt from its name: load the folder as a dense "
                         "model and convert_ it with the same Algebra object")
    install_from_pretrained_hook()
    model = AutoModelForCausalLM.from_pretrained(path, **from_pretrained_kwargs)
    if conversion_info(model) is None:  # pragma: no cover - the hook always restores
        raise ValueError(f"{path}: the conversion was not restored")
    return model
