"""The folders and files the bad-input sweep's cases point at, built offline in seconds:
tiny random models (with and without a tokenizer, with NaN weights, a missing tensor, a
config naming another algebra), a partly trained run and damaged copies of it, config
files with one bad value each, and a folder held by another writer."""

from __future__ import annotations

import fcntl
import json
import shutil
import sys
from pathlib import Path
from typing import IO, Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # tiny_models: the tests' random models

TEXTS = {
    "a.txt": "It is a truth universally acknowledged, that a single man in possession of a "
             "good fortune, must be in want of a wife. ",
    "b.txt": "Emma Woodhouse, handsome, clever, and rich, with a comfortable home and happy "
             "disposition, seemed to unite some of the best blessings of existence. ",
    "c.txt": "The family of Dashwood had long been settled in Sussex. Their estate was "
             "large, and their residence was at Norland Park. ",
    "d.txt": "Sir Walter Elliot, of Kellynch Hall, in Somersetshire, was a man who, for his "
             "own amusement, never took up any book but the Baronetage. ",
}


def _texts(folder: Path, repeat: int = 30) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in TEXTS.items():
        (folder / name).write_text(text * repeat)
    return str(folder)


def _models(root: Path, f: dict[str, str]) -> None:
    import torch
    from safetensors.torch import load_file, save_file

    from structlm.data.bpe import train_bpe
    from tiny_models import tiny_gpt2, tiny_llama, tiny_structlm

    tok = train_bpe([t * 5 for t in TEXTS.values()], 300, root / "bpe")
    f["bpe"] = str(root / "bpe")
    ctx = root / "models" / "ctx64"  # a valid model: 64 positions, its own tokenizer
    tiny_llama(vocab_size=300).save_pretrained(ctx)
    tok.save_pretrained(ctx)
    f["ctx64"], f["models"] = str(ctx), str(root / "models")
    tiny_llama().save_pretrained(root / "notok")
    f["notok"] = str(root / "notok")
    tiny_gpt2().save_pretrained(root / "gpt2r")
    f["gpt2r"] = str(root / "gpt2r")
    missing = root / "missing-tensor"
    shutil.copytree(ctx, missing)
    weights = load_file(missing / "model.safetensors")
    del weights[sorted(k for k in weights if "mlp.up_proj" in k)[0]]
    save_file(weights, missing / "model.safetensors", metadata={"format": "pt"})
    f["missing_tensor"] = str(missing)
    nan = tiny_structlm(0, "Q2^2", vocab_size=50257)
    with torch.no_grad():
        nan.transformer.h[0].mlp.gate.weight.view(-1)[5] = float("nan")
    nan.save_pretrained(root / "nan")
    f["nan"] = str(root / "nan")
    tiny_structlm(0, "Q4", vocab_size=50257).save_pretrained(root / "relabelled")
    cfg = json.loads((root / "relabelled" / "config.json").read_text())
    cfg["algebra"] = "Q2^2"  # the same shapes as Q4: loads, computes another function
    (root / "relabelled" / "config.json").write_text(json.dumps(cfg))
    f["relabelled"] = str(root / "relabelled")
    for algebra, key in (("dense", "dense_s"), ("Q2^2", "q22_s")):
        tiny_structlm(1, algebra, vocab_size=50257).save_pretrained(root / key)
        f[key] = str(root / key)
    selfref = root / "selfref"
    selfref.mkdir()
    (selfref / "structlm_compression.json").write_text(json.dumps({"source_model":
                                                                   str(selfref)}))
    f["selfref"] = str(selfref)


def _train_yaml(root: Path, name: str, **fields: Any) -> str:
    import yaml

    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(fields))
    return str(path)


def _runs(root: Path, f: dict[str, str]) -> None:
    """A tiny run stopped at step 3 of 6, and copies damaged in every way a resume meets."""
    from structlm.train import TrainConfig, train

    base = dict(preset="tiny", algebra="Q2^2", model_overrides={"vocab_size": 50257},
                seq_len=16, batch_size=2, max_steps=6, warmup_steps=1, eval_every=3,
                eval_batches=1, save_every=3, threads=1)
    texts = _texts(root / "texts")
    run = root / "runs" / "ok"
    train(TrainConfig(out_dir=str(run), corpus=texts, **base), stop_after=3, progress=False)
    damages = {
        "garbage_marker": lambda c: (c / "COMPLETE").write_text("zz"),
        "empty_marker": lambda c: (c / "COMPLETE").write_text(""),
        "state_missing": lambda c: (c / "state.pt").unlink(),
        "model_truncated": lambda c: (c / "model.safetensors").write_bytes(
            (c / "model.safetensors").read_bytes()[:100]),
        "state_truncated": lambda c: (c / "state.pt").write_bytes(
            (c / "state.pt").read_bytes()[:100]),
    }
    for name, damage in damages.items():
        shutil.copytree(run, root / "runs" / name)
        damage(root / "runs" / name / "checkpoint")
        f[f"run_{name}"] = str(root / "runs" / name)
        f[f"yaml_{name}"] = _train_yaml(root, f"run_{name}", out_dir=f[f"run_{name}"],
                                        corpus=texts, data_dir=str(run / "data"), **base)
    edited = root / "texts-edited"
    shutil.copytree(texts, edited)
    (edited / "b.txt").write_text("An edited document, not the one the run was trained on. "
                                  * 40)
    shutil.copytree(run, root / "runs" / "data_changed")
    f["run_data_changed"] = str(root / "runs" / "data_changed")
    f["yaml_data_changed"] = _train_yaml(root, "data_changed", out_dir=f["run_data_changed"],
                                         corpus=str(edited), **base)
    own = _texts(root / "texts-own")  # a run whose corpus is then edited in place
    train(TrainConfig(out_dir=str(root / "runs" / "edited"), corpus=own, **base), stop_after=3,
          progress=False)
    (Path(own) / "c.txt").write_text("The same file name, other words: edited text. " * 40)
    f["run_edited"] = str(root / "runs" / "edited")
    f["yaml_edited"] = _train_yaml(root, "edited", out_dir=f["run_edited"], corpus=own, **base)
    # config.json deleted, then resumed with another learning rate: the checkpoint's own
    # copy of the config refuses it
    shutil.copytree(run, root / "runs" / "no_config")
    (root / "runs" / "no_config" / "config.json").unlink()
    f["run_no_config"] = str(root / "runs" / "no_config")
    f["yaml_no_config"] = _train_yaml(root, "no_config", out_dir=f["run_no_config"],
                                      corpus=texts, **{**base, "lr": 1e-2})
    f["run_ok"], f["texts"] = str(run), texts
    f["yaml_base"] = _train_yaml(root, "base", out_dir=str(root / "runs" / "fresh"),
                                 corpus=texts, **base)


def _yamls(root: Path, f: dict[str, str]) -> None:
    """Config files with one bad value each (the key names the case)."""
    def w(name: str, text: str) -> None:
        path = root / f"{name}.yaml"
        path.write_text(text)
        f[name] = str(path)

    out = f"out_dir: {root / 'runs' / 'never'}\n"
    for key, value in [
        ("grad_clip", "-1"), ("grad_clip", "1e-12"), ("weight_decay", "-1"),
        ("warmup_steps", "-5"), ("min_lr_ratio", "-1"), ("min_lr_ratio", "5"),
        ("lr", "inf"), ("lr", "nan"), ("lr", "0"), ("beta1", "1"), ("beta2", "-0.1"),
        ("seq_len", "0"), ("batch_size", "-2"), ("grad_accum", "0"), ("eval_every", "0"),
        ("eval_batches", "0"), ("save_every", "0"), ("seed", "-1"), ("threads", "0"),
        ("data_seed", "-3"), ("parallel", "mpi"), ("preset", "huge"), ("algebra", "Q7"),
        ("algebra", "''"), ("type_schedule", "weird"), ("tokenizer", "bpe:0"),
        ("tokenizer", "spm"), ("out_dir", "''"), ("corpus", "''"), ("val_fraction", "1"),
        ("weight_decay", "nan"), ("max_steps", "-1"), ("allow_untrained_types", "maybe"),
    ]:
        w(f"train_{key}_{value.strip(chr(39)) or 'empty'}",
          f"{'' if key == 'out_dir' else out}{key}: {value}\n")
    for key, value in [("num_hidden_layers", "0"), ("num_hidden_layers", "-1"),
                       ("hidden_size", "abc"), ("num_attention_heads", "0"),
                       ("intermediate_size", "0"), ("initializer_range", "nan"),
                       ("tie_word_embeddings", "'no'"), ("algebra", "Q4"),
                       ("type_schedule", "cyclic"), ("n_positions", "-4")]:
        w(f"override_{key}_{value.strip(chr(39))}",
          f"{out}model_overrides:\n  {key}: {value}\n")
    w("train_duplicate_key", f"{out}lr: 0.001\nlr: 0.1\n")
    w("train_out_file", f"out_dir: {f['afile']}\n")
    w("study_no_arms", f"{out}arms: []\n")
    w("study_bad_arm", f"{out}arms:\n  - {{name: a, algebra: Q7}}\n")
    w("study_arm_field", f"{out}arms:\n  - {{name: a, lr: -1}}\n")
    w("study_out_file", f"out_dir: {f['afile']}\narms:\n  - {{name: a}}\n")
    for key, value in [("energy", "0"), ("energy", "1.5"), ("permutations", "0"),
                       ("batch_size", "0"), ("eig_floor", "-1"), ("eval_fraction", "0"),
                       ("seq_len", "1")]:
        w(f"analyze_{key}_{value}", f"{key}: {value}\n")
    w("analyze_duplicate_key", "energy: 0.9\nenergy: 0.5\n")
    w("compress_finetune_list", "finetune: [1, 2]\n")
    w("compress_finetune_bad", "finetune: {steps: -1}\n")
    w("compress_method_bad", "method: bogus\n")
    for name, line in (("numeric", '{"text": 5}'), ("array", "[1, 2]"),
                       ("broken", '{"text": "unclosed'), ("prompt_number",
                                                         '{"prompt": 1, "response": "a"}')):
        path = root / f"jsonl_{name}.jsonl"  # a corpus whose second record is not text
        path.write_text('{"text": "' + TEXTS["a.txt"] * 10 + '"}\n' + line + "\n")
        f[f"jsonl_{name}"] = str(path)


def build(root: Path) -> dict[str, str]:
    """Every fixture under ``root``; returns name → path."""
    f: dict[str, str] = {}
    (root / "afile").write_text("a file, not a folder: an output here must be refused\n")
    f["afile"] = str(root / "afile")
    f["missing"] = str(root / "missing.yaml")
    (root / "locked").mkdir()
    (root / "locked" / "results.json").write_text("{}\n")
    f["locked"] = str(root / "locked")
    _models(root, f)
    _runs(root, f)
    _yamls(root, f)
    return f


def hold_lock(folder: str) -> IO[str]:
    """Hold ``folder/.lock`` as another writer would (released when the handle closes)."""
    fh = open(Path(folder) / ".lock", "w")
    fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return fh
