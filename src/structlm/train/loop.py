"""``structlm train CONFIG.yaml``: one training loop, resumable, with CSV metrics.

AdamW (decay on matrices and embeddings only), linear warm-up then cosine to
``min_lr_ratio`` of the peak, gradient accumulation, clipping, evaluation loss every
``eval_every`` steps (accumulated in float64), atomic checkpoints (model in
safetensors; optimiser, scheduler, data-sampler and RNG state beside it) and exact
resumption: a killed run restarted with the same config continues the same loss curve.
A non-finite loss stops the run with an error. Under ``torchrun`` it trains with DDP or
FSDP2 (``parallel``; see :mod:`structlm.train.distributed`).
"""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import torch
from tqdm import tqdm

from structlm.atomic import atomic_write_json, atomic_write_text
from structlm.config import ConfigError, NonEmpty, OneOf, Range, RunError, validated
from structlm.data.bpe import parse_tokenizer_spec
from structlm.hf.finetune import GRAD_CLIP_RANGE
from structlm.models.presets import PRESETS
from structlm.nn.schedules import auto_schedule, check_type_coverage, get_schedule, type_counts
from structlm.settings import local_rank
from structlm.train import distributed as D
from structlm.train.checkpoint import (
    discard_run,
    recover_checkpoint,
    run_folder_lock,
)
from structlm.train.training_state import (
    checkpoint_config,
    corrupt_message,
    save_training_state,
)

if TYPE_CHECKING:
    from collections.abc import Iterable

    from structlm.data.tokens import TokenDataset
    from structlm.models import StructLMForCausalLM

__all__ = ["TrainConfig", "build_model", "build_optimizer", "clip_gradients", "load_config",
           "train"]


_POS = Range(ge=1)


@dataclass
@validated
class TrainConfig:
    """A training run (every field can be set in the YAML file)."""

    out_dir: Annotated[str, NonEmpty()] = "runs/cpu-small"
    """Where metrics, checkpoints and the plot go (a folder; an existing file is refused)."""
    preset: Annotated[str, OneOf(*PRESETS)] = "cpu-small"
    """Model preset (``paper-110m``, ``cpu-small``, ``tiny``)."""
    algebra: Annotated[str, NonEmpty()] = "dense"
    """FFN algebra: ``dense`` or a catalogue name (``Q2^2``, ``Q4``, ...)."""
    type_schedule: Annotated[str, NonEmpty()] = "auto"
    """Position types: ``auto`` (the paper's block rule scaled to ``seq_len``: blocks of
    ``seq_len / (2q)``), ``block`` (the paper's 192-blocks), ``block:<n>``, ``cyclic``,
    ``table:...``, ``cross-layer:<any of these>`` (type shifted by the layer index). A
    schedule that leaves a type without a position in a training window is refused
    unless ``allow_untrained_types``."""
    allow_untrained_types: bool = False
    """Train even if some types never occur in a window (their blocks stay untrained)."""
    model_overrides: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Config fields to change on top of the preset (e.g. ``n_positions``); each is checked
    against its type and range (``StructLMConfig``), and the fields this config sets itself
    (``algebra``, ``type_schedule``) are refused here."""
    corpus: Annotated[str, NonEmpty()] = "shakespeare"
    """Corpus spec (see ``structlm.data.corpora.load_corpus``)."""
    tokenizer: Annotated[str, NonEmpty()] = "gpt2"
    """``gpt2`` (50,257 tokens) or ``bpe:<vocab>``: a byte-level BPE trained on the
    training documents; the model's vocabulary and BOS/EOS ids then follow it."""
    data_dir: str = ""
    """Token cache folder (default: ``<out_dir>/data``)."""
    heldout: str = ""
    """Corpus spec of held-out/benchmark texts to decontaminate the training data against."""
    val_fraction: Annotated[float, Range(gt=0, lt=1)] = 0.1
    """Fraction of the corpus's documents held out for validation (training evaluates on
    held-out documents)."""
    test_split: bool = False
    """Hold out test documents too: ``val_fraction`` of each corpus part's documents (at
    least 2) are held out and dealt to validation and test, balanced by length
    (:func:`~structlm.data.tokens.split_documents_three_way`). Training evaluates on
    validation only; the test documents are for the verdicts of whoever scores the
    finished model (``structlm experiment study``)."""
    data_seed: Annotated[int | None, Range(ge=0)] = None
    """Seed of the train/validation document split (``None``: ``seed``); runs that are
    compared across seeds keep one split."""
    seq_len: Annotated[int, _POS] = 256
    """Tokens per training window (at most the model's ``n_positions``)."""
    batch_size: Annotated[int, _POS] = 8
    """Windows per micro-batch (per process)."""
    grad_accum: Annotated[int, _POS] = 1
    """Micro-batches per optimiser step."""
    max_steps: Annotated[int, _POS] = 200
    """Optimiser steps (a larger value extends a finished run on resume)."""
    lr: Annotated[float, Range(gt=0)] = 3e-4
    """Peak learning rate (AdamW)."""
    warmup_steps: Annotated[int, Range(ge=0, note="0: no warm-up")] = 500
    """Linear warm-up steps, then cosine decay to min_lr_ratio x lr."""
    min_lr_ratio: Annotated[float, Range(ge=0, le=1)] = 0.1
    """Final rate as a fraction of the peak."""
    weight_decay: Annotated[float, Range(ge=0)] = 0.1
    """AdamW weight decay (matrices only)."""
    beta1: Annotated[float, Range(ge=0, lt=1)] = 0.9
    """AdamW beta1."""
    beta2: Annotated[float, Range(ge=0, lt=1)] = 0.95
    """AdamW beta2."""
    grad_clip: Annotated[float, GRAD_CLIP_RANGE] = 1.0
    """Largest global L2 norm of the gradients per optimiser step; ``0`` = no clipping."""
    eval_every: Annotated[int, _POS] = 50
    """Steps between validation evaluations."""
    eval_batches: Annotated[int, _POS] = 8
    """Validation batches per evaluation during training."""
    save_every: Annotated[int, _POS] = 100
    """Steps between checkpoints."""
    seed: Annotated[int, Range(ge=0)] = 0
    """Seed of initialisation and data order."""
    threads: Annotated[int, _POS] = 2
    """Torch threads per process."""
    parallel: Annotated[str, OneOf(*D.PARALLEL_MODES)] = "auto"
    """Engine under ``torchrun``: ``ddp``, ``fsdp`` (FSDP2, sharded) or ``auto`` (= DDP);
    one process runs plainly whatever the value."""

    def __post_init__(self) -> None:
        """Cross-field checks (each field's own range is checked by ``@validated``)."""
        if os.path.exists(self.out_dir) and not os.path.isdir(self.out_dir):
            raise ConfigError(f"out_dir: {self.out_dir!r} is an existing file, not a folder")
        self.model_overrides = _check_model_overrides(self.model_overrides)
        if self.trained_tokenizer:
            clash = sorted({"vocab_size", "bos_token_id", "eos_token_id"}
                           & set(self.model_overrides))
            if clash:
                raise ConfigError(f"model_overrides: {clash} conflict with tokenizer "
                                  f"{self.tokenizer!r}: the vocabulary and its BOS/EOS ids "
                                  "follow the trained tokenizer")
        q = self.q  # refuses an unknown algebra
        try:
            get_schedule(self.model_schedule(), q)
        except ValueError as e:
            raise ConfigError(f"type_schedule: {e}") from None
        context = self.model_config().n_positions  # checks the model's fields together
        if self.seq_len > context:
            raise ConfigError(f"seq_len: {self.seq_len} is beyond the model's context of "
                              f"{context} positions (n_positions of preset {self.preset!r} "
                              "or model_overrides)")
        self.type_counts()  # refuses a schedule that leaves a type untrained

    @property
    def trained_tokenizer(self) -> bool:
        """Whether the run trains its own BPE (``bpe:<vocab>``) instead of using GPT-2's
        (parsing the spec refuses an unknown one)."""
        return parse_tokenizer_spec(self.tokenizer) is not None

    @property
    def q(self) -> int:
        """Number of position types of the FFN algebra (1 for dense)."""
        from structlm.algebra import num_types

        return num_types(self.algebra)

    def model_config(self, data: Any = None) -> Any:
        """The run's ``StructLMConfig``: the preset, the algebra, the resolved schedule and
        ``model_overrides``; with a trained tokenizer and its token ``data``, the vocabulary
        and BOS/EOS ids follow the tokenizer (without ``data``: the preset's, for
        accounting)."""
        from structlm.models import config_from_preset

        vocab: dict[str, int] = {}
        if self.trained_tokenizer and data is not None:
            vocab = dict(vocab_size=data.vocab_size, bos_token_id=data.eot_token,
                         eos_token_id=data.eot_token)
        return config_from_preset(self.preset, self.algebra,
                                  type_schedule=self.model_schedule(),
                                  **{**self.model_overrides, **vocab})

    def model_schedule(self) -> str:
        """The model config's ``type_schedule``: ``auto`` resolved for ``seq_len``."""
        spec = self.type_schedule.strip().lower()
        prefix = ""
        if spec.startswith("cross-layer:"):
            prefix, spec = "cross-layer:", spec.split(":", 1)[1]
        if spec == "auto":
            return prefix + (auto_schedule(self.q, self.seq_len) if self.q > 1 else "block")
        return self.type_schedule

    def type_counts(self) -> list[int]:
        """Positions of each type in one training window (``[seq_len]`` for dense);
        raises when a type has none, unless ``allow_untrained_types``."""
        q, spec = self.q, self.model_schedule()
        if q == 1:
            return [self.seq_len]
        schedule = get_schedule(spec, q)
        if self.allow_untrained_types:
            return type_counts(schedule, self.seq_len)
        return check_type_coverage(schedule, self.seq_len, spec)


def _check_model_overrides(overrides: dict[str, Any]) -> dict[str, Any]:
    """``model_overrides`` coerced and checked: only fields of ``StructLMConfig``, each of
    its type and in its range, and none this config sets itself."""
    from structlm.models.configuration_structlm import check_config_values

    own = sorted(_OWN_MODEL_FIELDS & set(overrides))
    if own:
        raise ConfigError(f"model_overrides: {own} are TrainConfig fields: set them at the top "
                          "level of the config, not in model_overrides")
    return check_config_values(overrides, where="model_overrides.")


_OWN_MODEL_FIELDS = frozenset({"algebra", "type_schedule"})
"""Model config fields that ``TrainConfig`` sets from its own fields."""


_RUNTIME_FIELDS = frozenset({"parallel", "threads", "save_every", "eval_every", "max_steps",
                             "out_dir"})
"""Fields a run may resume with other values: how it executes (engine, threads), when it
saves or evaluates, where the run folder is now (a moved folder resumes; its token data is
checked by content), and ``max_steps`` (a longer run continues from its checkpoint with the
learning-rate schedule of the new length; a value below the checkpoint's step is
refused). Checkpoints are the same for every engine."""


def _run_differences(saved: str, cfg: TrainConfig) -> list[str]:
    """Fields in which a saved ``config.json`` and ``cfg`` differ, as ``key: old -> new``,
    ignoring ``_RUNTIME_FIELDS`` (fields added since the file was written take their
    defaults)."""
    new = json.loads(json.dumps(dataclasses.asdict(cfg)))
    defaults = json.loads(json.dumps(dataclasses.asdict(TrainConfig())))
    old = {**defaults, **json.loads(saved)}
    return [f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in sorted(set(old) | set(new))
            if k not in _RUNTIME_FIELDS and old.get(k) != new.get(k)]


def load_config(path: str, **overrides: Any) -> TrainConfig:
    """A :class:`TrainConfig` from YAML: unknown keys and values of the wrong type are
    errors naming them (``lr: 3e-4``, a string to PyYAML, is read as a float)."""
    from structlm.config import dataclass_from_dict, read_yaml

    raw = read_yaml(path)
    raw.update({k: v for k, v in overrides.items() if v is not None})
    return dataclass_from_dict(TrainConfig, raw, where=path)


def _lr_factor(step: int, cfg: TrainConfig) -> float:
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    span = max(1, cfg.max_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def build_model(cfg: TrainConfig, data: TokenDataset | None = None) -> StructLMForCausalLM:
    """The freshly initialised model of ``cfg`` (seeded with ``cfg.seed``), as
    :func:`train` builds it: the preset, the algebra, the resolved type schedule and
    ``model_overrides``. With a BPE tokenizer (``bpe:<vocab>``) the vocabulary and
    BOS/EOS ids come from the run's token ``data``, which is then required."""
    from structlm.models import StructLMForCausalLM

    if cfg.trained_tokenizer and data is None:
        raise ValueError("a BPE-tokenised run needs its token data to size the vocabulary")
    torch.manual_seed(cfg.seed)
    return StructLMForCausalLM(cfg.model_config(data))


def build_optimizer(model: torch.nn.Module, cfg: TrainConfig
                    ) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW over ``model``'s parameters (build it after any FSDP sharding) and its
    learning-rate schedule (linear warm-up, then cosine to ``min_lr_ratio``; one
    ``step()`` per optimiser step). Weight decay applies to matrices and embeddings
    (parameters of two or more dimensions) only."""
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=cfg.lr, betas=(cfg.beta1, cfg.beta2))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: _lr_factor(s, cfg))
    return opt, sched


def clip_gradients(parameters: Iterable[torch.Tensor], grad_clip: float) -> None:
    """Scale the gradients of ``parameters`` so that their global L2 norm is at most
    ``grad_clip`` (DTensors too); ``0`` leaves them as they are (no clipping)."""
    if not grad_clip >= 0:  # NaN too
        raise ValueError(f"grad_clip must be >= 0 (0: no clipping), got {grad_clip!r}")
    if grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(parameters, grad_clip)


@torch.no_grad()
def _evaluate(model: Any, data: Any, cfg: TrainConfig) -> float:
    model.eval()
    gen = torch.Generator().manual_seed(10_000 + cfg.seed)  # the same windows every time
    total = 0.0
    for _ in range(cfg.eval_batches):
        x, y = data.batch("val", cfg.batch_size, cfg.seq_len, gen)
        device = next(model.parameters()).device
        x, y = x.to(device), y.to(device)
        logits = model(x).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).double(), y.flatten())
        if not torch.isfinite(loss):
            raise RunError(f"non-finite validation loss ({float(loss)}): the model diverged; "
                           "lower lr, raise warmup_steps or clip gradients (grad_clip), and "
                           "resume from the last checkpoint or start over with --restart")
        total += float(loss)
    model.train()
    return total / cfg.eval_batches


def _check_splits(data: Any, cfg: TrainConfig) -> None:
    """Every split (train, validation, and test with ``test_split``) holds at least one
    training window, before any step is taken."""
    for split in ("train", "val", "test") if cfg.test_split else ("train", "val"):
        n = len(data.tokens(split))
        if n <= cfg.seq_len + 1:
            docs = len(data.meta.get(f"{split}_documents", []))
            raise ValueError(
                f"the {split} split of corpus {cfg.corpus!r} has {n} tokens in {docs} "
                f"documents, fewer than one window of seq_len + 1 = {cfg.seq_len + 1}: the "
                f"split is by whole documents (val_fraction={cfg.val_fraction}), so the "
                "corpus needs at least two documents with enough text on each side; use a "
                "larger corpus, another val_fraction or a shorter seq_len")


def train(cfg: TrainConfig, stop_after: int | None = None, progress: bool = True,
          restart: bool = False) -> Path:
    """Run (or resume) ``cfg``; returns the metrics CSV. ``stop_after`` ends the process
    early as if killed after that step's checkpoint (for tests). ``restart``: start over
    from step 0, the run's checkpoints and metrics moved aside (never deleted).

    A resume never deletes a checkpoint: a damaged one is refused by name
    (:mod:`.checkpoint`), and so is a resume whose token data (corpus content, held-out
    texts, tokenizer) is not what the checkpoint was trained on.

    Under ``torchrun`` the same command trains with DDP or FSDP2 (``parallel``):
    ``batch_size`` is the global batch, split evenly over the ranks (every rank draws
    the same windows and keeps its share), so a run gives the same curve on any number
    of processes; rank 0 logs and saves."""
    from contextlib import nullcontext

    torch.set_num_threads(cfg.threads)
    D.check_parallel(cfg.parallel)
    rank, world = D.init_distributed()
    lock = run_folder_lock(Path(cfg.out_dir)) if rank == 0 else nullcontext()
    with lock:
        return _train(cfg, rank, world, stop_after, progress, restart)


def _train(cfg: TrainConfig, rank: int, world: int, stop_after: int | None, progress: bool,
           restart: bool = False) -> Path:
    """:func:`train` inside the run folder's lock (rank 0)."""
    import torch.distributed as dist

    from structlm.data.tokens import TokenDataset, build_token_dataset

    engine = D.resolve_engine(cfg.parallel, world)
    if cfg.batch_size % world:
        raise ValueError(f"batch_size={cfg.batch_size} is not divisible by the "
                         f"{world} processes")
    per_rank = cfg.batch_size // world
    device = torch.device(f"cuda:{local_rank()}"
                          if torch.cuda.is_available() else "cpu")
    out = Path(cfg.out_dir)
    cfg_path = out / "config.json"
    cfg_json = json.dumps(dataclasses.asdict(cfg), indent=1, sort_keys=True)
    ckpt = out / "checkpoint"
    data_dir = cfg.data_dir or out / "data"
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        if restart:
            moved = discard_run(out)
            if moved is not None:
                print(f"{out}: --restart: the run's checkpoints and metrics moved to "
                      f"{moved.name}", flush=True)
        for note in recover_checkpoint(ckpt)[1]:
            print(f"{out}: {note}", flush=True)
        if ckpt.exists():  # the checkpoint's own config first: config.json may be gone
            saved = checkpoint_config(ckpt) or (cfg_path.read_text() if cfg_path.exists()
                                                 else None)
            if saved is None:
                print(f"{out}: warning: the checkpoint predates configs stored in it and "
                      "config.json is missing: the resumed run cannot be checked against "
                      "the config it was started with", flush=True)
            diff = _run_differences(saved, cfg) if saved is not None else []
            if diff:
                raise ValueError(f"{out} holds a run with a different config ({'; '.join(diff)})"
                                 "; use another out_dir, change only "
                                 f"{sorted(_RUNTIME_FIELDS)}, or start over with --restart "
                                 "(the old run is moved aside)")
        atomic_write_text(cfg_path, cfg_json)
        _write_type_counts(out / "types.json", cfg)
        build_token_dataset(cfg.corpus, data_dir, cfg.val_fraction,
                            cfg.seed if cfg.data_seed is None else cfg.data_seed, cfg.heldout,
                            cfg.tokenizer, rebuild=not ckpt.exists(),
                            why="the checkpoint being resumed was trained on the tokens there",
                            test_split=cfg.test_split)
    if world > 1:
        dist.barrier()
    data = TokenDataset(Path(data_dir))
    _check_splits(data, cfg)
    model = build_model(cfg, data).to(device)
    net = D.wrap(model, engine, device)  # FSDP shards ``model`` in place
    opt, sched = build_optimizer(model, cfg)
    gen = torch.Generator().manual_seed(cfg.seed)
    step = 0
    last_loss: float | str = "none yet"
    metrics = out / "metrics.csv"
    if ckpt.exists():
        try:  # CPU (RNG states must stay there); under FSDP mapped lazily: rank 0 broadcasts
            state = torch.load(ckpt / "state.pt", weights_only=False, map_location="cpu",
                               mmap=engine == "fsdp")
        except Exception as e:
            raise RunError(corrupt_message(ckpt / "state.pt", e)) from e
        trained_on = state.get("data_fingerprint")
        if trained_on is not None and trained_on != data.fingerprint:
            raise RunError(f"{out}: the checkpoint was trained on other token data than "
                           f"{data_dir} holds now (corpus content, held-out texts or "
                           "tokenizer changed): restore them, or start over with --restart")
        try:
            D.load_model(model, str(ckpt / "model.safetensors"), engine, device)
        except Exception as e:
            raise RunError(corrupt_message(ckpt / "model.safetensors", e)) from e
        D.load_optimizer(model, opt, state["optimizer"], engine)
        sched.load_state_dict(state["scheduler"])
        gen.set_state(state["sampler"])
        torch.set_rng_state(state["torch_rng"])
        step = state["step"]
        if step > cfg.max_steps:
            raise ValueError(f"{out}: the checkpoint is at step {step}, beyond max_steps="
                             f"{cfg.max_steps}; a run can be extended, not shortened")
        if rank == 0:
            rows = list(csv.DictReader(metrics.open())) if metrics.exists() else []
            _write_rows(metrics, [{k: r.get(k) or "" for k in _FIELDS} for r in rows
                                  if int(r["step"]) <= step])
    elif rank == 0 and metrics.exists():
        metrics.unlink()
    autocast = D.autocast(engine, device)
    per_window, windows_per_step = cfg.type_counts(), cfg.batch_size * cfg.grad_accum
    model.train()
    start = time.perf_counter()
    bar = tqdm(total=cfg.max_steps, initial=step, desc=f"train {cfg.algebra}",
               disable=not progress or rank != 0, unit="step")
    while step < cfg.max_steps:
        opt.zero_grad(set_to_none=True)
        loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        for micro in range(cfg.grad_accum):
            x, y = data.batch("train", cfg.batch_size, cfg.seq_len, gen)
            x, y = (t[rank * per_rank:(rank + 1) * per_rank].to(device) for t in (x, y))
            with D.no_sync(net, engine, sync=micro == cfg.grad_accum - 1):
                # DDP: no gradient all-reduce until the last micro-batch
                with autocast:
                    logits = net(x).logits  # (B/world, T, V)
                    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(),
                                                             y.flatten())
                if not torch.isfinite(loss):
                    raise RunError(
                        f"non-finite training loss ({float(loss.detach())}) at step {step + 1}; "
                        f"the last finite one was {last_loss} at step {step}: the run diverged "
                        f"(lr={cfg.lr}, weight_decay={cfg.weight_decay}, grad_clip="
                        f"{cfg.grad_clip}); lower lr, raise warmup_steps or clip gradients, "
                        "then resume from the last checkpoint or start over with --restart")
                (loss / cfg.grad_accum).backward()
            loss_sum += loss.detach().double()
        if world > 1:
            dist.all_reduce(loss_sum)
            loss_sum /= world
        clip_gradients(model.parameters(), cfg.grad_clip)
        lr = opt.param_groups[0]["lr"]
        opt.step()
        sched.step()
        step += 1
        last_loss = float(loss_sum) / cfg.grad_accum
        row: dict[str, Any] = {"step": step, "lr": lr,
                               "train_loss": float(loss_sum) / cfg.grad_accum, "val_loss": "",
                               "tokens": step * cfg.batch_size * cfg.seq_len * cfg.grad_accum,
                               "type_tokens": "/".join(str(c * windows_per_step * step)
                                                       for c in per_window),
                               "seconds": round(time.perf_counter() - start, 3)}
        if step % cfg.eval_every == 0 or step == cfg.max_steps:
            row["val_loss"] = _evaluate(model, data, cfg)
        if rank == 0:
            _append_row(metrics, row)
        if step % cfg.save_every == 0 or step == cfg.max_steps:
            save_training_state(ckpt, model, opt, sched, gen, step, engine, rank,
                                data.fingerprint, cfg_json)
        bar.update(1)
        bar.set_postfix(loss=f"{row['train_loss']:.3f}")
        if stop_after is not None and step >= stop_after:
            break
    bar.close()
    if step >= cfg.max_steps:
        from structlm.train.plot import plot_loss_curves

        full = D.unsharded(model, engine, rank)  # collective under FSDP
        if full is not None:  # rank 0
            full.save_pretrained(out / "model")
            # the tokenizer beside the weights: the folder loads anywhere on its own
            data.tokenizer().save_pretrained(out / "model")
            try:
                plot_loss_curves([(cfg.algebra, str(metrics))], str(out / "loss.png"))
            except ImportError as e:  # plots are an extra: the run is complete without
                print(f"{out}: loss.png not drawn ({e})", flush=True)
    if world > 1:
        dist.barrier()
    return metrics


_FIELDS = ["step", "lr", "train_loss", "val_loss", "tokens", "type_tokens", "seconds"]
"""``type_tokens``: training tokens seen so far by each position type, ``/``-separated."""


def _write_type_counts(path: Path, cfg: TrainConfig) -> None:
    """Record (and print) which position types a training window holds."""
    counts = cfg.type_counts()
    info = {"algebra": cfg.algebra, "q": cfg.q, "type_schedule": cfg.type_schedule,
            "model_schedule": cfg.model_schedule() if cfg.q > 1 else None,
            "seq_len": cfg.seq_len, "positions_per_type_per_window": counts}
    atomic_write_json(path, info)
    if cfg.q > 1:
        print(f"position types ({info['model_schedule']}, q={cfg.q}, seq_len={cfg.seq_len}): "
              f"positions per type per window {counts}", flush=True)


def _write_rows(path: Path, rows: list[dict[str, Any]]) -> None:
    tmp = path.with_name(path.name + f".tmp-{os.getpid()}")
    with tmp.open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=_FIELDS)
        w.writeheader()
        w.writerows(rows)
    os.replace(tmp, path)


def _append_row(path: Path, row: dict[str, Any]) -> None:
    new = not path.exists()
    with path.open("a", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=_FIELDS)
        if new:
            w.writeheader()
        w.writerow(row)
        fh.flush()
