"""``svd-llm``: SVD-LLM as its public code does it — the truncation-aware whitening of
``svd-llm-w``, then SVD-LLM's layer-wise closed-form parameter update.

SVD-LLM (Wang, Zheng, Wan and Zhang, "SVD-LLM: Truncation-aware Singular Value
Decomposition for Large Language Model Compression", ICLR 2025, arXiv:2403.07378) has two
parts: *truncation-aware data whitening* (``W S`` with ``S`` a root of the calibration
inputs' ``XᵀX``, truncated SVD, the factors mapped back through ``S⁻¹``) and a *parameter
update* of the compressed weights. Its public code (AIoT-MLSys-Lab/SVD-LLM, ``SVDLLM.py``
at commit 0e3166628f9a8a16c47daa9dfe2e099c787ecea5; ``--step 2``, "whitening then
update": ``whitening_local_update`` and class ``local_update``), which this module
follows, does the update like this:

* the whitening roots come from the *original* model's calibration inputs (its
  ``profle_svdllm_low_resource``); each linear module is truncated as in
  ``svd-llm-w``: ``W_l S ≈ U_k Σ_k V_kᵀ``;
* the layers are then processed in order. For layer ``i`` the calibration inputs are run
  through the model whose layers ``< i`` are already compressed *and updated* while layer
  ``i`` itself is still the original one; forward hooks on layer ``i``'s linear modules
  record each module's input ``X`` and the original module's output ``Y = X Wᵀ``. So
  within layer ``i`` every linear sees inputs of the *original* layer ``i`` (its earlier
  sublayers uncompressed), with layers ``< i`` compressed;
* per module the output factor is refitted by least squares with the input factor fixed:
  ``x = X (V_kᵀ S⁻¹)ᵀ Σ_k`` and ``Uᵀ = lstsq(x, Y)``; the module keeps ``(U, V_kᵀ S⁻¹)``
  (``√Σ`` moved onto both sides, which changes no product);
* layer ``i`` is replaced by its updated factors, its outputs become layer ``i + 1``'s
  inputs, and layer ``i + 1`` proceeds. The gated MLP's ``gate_proj`` and ``up_proj`` are
  separate modules, refitted each on its own.

Here the input factor is ``C = V_kᵀ S⁺`` and the output factor ``B = U_k Σ_k`` of a
:class:`~structlm.nn.factorized.LowRankLinear` (Σ on the output side: the least-squares
product is the same whichever side Σ sits on). From the float64 second moment
``C_X = E[XᵀX]`` of the compressed model's inputs the least-squares solution is
``B = W C_X Cᵀ (C C_X Cᵀ)⁻¹`` — Basis Sharing's coefficient refit
(:func:`~structlm.share.compress.methods.refit.update_coefficients`), reused here
per layer and per part (a gated MLP-in's gate and up each on its own). The refit fits the
output without the bias (``Y − b = X Wᵀ``), which the module keeps unchanged.

How it runs (:func:`layerwise_update`): every type is compressed first, as for
``svd-llm-w``; then the decoder stack's input and each block's other arguments are
captured once (a pre-hook on block 0 ends the forward there, so the embeddings run once
per batch; the other blocks' arguments — masks, rotary tables, which depend on the
windows' shape only — once per batch shape), and the hidden states are carried from
block to block: for block ``i`` its original dense modules are put back (from the dense
weights and the compressed modules' biases), pre-hooks on its input sites accumulate
float64 second moments (:class:`~structlm.hf.calibration.CovarianceAccumulator`) and end
the block's forward (:class:`~structlm.hf.hooks.StopForward`) once every compressed
site has seen its input (MLP-out last), the compressed modules go back in and are
refitted, and the batch's hidden states go through the updated block to block ``i + 1``.
Running the whole model from its start for every layer, as SVD-LLM's hooks do, would cost
``L/2`` full forwards (~20 min for SmolLM2 on 2 cores); carrying costs about two.

Where this differs from SVD-LLM's code (also in docs/share.md):

* the whitening root is the symmetric ``C^{1/2}`` with a relative eigenvalue floor
  (``eig_floor``) instead of a Cholesky factor with an eigenvalue shift when ``XᵀX`` is
  not positive definite (the truncated product is the same for any root of the same
  matrix; only the regularisation of a singular ``C`` differs); the refit's ``(C C_X
  Cᵀ)⁻¹`` is floored the same way instead of ``lstsq``'s minimum-norm solution;
* the update reads the calibration windows the compression already has (64 windows of
  512 tokens = 32,768 tokens in the experiments) instead of a separate draw of
  ``updating_nsamples`` = 16 windows of 2048 (the same token count);
* the paper's optional LoRA fine-tuning stage is replaced by the project's fine-tuning,
  which trains both factors;
* SVD-LLM's README recommends whitening alone (``svd-llm-w``) at compression ratios up
  to 0.3 and the update above that; the experiments run both variants at every budget.

Stored parameters and MACs per token are those of ``svd-llm-w`` at the same budget (the
update changes values, not shapes); the update is part of the method (always on;
``BasisSharingOptions.update`` stays Basis Sharing's optional step), so
:func:`~structlm.share.compress.apply.compress_model` needs the calibration tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from tqdm import tqdm

from structlm.hf.adapters import SITE_OF, ConcatProjection, MatrixType, ModelAdapter
from structlm.hf.adapters.modules import linear_from
from structlm.hf.calibration import Calibration, CovarianceAccumulator, calibration_windows
from structlm.hf.hooks import StopForward, hooked, run_until_stopped
from structlm.share.compress.methods.base import TypePlan, register
from structlm.share.compress.methods.refit import update_coefficients
from structlm.share.compress.methods.svd import SvdLlmWMethod

__all__ = ["SVD_LLM_METHOD", "BlockInputs", "SvdLlmMethod", "block_inputs", "layerwise_update"]

_SITES = ("attn_in", "attn_out", "mlp_in", "mlp_out")
"""The input sites in forward order."""


class BlockInputs:
    """One calibration batch as the decoder blocks see it: the current block's input
    ``hidden`` ``(B, T, d)`` and, per block, its other positional and keyword arguments
    (as the model made them: masks, rotary tables, cache positions)."""

    def __init__(self, hidden: torch.Tensor, calls: list[tuple[tuple, dict[str, Any]]]) -> None:
        self.hidden = hidden
        self.calls = calls

    def run(self, block: nn.Module, i: int) -> Any:
        """``block`` (the ``i``-th) on the current hidden states."""
        args, kwargs = self.calls[i]
        return block(self.hidden, *args, **kwargs)


def _split_call(args: tuple, kwargs: dict[str, Any]) -> tuple[torch.Tensor,
                                                              tuple[tuple, dict[str, Any]]]:
    if args:
        return args[0], (args[1:], dict(kwargs))
    rest = {k: v for k, v in kwargs.items() if k != "hidden_states"}
    return kwargs["hidden_states"], ((), rest)


@torch.no_grad()
def block_inputs(model: nn.Module, blocks: Sequence[nn.Module], batches: Sequence[torch.Tensor]
                 ) -> list[BlockInputs]:
    """Per batch of token windows ``(B, T)``: the first block's input, captured by a
    pre-hook that ends the forward there (only the embeddings run), and every block's
    other arguments, captured once per batch shape by one forward that ends at the last
    block's pre-hook (they depend on the windows' shape, not on their tokens: no padding,
    no attention mask, positions from 0)."""
    device = next(model.parameters()).device
    by_shape: dict[tuple[int, ...], list[tuple[tuple, dict[str, Any]]]] = {}
    out = []
    for ids in batches:
        shape = tuple(ids.shape)
        if shape not in by_shape:
            calls: list[tuple[tuple, dict[str, Any]]] = []

            def every(module: nn.Module, args: tuple, kwargs: dict, calls=calls) -> None:
                calls.append(_split_call(args, kwargs)[1])
                if len(calls) == len(blocks):
                    raise StopForward

            with hooked(blocks, every, with_kwargs=True):
                run_until_stopped(model, input_ids=ids.to(device), use_cache=False)
            if len(calls) != len(blocks):
                raise RuntimeError(f"{len(calls)} of {len(blocks)} decoder blocks ran on a "
                                   "calibration batch")
            by_shape[shape] = calls
        first: list[torch.Tensor] = []

        def stop(module: nn.Module, args: tuple, kwargs: dict, first=first) -> None:
            first.append(_split_call(args, kwargs)[0])
            raise StopForward

        with hooked(blocks[:1], stop, with_kwargs=True):
            run_until_stopped(model, input_ids=ids.to(device), use_cache=False)
        out.append(BlockInputs(first[0], by_shape[shape]))
    return out


def _bias(module: nn.Module) -> torch.Tensor | None:
    """The bias a compressed module adds (the parts' biases concatenated), or ``None``."""
    pieces = list(module.parts) if isinstance(module, ConcatProjection) else [module]
    biases = [getattr(p, "bias", None) for p in pieces]
    if all(b is None for b in biases):
        return None
    if any(b is None for b in biases):
        raise ValueError("a compressed module whose parts have a bias only in part")
    return torch.cat([b.detach() for b in biases])


def _dense(weight: torch.Tensor, like: nn.Module) -> nn.Linear:
    """The original dense module of ``weight`` ``(out, in)`` with ``like``'s bias, on its
    device and in its dtype."""
    p = next(like.parameters())
    b = _bias(like)
    return linear_from(weight.to(p.device, p.dtype),
                       None if b is None else b.to(p.device, p.dtype))


@torch.no_grad()
def _site_moments(layer: Any, block: nn.Module, index: int, sites: list[str],
                  batches: list[BlockInputs]) -> dict[str, torch.Tensor]:
    """Float64 ``E[x xᵀ]`` of each of ``sites``' inputs in block ``index`` over the
    batches; each block forward ends once every site has seen its input."""
    modules = {id(layer.site_module(s)): s for s in sites}
    accs: dict[str, CovarianceAccumulator] = {}
    seen: set[str] = set()

    def hook(module: nn.Module, args: tuple) -> None:
        site = modules[id(module)]
        x = args[0]
        accs.setdefault(site, CovarianceAccumulator(x.shape[-1])).update(x)
        seen.add(site)
        if len(seen) == len(sites):
            raise StopForward

    with hooked([layer.site_module(s) for s in sites], hook):
        for b in batches:
            seen.clear()
            run_until_stopped(b.run, block, index)
    missing = [s for s in sites if s not in accs]
    if missing:
        raise RuntimeError(f"layer {index}: sites {missing} never ran on the calibration "
                           "batches")
    return {s: a.second_moment() for s, a in accs.items()}


def layerwise_update(adapter: ModelAdapter, plans: list[TypePlan],
                     originals: dict[MatrixType, list[torch.Tensor]], tokens: torch.Tensor,
                     seq_len: int = 512, floor: float = 1e-6, batch_size: int = 4,
                     progress: bool = False,
                     moments: dict[tuple[int, str], torch.Tensor] | None = None
                     ) -> dict[str, Any]:
    """SVD-LLM's layer-wise update of the compressed ``plans`` (module docstring), in
    place: layer by layer, the output factors of layer ``i``'s compressed modules are
    refitted to the original weights ``originals`` under the inputs of the original layer
    ``i`` in the model whose layers ``< i`` are compressed and updated.

    ``tokens``: the calibration windows (``(n, w)``, or ``(N,)`` cut into windows of
    ``seq_len``); ``moments``, if given, receives each ``(layer, site)``'s captured float64
    second moment. Returns, per type, the whitened output error ``Σ_l tr((W_l − Ŵ_l) C_X
    (W_l − Ŵ_l)ᵀ)`` on those inputs before and after the refit, per layer too, and
    relative to the output energy ``Σ_l tr(W_l C_X W_lᵀ)``."""
    model = adapter.model
    types = [p.type for p in plans]
    parts = {p.type: p.parts for p in plans}
    sites = [s for s in _SITES if any(SITE_OF[t] == s for t in types)]
    windows = calibration_windows(tokens, seq_len)
    blocks = [layer.block for layer in adapter.layers]
    was_training = model.training
    model.eval()
    stats: dict[MatrixType, dict[str, list[float]]] = {
        t: {"before": [], "after": [], "energy": []} for t in types}
    try:
        with torch.no_grad():
            batches = block_inputs(model, blocks, list(windows.split(batch_size)))
            for i in tqdm(range(adapter.num_layers), desc="svd-llm update", unit="layer",
                          disable=not progress, leave=False):
                layer = adapter.layers[i]
                compressed = {t: layer.module(t) for t in types}
                for t in types:  # layer i as it was: its original dense modules
                    layer.replace(t, _dense(originals[t][i], compressed[t]))
                try:
                    found = _site_moments(layer, blocks[i], i, sites, batches)
                finally:
                    for t in types:
                        layer.replace(t, compressed[t])
                if moments is not None:
                    moments.update({(i, s): c for s, c in found.items()})
                for t in types:
                    C = found[SITE_OF[t]]
                    w = originals[t][i].double()
                    res = update_coefficients([compressed[t]], [originals[t][i]], [C], [[0]],
                                              parts[t], floor)
                    stats[t]["before"].append(sum(res["error_before"]))
                    stats[t]["after"].append(sum(res["error_after"]))
                    stats[t]["energy"].append(float(((w @ C) * w).sum()))
                if i + 1 < adapter.num_layers:  # the next block's inputs, through this one
                    for b in batches:
                        out = b.run(blocks[i], i)
                        b.hidden = out[0] if isinstance(out, tuple) else out
    finally:
        model.train(was_training)
    report: dict[str, Any] = {}
    for t, s in stats.items():
        energy = sum(s["energy"]) or 1.0
        report[t.value] = {"error_before": sum(s["before"]), "error_after": sum(s["after"]),
                           "relative_error_before": sum(s["before"]) / energy,
                           "relative_error_after": sum(s["after"]) / energy,
                           "error_before_per_layer": s["before"],
                           "error_after_per_layer": s["after"]}
    return report


class SvdLlmMethod(SvdLlmWMethod):
    """``svd-llm-w``'s factors, then SVD-LLM's layer-wise update (:func:`layerwise_update`),
    always."""

    name = "svd-llm"
    always_updates = True

    def update(self, adapter: ModelAdapter, cal: Calibration, plans: list[TypePlan],
               originals: dict[MatrixType, list[torch.Tensor]], tokens: torch.Tensor,
               floor: float) -> dict[str, Any]:
        """:func:`layerwise_update` on the calibration windows (cut as the calibration
        was)."""
        return layerwise_update(adapter, plans, originals, tokens,
                                seq_len=int(cal.meta.get("seq_len", 512)), floor=floor)


SVD_LLM_METHOD = register(SvdLlmMethod())
"""SVD-LLM: whitened truncation and the layer-wise closed-form update."""
