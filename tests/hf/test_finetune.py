"""Fine-tuning of compressed modules: relative learning rates, frozen shared parts, and
the YAML configs under configs/share/ parse into their dataclasses."""

from __future__ import annotations

import dataclasses
import glob
import os

import pytest
import torch
from transformers import LlamaForCausalLM

from structlm.config import ConfigError, read_yaml
from structlm.experiments.share.experiment import ExperimentConfig
from structlm.hf.adapters import get_adapter
from structlm.hf.calibration import calibrate
from structlm.hf.finetune import FinetuneConfig, finetune, trainable_parameters
from structlm.hf.splits import Windows
from structlm.share.compress import CompressionConfig, SharedBasisLinear, compress_model
from tiny_models import tiny_llama, validation_of

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _val(ids: torch.Tensor) -> Windows:
    return validation_of(ids[:64].view(2, 32))


def _compressed(method: str) -> LlamaForCausalLM:
    model = tiny_llama()
    adapter = get_adapter(model)
    ids = torch.randint(0, 89, (256,), generator=torch.Generator().manual_seed(1))
    cal = calibrate(adapter, ids, seq_len=32, batch_size=2, progress=False)
    compress_model(adapter, cal, CompressionConfig(method=method, types="all",
                                                   target_reduction=0.4,
                                                   hybrid={"residual_rank": 2}))
    return model


@pytest.mark.parametrize("scaling", ["relative", "absolute"])
def test_finetune_trains_only_factors_with_scaled_rates(scaling: str, monkeypatch) -> None:
    model = _compressed("hybrid")
    frozen = {n: p.detach().clone() for n, p in model.named_parameters()
              if not n.endswith(("core", "res_b", "res_c"))}
    cores = {n: p.detach().clone() for n, p in model.named_parameters() if n.endswith("core")}
    expected = [1e-2 * float(p.detach().pow(2).mean().sqrt())
                for p in trainable_parameters(model)]
    seen: list[list[float]] = []
    real_adamw = torch.optim.AdamW

    def spy(groups, **kw):
        opt = real_adamw(groups, **kw)
        seen.append([g["lr"] for g in opt.param_groups])
        return opt

    monkeypatch.setattr(torch.optim, "AdamW", spy)
    ids = torch.randint(0, 89, (400,), generator=torch.Generator().manual_seed(2))
    ft = FinetuneConfig(steps=3, lr=1e-2, lr_scaling=scaling, warmup=1, seq_len=16,
                        batch_size=2, eval_every=3, eval_tokens=64, eval_window=32)
    curve = finetune(model, ids, _val(ids), ft, progress=False)
    assert [c["step"] for c in curve] == [0, 1, 2, 3]
    assert curve[1]["lr"] == pytest.approx(1e-2)  # the nominal rate after warm-up
    for n, p in model.named_parameters():
        if n in frozen:
            assert torch.equal(p.detach(), frozen[n]), f"{n} changed but is frozen"
    assert any(not torch.equal(p.detach(), cores[n]) for n, p in model.named_parameters()
               if n in cores)
    lrs = seen[0]
    if scaling == "absolute":
        assert lrs == [1e-2]
    else:
        cores_n = sum(isinstance(m, SharedBasisLinear) for m in model.modules())
        assert len(lrs) > cores_n  # one group per tensor (cores and residuals)
        assert lrs == pytest.approx(expected, rel=1e-6)  # lr x each tensor's RMS
        assert len({round(v, 12) for v in lrs}) > 1


def test_bad_lr_scaling_is_named() -> None:
    with pytest.raises(ValueError, match="lr_scaling: 'x' is not valid: expected one of "
                                         "'relative', 'absolute'"):
        FinetuneConfig(steps=1, lr_scaling="x", seq_len=16)


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(ROOT, "configs", "share",
                                                               "*.yaml"))))
def test_share_configs_parse(path: str, monkeypatch) -> None:
    monkeypatch.chdir(ROOT)  # paths inside the configs (`beside`) are from the repo root
    raw = read_yaml(path)
    if os.path.basename(path).startswith("experiment"):
        cfg = ExperimentConfig.from_dict(raw)
        assert cfg.finetune.lr_scaling == "relative"
    else:
        ft = raw.pop("finetune", {})
        CompressionConfig.from_dict(raw)
        FinetuneConfig(**ft)


def test_killed_finetune_resumes_to_the_same_result(tmp_path, monkeypatch) -> None:
    """A run killed between saves resumes from its last state and ends where an
    uninterrupted run ends (same factors, same curve); a state of another config is
    refused by name."""
    ids = torch.randint(0, 89, (400,), generator=torch.Generator().manual_seed(3))
    ft = FinetuneConfig(steps=6, lr=1e-2, warmup=1, seq_len=16, batch_size=2, eval_every=3,
                        eval_tokens=64, eval_window=32)
    whole = _compressed("hybrid")
    curve_whole = finetune(whole, ids, _val(ids), ft, progress=False)

    killed = _compressed("hybrid")
    state = tmp_path / "state.pt"
    real_clip = torch.nn.utils.clip_grad_norm_
    calls = {"n": 0}

    def clip_then_die(*a, **kw):
        calls["n"] += 1
        if calls["n"] == 4:  # step 4: after the save at step 2, before the one at step 4
            raise KeyboardInterrupt
        return real_clip(*a, **kw)

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", clip_then_die)
    with pytest.raises(KeyboardInterrupt):
        finetune(killed, ids, _val(ids), ft, progress=False, state_path=state, save_every=2)
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", real_clip)
    assert torch.load(state, weights_only=False)["step"] == 2

    resumed = _compressed("hybrid")  # a fresh process would rebuild the model the same way
    curve_resumed = finetune(resumed, ids, _val(ids), ft, progress=False, state_path=state,
                             save_every=2)
    assert [c["step"] for c in curve_resumed] == [c["step"] for c in curve_whole]
    for a, b in zip(curve_resumed, curve_whole, strict=True):
        if b["loss"] is None:
            assert a["loss"] is None
        else:
            assert a["loss"] == pytest.approx(b["loss"], rel=1e-6)
        if b["val_ppl"] is not None:
            assert a["val_ppl"] == pytest.approx(b["val_ppl"], rel=1e-6)
    for (n, p), q in zip(resumed.named_parameters(), whole.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7, msg=lambda m, n=n: f"{n}: {m}")
    with pytest.raises(RuntimeError, match="was saved with config"):
        finetune(_compressed("hybrid"), ids, _val(ids), dataclasses.replace(ft, steps=7),
                 progress=False, state_path=state)


def test_a_finished_run_continued_is_the_longer_run(tmp_path) -> None:
    """A 4-step run's final state continued to 8 steps takes 4 more steps and gives the
    8-step run from the start (same factors, losses, rates and evaluations), through
    warm-up into a cosine as long as the schedules agree over the steps taken; a schedule
    that depends on the length over those steps, another config, or nothing left to do
    is refused."""
    from structlm.hf.finetune import load_continuation

    ids = torch.randint(0, 89, (400,), generator=torch.Generator().manual_seed(5))
    steps_taken = []

    def lm_loss(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
        steps_taken.append(1)
        return model(input_ids=batch, labels=batch, use_cache=False).loss

    # warm-up over 6 steps, then a cosine to 0.1: the 4 steps taken are all warm-up, the
    # same in a 4- and an 8-step run; evaluations every 3 steps (4 is not one)
    ft8 = FinetuneConfig(steps=8, lr=1e-2, warmup=6, min_lr_ratio=0.1, seq_len=16,
                         batch_size=2, eval_every=3, eval_tokens=64, eval_window=32)
    ft4 = dataclasses.replace(ft8, steps=4)
    whole = _compressed("hybrid")
    curve_whole = finetune(whole, ids, _val(ids), ft8, progress=False, objective=lm_loss)
    final = tmp_path / "final4.pt"
    finetune(_compressed("hybrid"), ids, _val(ids), ft4, progress=False, state_path=final,
             objective=lm_loss)
    steps_taken.clear()
    longer = _compressed("hybrid")
    curve = finetune(longer, ids, _val(ids), ft8, progress=False, objective=lm_loss,
                     state_path=tmp_path / "run8.pt", continue_from=final)
    assert len(steps_taken) == 4  # continued, not run again from step 0
    assert [c["step"] for c in curve] == [c["step"] for c in curve_whole]
    for a, b in zip(curve, curve_whole, strict=True):
        for k in ("loss", "val_ppl", "lr"):
            assert (a[k] is None) == (b[k] is None), (a["step"], k)
            if b[k] is not None:
                assert a[k] == pytest.approx(b[k], rel=1e-6), (a["step"], k)
    at4 = next(c for c in curve if c["step"] == 4)  # the 4-step run's closing evaluation
    assert at4["val_ppl"] is None and at4["val_ppl_at_shorter_end"] > 0
    for (n, p), q in zip(longer.named_parameters(), whole.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7, msg=lambda m, n=n: f"{n}: {m}")
    assert torch.load(tmp_path / "run8.pt", weights_only=False)["step"] == 8
    past = tmp_path / "past_warmup.pt"  # 5 steps past a 2-step warm-up: the cosine differs
    finetune(_compressed("hybrid"), ids, _val(ids), dataclasses.replace(ft4, warmup=2),
             progress=False, state_path=past)
    with pytest.raises(RuntimeError, match="schedule differs"):
        load_continuation(past, dataclasses.replace(ft8, warmup=2))
    with pytest.raises(RuntimeError, match=r"other lr \(lr=0.01\)"):
        load_continuation(final, dataclasses.replace(ft8, lr=2e-2))
    with pytest.raises(RuntimeError, match="nothing to continue"):
        load_continuation(final, ft4)
    with pytest.raises(FileNotFoundError):
        load_continuation(tmp_path / "none.pt", ft8)


def test_recorded_arm_deletes_or_keeps_its_finetune_state(tmp_path) -> None:
    from structlm.experiments.share.arms import ArmCache as _ArmCache

    cache = _ArmCache(tmp_path / "arms.json", ExperimentConfig())
    key = '{"part": "finetuned", "seed": 0}'
    state = cache.state_path(key)
    state.parent.mkdir(parents=True)
    state.write_bytes(b"partial run")
    assert cache._get(key, lambda: {"ppl_finetuned": {"t": 1.5}}, "arm", False) == {
        "ppl_finetuned": {"t": 1.5}}
    assert not state.exists() and key in _ArmCache(tmp_path / "arms.json",
                                                   ExperimentConfig()).done
    assert not cache.state_path(key, final=True).exists()
    # with keep_finetune_states the finished run's state moves aside, whole
    keeping = ExperimentConfig(keep_finetune_states=True, seed_regime=False,
                               finetune=FinetuneConfig(steps=100, min_lr_ratio=1.0))
    kept = _ArmCache(tmp_path / "kept" / "arms.json", keeping)
    state = kept.state_path(key)
    state.parent.mkdir(parents=True)
    state.write_bytes(b"final state")
    kept._get(key, lambda: {"ppl_finetuned": {"t": 1.5}}, "arm", False)
    assert not state.exists()
    assert kept.state_path(key, final=True).read_bytes() == b"final state"
    # killed after arms.json was written, before the move: the next read settles it
    state.write_bytes(b"left behind")
    again = _ArmCache(tmp_path / "kept" / "arms.json", keeping)
    again._get(key, lambda: pytest.fail("a recorded arm is not run again"), "arm", False)
    assert not state.exists()
    assert again.state_path(key, final=True).read_bytes() == b"left behind"
    with pytest.raises(ConfigError, match=r"must exceed finetune\.steps=100"):
        ExperimentConfig(seed_regime=False, continue_unplateaued_to=100,
                         finetune=FinetuneConfig(steps=100, min_lr_ratio=1.0))
    with pytest.raises(ConfigError, match="continue_unplateaued_to needs a constant rate"):
        ExperimentConfig(continue_unplateaued_to=200, finetune=FinetuneConfig(steps=100))
    with pytest.raises(ConfigError, match=r"min_lr_ratio is 0\.1"):
        ExperimentConfig(keep_finetune_states=True,
                         finetune=FinetuneConfig(steps=100, min_lr_ratio=0.1))


def test_grad_clip_zero_means_no_clipping() -> None:
    """``grad_clip: 0`` is documented as no clipping: the factors move as with a huge
    clip (clip_grad_norm_ with 0 would zero every gradient); a negative value is refused."""
    ids = torch.randint(0, 89, (400,), generator=torch.Generator().manual_seed(4))
    ends = []
    for clip in (0.0, 1e9):
        model = _compressed("svd")
        before = [p.detach().clone() for p in trainable_parameters(model)]
        finetune(model, ids, _val(ids), FinetuneConfig(steps=2, lr=1e-2, warmup=1, seq_len=16,
                                                      batch_size=2, eval_every=2,
                                                      eval_tokens=64, eval_window=32,
                                                      grad_clip=clip), progress=False)
        after = [p.detach() for p in trainable_parameters(model)]
        assert all(not torch.equal(a, b) for a, b in zip(after, before, strict=True))
        ends.append(after)
    for a, b in zip(*ends, strict=True):
        torch.testing.assert_close(a, b)
    with pytest.raises(ValueError,
                       match=r"grad_clip: -1\.0 is out of range: expected >= 1e-06, or 0"):
        FinetuneConfig(grad_clip=-1)


def test_the_curve_refuses_test_windows_and_bare_tensors() -> None:
    """No decision can read the test text: fine-tuning's curve (what the plateau rule,
    the continuation, the rate probe and the best checkpoint read) takes validation
    windows only."""
    from structlm.hf.splits import Role, TestWindowsError

    ids = torch.randint(0, 89, (400,), generator=torch.Generator().manual_seed(5))
    ft = FinetuneConfig(steps=1, lr=1e-2, warmup=1, seq_len=16, batch_size=2, eval_every=1,
                        eval_tokens=64, eval_window=32)
    test = Windows(ids[:64].view(2, 32), Role.TEST, "in_domain:x")
    with pytest.raises(TestWindowsError, match="got the test windows 'in_domain:x'"):
        finetune(_compressed("svd-llm-w"), ids, test, ft, progress=False)
    with pytest.raises(TestWindowsError, match="got Tensor"):
        finetune(_compressed("svd-llm-w"), ids, ids[:64].view(2, 32), ft, progress=False)


def test_keep_best_restores_the_best_validation_checkpoint(tmp_path) -> None:
    """With ``keep_best`` the model ends at the evaluation with the lowest validation NLL
    (here forced by a rate so high that training gets worse), and a resumed run keeps
    the same best."""
    from structlm.experiments.share.rate_probe import best_validation

    ids = torch.randint(0, 89, (400,), generator=torch.Generator().manual_seed(6))
    ft = FinetuneConfig(steps=6, lr=0.5, lr_scaling="absolute", warmup=1, seq_len=16,
                        batch_size=2, eval_every=2, eval_tokens=64, eval_window=32,
                        min_lr_ratio=1.0, keep_best=True)
    model = _compressed("svd-llm-w")
    curve = finetune(model, ids, _val(ids), ft, progress=False)
    nll, step = best_validation(curve)
    assert step < 6  # the last step is not the best at this rate
    from structlm.hf.perplexity import perplexity

    assert perplexity(model, _val(ids).ids, window=32, progress=False).nll == pytest.approx(
        nll, rel=1e-6)
    last = dataclasses.replace(ft, keep_best=False)
    plain = _compressed("svd-llm-w")
    finetune(plain, ids, _val(ids), last, progress=False)
    assert perplexity(plain, _val(ids).ids, window=32, progress=False).nll > nll
