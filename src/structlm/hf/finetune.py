"""Fine-tune only the per-layer parts of a compressed model (tests 5, 6, 9).

Everything is frozen except: the cores ``A_l`` of :class:`SharedBasisLinear` (plus the
residual factors ``B_l, C_l`` for the hybrid), both factors of :class:`LowRankLinear`
(the free-factor control) and the coefficients ``D_l`` of :class:`OneSidedLinear`.
AdamW, linear warm-up, cosine to ``min_lr_ratio``, gradient clipping; the LM loss on
random windows of the calibration text; perplexity of **validation** windows at intervals
(same protocol as everywhere; :func:`structlm.hf.splits.require_validation` refuses test
windows, so no decision taken from the curve can read the test text). A non-finite loss
stops with an error.

Resumable at any step: with ``state_path`` the trained tensors, the optimiser, the
schedule, the batch generator and the curve are saved atomically every ``save_every``
steps (and when training ends); a later call with the same path and the same config
continues from the saved step and gives the same result as an uninterrupted run. A
finished run can also be *continued* to more steps (``continue_from``: its final state)
where its config differs only in ``steps`` and the learning-rate schedule of the longer
run is the same over the steps already taken (a constant rate after warm-up): the result
is that of a run of the longer length from the start (the same factors, losses and
evaluations; where the shorter run's closing evaluation falls on a step the longer run
does not evaluate, its value moves to that step's ``val_ppl_at_shorter_end``).

Learning rates are *relative* by default (``lr_scaling="relative"``): each trained tensor
gets ``lr × RMS(tensor at the start)``. Adam moves every element by about ``lr`` per step
whatever its size, and the factors here differ in scale by three orders of magnitude
(SmolLM2 attention at −40%: V/O cores RMS 0.02, whitened-SVD input factors up to 12), so
one absolute rate is either too large for the small tensors (measured: shared cores at
absolute lr 1e-3, 2 warm-up steps, jumped from loss 5.6 to 8.2 and never recovered) or too
small for the large ones. ``lr_scaling="absolute"`` gives plain AdamW.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import torch
from tqdm import tqdm

from structlm.config import OneOf, Range, RunError, validated
from structlm.hf.perplexity import perplexity
from structlm.hf.splits import Windows, require_validation
from structlm.nn.factorized import LowRankLinear, OneSidedLinear, SharedBasisLinear

__all__ = ["GRAD_CLIP_RANGE", "FinetuneConfig", "finetune", "load_continuation",
           "load_state", "lr_factor", "train_only", "trainable_parameters"]


#: Gradient clipping: 0 turns it off; a positive norm below 1e-6 would shrink every Adam
#: update far below its epsilon (the run would silently stop learning).
GRAD_CLIP_RANGE = Range(ge=1e-6, also=0, note="0: no clipping")


@dataclass
@validated
class FinetuneConfig:
    """A fine-tuning budget."""

    steps: Annotated[int, Range(ge=0, note="0: no fine-tuning where that is allowed")] = 60
    """Optimiser steps."""
    lr: Annotated[float, Range(gt=0)] = 2e-3
    """Peak rate; with ``lr_scaling="relative"`` a fraction of each tensor's RMS."""
    lr_scaling: Annotated[str, OneOf("relative", "absolute")] = "relative"
    """``relative`` (per tensor ``lr × RMS``) or ``absolute`` (plain AdamW)."""
    warmup: Annotated[int, Range(ge=0, note="0: no warm-up")] = 6
    """Linear warm-up steps, then cosine decay to min_lr_ratio x lr."""
    min_lr_ratio: Annotated[float, Range(ge=0, le=1)] = 0.1
    """Final rate as a fraction of the peak."""
    weight_decay: Annotated[float, Range(ge=0)] = 0.0
    """AdamW weight decay."""
    grad_clip: Annotated[float, GRAD_CLIP_RANGE] = 1.0
    """Gradient-norm clip."""
    batch_size: Annotated[int, Range(ge=1)] = 2
    """Windows per step."""
    seq_len: Annotated[int, Range(ge=1)] = 256
    """Tokens per window."""
    eval_every: Annotated[int, Range(ge=1)] = 20
    """Steps between evaluations of the curve."""
    eval_tokens: Annotated[int, Range(ge=1)] = 2048
    """Validation tokens scored at each evaluation of the curve."""
    eval_window: Annotated[int, Range(ge=2)] = 512
    """Window of those evaluations."""
    seed: Annotated[int, Range(ge=0)] = 0
    """Seed of the batch order (the experiment sets it per arm)."""
    keep_best: bool = False
    """Early stopping on validation: keep the trained tensors of the evaluation with the
    lowest validation NLL (the earliest on a tie) and restore them when training ends, so
    the run's model is its best checkpoint on the validation text (every arm trains the
    same ``steps``; only the checkpoint chosen differs)."""


def trainable_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """Freeze ``model`` except the per-layer factors of its compressed modules."""
    for p in model.parameters():
        p.requires_grad_(False)
    params: list[torch.nn.Parameter] = []
    for m in model.modules():
        if isinstance(m, SharedBasisLinear):
            params += [m.core] + ([m.res_b, m.res_c] if m.res_b is not None else [])
        elif isinstance(m, LowRankLinear):
            params += [m.B, m.C]
        elif isinstance(m, OneSidedLinear):
            params += [m.D]
    if not params:
        raise ValueError("the model has no compressed modules to fine-tune")
    for p in params:
        p.requires_grad_(True)
    return params


def _save_state(path: Path, cfg: FinetuneConfig, step: int, params: list[torch.nn.Parameter],
                opt: torch.optim.Optimizer, sched: Any, gen: torch.Generator,
                curve: list[dict[str, Any]], best: _Best) -> None:
    """Write the resumable state of a fine-tuning run atomically (temporary + replace)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".tmp-{os.getpid()}-{path.name}")
    torch.save({"config": dataclasses.asdict(cfg), "step": step,
                "params": [p.detach().clone() for p in params], "opt": opt.state_dict(),
                "sched": sched.state_dict(), "gen": gen.get_state(), "curve": curve,
                "best": best.state()}, tmp)
    os.replace(tmp, path)


class _Best:
    """The best validation checkpoint so far (``keep_best``): its NLL, step and a copy of
    the trained tensors."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.nll = math.inf
        self.step: int | None = None
        self.params: list[torch.Tensor] | None = None

    def offer(self, step: int, nll: float, params: list[torch.nn.Parameter]) -> None:
        if self.enabled and nll < self.nll:  # strictly lower: the earliest on a tie
            self.nll, self.step = nll, step
            self.params = [p.detach().clone() for p in params]

    def state(self) -> dict[str, Any] | None:
        if not self.enabled or self.params is None:
            return None
        return {"nll": self.nll, "step": self.step, "params": self.params}

    def load(self, saved: dict[str, Any] | None) -> None:
        if self.enabled and saved is not None:
            self.nll, self.step, self.params = saved["nll"], saved["step"], saved["params"]

    def restore(self, params: list[torch.nn.Parameter]) -> None:
        if self.enabled and self.params is not None:
            with torch.no_grad():
                for p, saved in zip(params, self.params, strict=True):
                    p.copy_(saved)


def load_state(path: Path, cfg: FinetuneConfig) -> dict[str, Any] | None:
    """The saved state at ``path`` (``None`` if there is none). A state saved under a
    different config is refused: it would mix two runs."""
    if not path.exists():
        return None
    try:
        state = torch.load(path, weights_only=False)
    except Exception as e:
        raise RuntimeError(f"fine-tuning state {path} cannot be read ({e}); delete it to "
                           f"restart this run from step 0") from e
    if state.get("config") != dataclasses.asdict(cfg):
        raise RuntimeError(f"fine-tuning state {path} was saved with config "
                           f"{state.get('config')}, not {dataclasses.asdict(cfg)}; delete it "
                           f"or use another state path")
    return state


def lr_factor(cfg: FinetuneConfig, step: int) -> float:
    """The learning-rate multiplier after ``step`` scheduler steps: linear warm-up, then
    cosine to ``min_lr_ratio`` at ``cfg.steps``."""
    if step < cfg.warmup:
        return (step + 1) / cfg.warmup
    t = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t))


def load_continuation(path: Path, cfg: FinetuneConfig) -> dict[str, Any]:
    """The final state of a shorter run at ``path``, to continue to ``cfg.steps``: refused
    (naming why) unless its config differs from ``cfg`` only in ``steps``, it stopped
    before ``cfg.steps``, and both runs' schedules give the same rate at every step it
    took (so the continued run is the longer run from the start)."""
    if not path.exists():
        raise FileNotFoundError(f"no fine-tuning state to continue from at {path}")
    try:
        state = torch.load(path, weights_only=False, map_location="cpu")
    except Exception as e:
        raise RuntimeError(f"fine-tuning state {path} cannot be read ({e})") from e
    saved, want = state.get("config", {}), dataclasses.asdict(cfg)
    if set(saved) != set(want):
        raise RuntimeError(f"fine-tuning state {path} was saved with config fields "
                           f"{sorted(saved)}, this version has {sorted(want)}")
    other = sorted(k for k in want if k != "steps" and saved.get(k) != want[k])
    if other:
        raise RuntimeError(f"fine-tuning state {path} was saved with other {', '.join(other)} "
                           f"({', '.join(f'{k}={saved.get(k)!r}' for k in other)}); only "
                           f"steps may differ when a run is continued")
    done = int(state["step"])
    if done >= cfg.steps:
        raise RuntimeError(f"fine-tuning state {path} is at step {done}: nothing to "
                           f"continue to {cfg.steps} steps")
    shorter = FinetuneConfig(**saved)
    if any(lr_factor(shorter, s) != lr_factor(cfg, s) for s in range(done + 1)):
        raise RuntimeError(f"fine-tuning state {path}: a {cfg.steps}-step run's learning-rate "
                           f"schedule differs from the {shorter.steps}-step run's over its "
                           f"{done} steps (min_lr_ratio={cfg.min_lr_ratio}: the cosine "
                           f"depends on the length); only a constant rate after warm-up "
                           f"(min_lr_ratio 1) can be continued")
    return state


def train_only(model: torch.nn.Module, params: list[torch.nn.Parameter]
               ) -> list[torch.nn.Parameter]:
    """Freeze every parameter of ``model`` except ``params`` (which must be its own)."""
    if not params:
        raise ValueError("no parameters to train")
    own = {id(p) for p in model.parameters()}
    if any(id(p) not in own for p in params):
        raise ValueError("params must be parameters of the model")
    for p in model.parameters():
        p.requires_grad_(False)
    for p in params:
        p.requires_grad_(True)
    return params


def finetune(model: torch.nn.Module, train_ids: torch.Tensor, validation: Windows,
             cfg: FinetuneConfig, progress: bool = True, state_path: Path | None = None,
             save_every: int = 10, params: list[torch.nn.Parameter] | None = None,
             prefix: list[int] | None = None,
             objective: Callable[[torch.nn.Module, torch.Tensor], torch.Tensor] | None = None,
             continue_from: Path | None = None) -> list[dict[str, Any]]:
    """Train the per-layer factors (or ``params``, everything else frozen); returns the
    curve (step, loss, lr, validation NLL and perplexity). ``validation``: the validation
    windows the curve scores (:class:`~structlm.hf.splits.Windows` of role ``validation``:
    anything else is refused). ``prefix``: ids every training window starts with
    (the tokenizer's convention, :func:`structlm.hf.text.window_prefix`). ``objective``
    (model, batch ``(B, T)``) -> scalar loss replaces the language-model loss (e.g. a
    layer-wise distillation, :mod:`structlm.convert.distill`); the curve's evaluations
    stay validation perplexities.

    With ``state_path``, the run saves its state every ``save_every`` steps and resumes
    from it (see the module docstring); the file is left in place for the caller to
    delete once the result is recorded. ``continue_from``: the final state of a shorter
    run of this config (:func:`load_continuation`), read when ``state_path`` holds no
    state yet; the continued run saves to ``state_path``."""
    if save_every < 1:
        raise ValueError(f"save_every must be >= 1, got {save_every}")
    eval_ids = require_validation(validation, "fine-tuning's curve")
    params = trainable_parameters(model) if params is None else train_only(model, params)
    head = torch.tensor(list(prefix or []), dtype=torch.long)  # the tokenizer's prefix
    body = cfg.seq_len + 1 - head.numel()
    n_windows = train_ids.numel() - body
    if n_windows < 1:
        raise ValueError(f"{train_ids.numel()} training tokens are fewer than one window of "
                         f"{cfg.seq_len + 1}")
    if cfg.lr_scaling == "relative":
        rms = [float(p.detach().pow(2).mean().sqrt()) for p in params]
        groups = [{"params": [p], "lr": cfg.lr * (r if r > 0 else 1.0)}  # all-zero: absolute
                  for p, r in zip(params, rms, strict=True)]
    elif cfg.lr_scaling == "absolute":
        groups = [{"params": params, "lr": cfg.lr}]
    else:
        raise ValueError(f"lr_scaling must be 'relative' or 'absolute', got {cfg.lr_scaling!r}")
    opt = torch.optim.AdamW(groups, lr=cfg.lr, weight_decay=cfg.weight_decay)

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: lr_factor(cfg, step))
    gen = torch.Generator().manual_seed(cfg.seed)
    device = next(model.parameters()).device
    curve: list[dict[str, Any]] = []
    best = _Best(cfg.keep_best)

    def evaluate(step: int, loss: float | None) -> None:
        model.eval()
        res = perplexity(model, eval_ids, window=cfg.eval_window, progress=False)
        curve.append({"step": step, "loss": loss, "lr": cfg.lr * sched.get_last_lr()[0]
                      / opt.param_groups[0]["initial_lr"], "val_ppl": res.ppl,
                      "val_nll": res.nll})
        best.offer(step, res.nll, params)

    start = 1
    state = load_state(Path(state_path), cfg) if state_path is not None else None
    source = state_path
    if state is None and continue_from is not None:
        state, source = load_continuation(Path(continue_from), cfg), continue_from
        done = state["step"]
        if done % cfg.eval_every and cfg.keep_best:
            raise RuntimeError(f"fine-tuning state {continue_from} stopped at step {done}, "
                               f"not an evaluation step of the longer run (every "
                               f"{cfg.eval_every}): with keep_best its best checkpoint may be "
                               "one the longer run never evaluates; rerun from step 0")
        if done % cfg.eval_every:  # the shorter run's closing evaluation: not one of ours
            last = state["curve"][-1]
            last["val_ppl_at_shorter_end"], last["val_ppl"] = last.get("val_ppl"), None
            last["val_nll"] = None
    if state is not None:
        if len(state["params"]) != len(params) or any(
                a.shape != b.shape for a, b in zip(state["params"], params, strict=True)):
            raise RuntimeError(f"fine-tuning state {source} holds tensors of other "
                               f"shapes than this model's trainable factors")
        with torch.no_grad():
            for p, saved in zip(params, state["params"], strict=True):
                p.copy_(saved)
        opt.load_state_dict(state["opt"])
        sched.load_state_dict(state["sched"])
        gen.set_state(state["gen"])
        curve.extend(state["curve"])
        best.load(state.get("best"))
        start = state["step"] + 1
    else:
        evaluate(0, None)
    bar = tqdm(range(start, cfg.steps + 1), desc="fine-tune", unit="step",
               disable=not progress, initial=start - 1, total=cfg.steps)
    for step in bar:
        model.train()
        starts = torch.randint(0, n_windows, (cfg.batch_size,), generator=gen)
        batch = torch.stack([torch.cat([head, train_ids[s:s + body]])
                             for s in starts]).to(device)  # (B, seq_len + 1)
        if objective is None:  # HF shifts the labels: position t predicts token t + 1
            loss = model(input_ids=batch, labels=batch, use_cache=False).loss
        else:
            loss = objective(model, batch)
        lv = loss.item()
        if not math.isfinite(lv):
            last = next((c["loss"] for c in reversed(curve) if c.get("loss") is not None),
                        "none yet")
            raise RunError(f"non-finite loss ({lv}) at fine-tuning step {step}; the last "
                           f"recorded one was {last}: fine-tuning diverged (lr={cfg.lr}, "
                           f"lr_scaling={cfg.lr_scaling!r}, weight_decay={cfg.weight_decay}, "
                           f"grad_clip={cfg.grad_clip}); lower lr or clip gradients")
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if cfg.grad_clip > 0:  # 0: no clipping (clip_grad_norm_ with 0 zeroes every gradient)
            torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        opt.step()
        sched.step()
        bar.set_postfix(loss=f"{lv:.3f}")
        if step % cfg.eval_every == 0 or step == cfg.steps:
            evaluate(step, lv)
        else:
            curve.append({"step": step, "loss": lv, "lr": cfg.lr * sched.get_last_lr()[0]
                          / opt.param_groups[0]["initial_lr"], "val_ppl": None})
        if state_path is not None and (step % save_every == 0 or step == cfg.steps):
            _save_state(Path(state_path), cfg, step, params, opt, sched, gen, curve, best)
    best.restore(params)  # keep_best: the best validation checkpoint, not the last step
    model.eval()
    return curve
