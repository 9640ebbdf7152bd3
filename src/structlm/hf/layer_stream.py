"""Run a causal LM whose weights stay on disk, one decoder layer at a time.

Peak memory is set by one layer plus the activations carried between layers, **not by
depth** (the peers' layer-wise design: SliceGPT, GPTQ, SVD-LLM):

* :class:`WeightFolder` reads tensors by name from a Hugging Face folder's safetensors
  files (one file or an index of shards; memory-mapped, nothing kept);
* :class:`StreamedModel` builds the real ``transformers`` model with every decoder
  layer, the embedding and the head on the ``meta`` device (no memory) and makes a
  module resident only inside :meth:`StreamedModel.resident` — its tensors assigned
  straight from the file, released on exit;
* :meth:`StreamedModel.capture` embeds every batch and records what the model passes to
  each layer (attention masks, rotary tables, exactly as its own forward makes them);
  :meth:`StreamedModel.run_layer` carries the hidden states of all batches through one
  layer;
* :func:`streamed_perplexity` scores windows with the protocol of
  :mod:`structlm.hf.perplexity` (same per-window sums, same fingerprint), layer-major.

Layer-major means each layer's weights are read once for all windows, so the
activations of all windows (``(n, w, d)`` float32: 100 MB for 16k tokens at width
1,536) are held instead of the model.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm import tqdm

from structlm.cpu_malloc import release_freed_memory, returning_freed_memory
from structlm.hf.adapters import MatrixType, get_adapter
from structlm.hf.hooks import StopForward, run_until_stopped
from structlm.hf.perplexity import (
    PLAIN_HEAD_TYPES,
    PerplexityResult,
    chunked_head_logprobs,
    leading_bos,
    plain_head,
    scored_windows_key,
)

__all__ = ["STREAMED_FORMATS", "STREAM_ABOVE_BYTES", "LayerInputs", "StreamedModel",
           "StreamedWeights",
           "WeightFolder", "open_streamed", "register_streamed_format", "stream_folder",
           "streamed_perplexity"]

_INDEX = "model.safetensors.index.json"

STREAM_ABOVE_BYTES = 2 << 30
"""``--stream auto`` streams a model whose stored weights exceed 2 GiB (Qwen2.5-Coder
0.5B and larger): the results are the same either way (tested bitwise), the memory is
not."""


STREAMED_FORMATS: dict[str, tuple[str, Callable[[Path], nn.Module]]] = {}
"""A folder format that streams: file marking it (its sharded index) → (that index's name,
a builder of the folder's model with no tensor read). ``structlm.share`` registers its
sharded compressed folders."""


def register_streamed_format(marker: str, skeleton: Callable[[Path], nn.Module]) -> None:
    """Make a folder holding the index ``marker`` stream through ``skeleton(folder)`` (the
    model with its tensors unread) and that index (how a capability above this layer plugs
    in its own sharded format)."""
    STREAMED_FORMATS[marker] = (marker, skeleton)


def open_streamed(folder: str | Path) -> StreamedModel:
    """The :class:`StreamedModel` of ``folder``: a registered format's
    (:data:`STREAMED_FORMATS`) or a plain Hugging Face folder's."""
    folder = Path(folder)
    for marker, (index, skeleton) in STREAMED_FORMATS.items():
        if (folder / marker).is_file():
            with returning_freed_memory():  # its freed modules leave no heap hole
                return StreamedModel(folder, skeleton=skeleton(folder), index=index)
    return StreamedModel(folder)


def stream_folder(spec: str, stream: str = "auto") -> Path | None:
    """The one route decision of layer streaming: the local folder to stream model
    ``spec`` from, or ``None`` to load it whole. ``stream``: ``on`` (refused for a model
    without a local safetensors folder of a streamable family), ``off``, or ``auto``
    (stream a folder whose stored weights exceed :data:`STREAM_ABOVE_BYTES`).

    Raises:
        ValueError: ``stream`` not one of the three; ``on`` for a model that cannot
            stream (named, with the reason).
    """
    from structlm.hf.builtin_models import BUILTIN_MODELS, builtin_folder
    from structlm.hf.loading import FOLDER_FORMATS

    if stream not in ("auto", "on", "off"):
        raise ValueError(f"stream must be auto, on or off, got {stream!r}")
    if stream == "off":
        return None
    folder = builtin_folder(spec) if spec.lower() in BUILTIN_MODELS else Path(spec)
    why = ""
    registered = folder.is_dir() and any((folder / m).is_file() for m in STREAMED_FORMATS)
    if not folder.is_dir():
        why = "not a local folder (a hub id loads whole)"
    elif not registered and any((folder / m).is_file() for m in FOLDER_FORMATS):
        why = ("a single-file structlm compressed folder (its factorised layers load whole; "
               "share compress --stream on writes one that streams)")
    elif not registered and not (folder / _INDEX).is_file() and \
            not any(folder.glob("*.safetensors")):
        why = "no safetensors weights"
    else:
        model_type = json.loads((folder / "config.json").read_text()).get("model_type") \
            if (folder / "config.json").is_file() else None
        if model_type not in PLAIN_HEAD_TYPES:
            why = (f"model_type {model_type!r} is not one of the plain-head families "
                   f"{PLAIN_HEAD_TYPES}")
    if why:
        if stream == "on":
            raise ValueError(f"model {spec!r} cannot be streamed layer by layer: {why}")
        return None
    size = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    return folder if stream == "on" or size > STREAM_ABOVE_BYTES else None


class WeightFolder:
    """The tensors of a Hugging Face folder's safetensors files, read by name.

    ``index``: the index file naming each tensor's file (``model.safetensors.index.json``
    by default; without one, every ``*.safetensors`` file of the folder). An index may
    also map ``"aliases"``: a name → the name its tensor is stored under (a tensor shared
    by several modules is stored once)."""

    def __init__(self, folder: str | Path, index: str = _INDEX) -> None:
        from safetensors import safe_open

        self.folder = Path(folder)
        self.aliases: dict[str, str] = {}
        if (self.folder / index).is_file():
            record = json.loads((self.folder / index).read_text())
            self.file_of: dict[str, str] = record["weight_map"]
            self.aliases = record.get("aliases", {})
        else:
            self.file_of = {}
            for f in sorted(self.folder.glob("*.safetensors")):
                with safe_open(str(f), framework="pt") as fh:
                    self.file_of.update(dict.fromkeys(fh.keys(), f.name))
        if not self.file_of:
            raise ValueError(f"{self.folder} holds no safetensors weights (neither {_INDEX} "
                             "nor *.safetensors files)")

    def __contains__(self, name: object) -> bool:
        return name in self.file_of or name in self.aliases

    def read(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        """The named tensors, read from their files into new tensors (which are closed
        again); an alias and the name it stands for give one tensor."""
        from structlm.tensor_files import read_safetensors

        by_file: dict[str, list[str]] = {}
        wanted = list(names)
        for n in wanted:
            stored = self.aliases.get(n, n)
            if stored not in self.file_of:
                raise KeyError(f"{self.folder} has no tensor {n!r}")
            by_file.setdefault(self.file_of[stored], []).append(stored)
        out: dict[str, torch.Tensor] = {}
        for f, ns in by_file.items():  # plain reads: no mapped pages beside the copy
            out.update(read_safetensors(self.folder / f, dict.fromkeys(ns)))
        return {n: out[self.aliases.get(n, n)] for n in wanted}


@dataclass
class LayerInputs:
    """One batch as the decoder layers see it."""

    hidden: torch.Tensor
    """The current layer's input ``(b, T, d)``."""
    calls: list[tuple[tuple[Any, ...], dict[str, Any]]]
    """Per layer: the other positional and keyword arguments the model's forward gave it."""


class StreamedModel:
    """The model in ``folder`` with its weights on disk (module docstring).

    ``model`` is the real architecture (``AutoModelForCausalLM.from_config``); its decoder
    layers, input embedding and output head live on ``meta`` outside
    :meth:`resident`; the other modules (final norm, rotary tables) are small and stay
    resident."""

    def __init__(self, folder: str | Path, dtype: torch.dtype = torch.float32,
                 skeleton: nn.Module | None = None, index: str = _INDEX) -> None:
        """``skeleton``: the model to stream, built by the caller with parameters not yet
        read (a compressed folder's architecture with its factorised modules); default
        the folder's architecture (``AutoModelForCausalLM.from_config``). ``index``: the
        weights index in ``folder`` (:class:`WeightFolder`)."""
        from accelerate import init_empty_weights
        from transformers import AutoConfig, AutoModelForCausalLM

        import structlm.models  # noqa: F401  (registers model_type "structlm")

        self.folder = Path(folder)
        self.weights = WeightFolder(folder, index)
        self.dtype = dtype
        if skeleton is None:
            # parameters on meta from the start (buffers real): nothing allocated, so
            # no freed model-sized hole is left in a retaining heap (cpu_malloc)
            with init_empty_weights(include_buffers=False):
                skeleton = AutoModelForCausalLM.from_config(
                    AutoConfig.from_pretrained(str(folder)), dtype=dtype)
        model = skeleton
        model.eval()
        self.model = model
        self.adapter = get_adapter(model)
        self.blocks = [layer.block for layer in self.adapter.layers]
        self._names = {id(m): n for n, m in model.named_modules()}
        self.embedding = model.get_input_embeddings()
        self.head = model.get_output_embeddings()
        streamed = [*self.blocks, self.embedding] + ([self.head] if self.head else [])
        self._buffers: dict[int, dict[str, torch.Tensor]] = {}
        for m in streamed:  # non-persistent buffers are computed, not stored: keep them
            stored = set(m.state_dict())
            self._buffers[id(m)] = {n: b.clone() for n, b in m.named_buffers()
                                    if n not in stored}
            m.to("meta")
        rest = {n for n in model.state_dict() if not any(
            n.startswith(self.name_prefix(m)) for m in streamed)}
        model.load_state_dict(self._read(rest), strict=False, assign=True)
        for n, p in model.named_parameters():
            if p.is_meta and n in rest:
                raise AssertionError(f"{n}: not read from {self.folder}")
            if not p.is_meta and n not in rest:
                raise AssertionError(f"{n}: left allocated outside the streamed modules")

    @property
    def num_layers(self) -> int:
        return len(self.blocks)

    def name_prefix(self, module: nn.Module) -> str:
        """``module``'s name in the model and a dot (its tensors' prefix)."""
        return self._names[id(module)] + "."

    def _read(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        out = self.weights.read(names)
        return {n: t.to(self.dtype) if t.is_floating_point() else t for n, t in out.items()}

    def _stored_name(self, name: str) -> str:
        """``name``'s tensor in the folder: a tied head reads the embedding's."""
        if name in self.weights or self.head is None or \
                not name.startswith(self.name_prefix(self.head)):
            return name
        tied = getattr(self.model.config, "tie_word_embeddings", False)
        return self.name_prefix(self.embedding) + "weight" if tied else name

    @contextmanager
    def resident(self, module: nn.Module) -> Iterator[nn.Module]:
        """``module`` (a decoder layer, the embedding or the head) with its weights read
        from the folder for the block, back on ``meta`` after it."""
        prefix = self.name_prefix(module)
        keys = list(module.state_dict())
        names = {k: self._stored_name(prefix + k) for k in keys}
        values = self._read(names.values())
        module.load_state_dict({k: values[n] for k, n in names.items()}, strict=True,
                               assign=True)
        for n, b in self._buffers.get(id(module), {}).items():
            owner, _, attr = n.rpartition(".")
            module.get_submodule(owner).register_buffer(attr, b.clone(), persistent=False)
        del values
        try:
            yield module
        finally:
            module.to("meta")
            release_freed_memory()  # the retained heap must not keep every layer read

    def weight(self, i: int, t: MatrixType) -> torch.Tensor:
        """Layer ``i``'s matrix of type ``t`` (``(out, in)``, the float32 copy
        ``adapter.layers[i].weight(t)`` gives), read from the folder with only the
        modules that compute it resident."""
        layer = self.adapter.layers[i]
        modules = [s.module for s in layer.linear_sites() if t in s.types]
        if not modules:
            raise ValueError(f"layer {i} has no module computing {t.value}")
        with ExitStack() as stack:
            for m in modules:
                stack.enter_context(self.resident(m))
            return layer.weight(t)

    def type_weights(self, t: MatrixType, layers: Iterable[int] | None = None
                     ) -> StreamedWeights:
        """Matrices of type ``t`` by layer (all by default), each read when indexed."""
        return StreamedWeights(self, t, range(self.num_layers) if layers is None
                               else layers)

    @torch.no_grad()
    def capture(self, batches: Iterable[torch.Tensor]) -> list[LayerInputs]:
        """Embed every batch of ids ``(b, T)`` and record each layer's other arguments,
        running the model's own forward up to its first layer (the layers themselves
        are not run: each records its call and passes its input on)."""
        out: list[LayerInputs] = []
        with self.resident(self.embedding), self._recording() as record:
            for ids in batches:
                record.clear()
                run_until_stopped(self.model, input_ids=ids, use_cache=False)
                first = record[0]
                out.append(LayerInputs(first[0], [(a, k) for _, a, k in record]))
        return out

    @contextmanager
    def _recording(self) -> Iterator[list[tuple[torch.Tensor, tuple[Any, ...],
                                                dict[str, Any]]]]:
        record: list[tuple[torch.Tensor, tuple[Any, ...], dict[str, Any]]] = []
        last = len(self.blocks) - 1

        def recorder(i: int) -> Any:
            def forward(*args: Any, **kwargs: Any) -> Any:
                hidden = args[0] if args else kwargs.pop("hidden_states")
                record.append((hidden, args[1:], kwargs))
                if i == last:
                    raise StopForward
                return hidden
            return forward

        for i, block in enumerate(self.blocks):
            block.forward = recorder(i)  # the instance's: the class's is untouched
        try:
            yield record
        finally:
            for block in self.blocks:
                del block.forward

    @torch.no_grad()
    def run_layer(self, i: int, inputs: list[LayerInputs], progress: bool = False) -> None:
        """Carry every batch's hidden states through layer ``i`` (in place)."""
        with self.resident(self.blocks[i]) as block:
            for b in tqdm(inputs, desc=f"layer {i}", unit="batch", disable=not progress,
                          leave=False):
                args, kwargs = b.calls[i]
                y = block(b.hidden, *args, **kwargs)
                b.hidden = y if isinstance(y, torch.Tensor) else y[0]

    def final_norm(self) -> nn.Module:
        """The norm after the last layer (a plain-head family's ``model.norm``)."""
        body = getattr(self.model, "model", None)
        norm = getattr(body, "norm", None)
        if plain_head(self.model) is None or norm is None:
            raise ValueError(f"layer streaming scores only the plain-head families (LLaMA, "
                             f"Qwen2, Mistral), not model_type "
                             f"{getattr(self.model.config, 'model_type', '?')!r}")
        return norm


class StreamedWeights(Mapping[int, torch.Tensor]):
    """One matrix type's weights by layer index, in layer order, each read from the
    folder when indexed (:meth:`StreamedModel.weight`): what
    ``{i: adapter.layers[i].weight(t)}`` holds for a model in memory, without holding
    every layer (28 of a 1.5B model's MLP-in are 3.1 GB in float32)."""

    def __init__(self, stream: StreamedModel, t: MatrixType, layers: Iterable[int]) -> None:
        self.stream, self.t, self.layers = stream, t, list(layers)
        bad = [i for i in self.layers if not 0 <= i < stream.num_layers]
        if bad:
            raise ValueError(f"layers {bad} out of range [0, {stream.num_layers})")

    def __getitem__(self, i: int) -> torch.Tensor:
        if i not in self.layers:
            raise KeyError(i)
        return self.stream.weight(i, self.t)

    def __iter__(self) -> Iterator[int]:
        return iter(self.layers)

    def __len__(self) -> int:
        return len(self.layers)


@returning_freed_memory()
@torch.no_grad()
def streamed_perplexity(stream: StreamedModel, rows: torch.Tensor, batch_size: int = 4,
                        progress: bool = True, bos_token: int | None = None
                        ) -> PerplexityResult:
    """Perplexity of the streamed model on windows ``rows`` ``(n, w)``, each scored on its
    own (tokens 1..w-1): the protocol of :func:`structlm.hf.perplexity.perplexity` for
    windows (same per-window float64 sums and windows fingerprint), computed layer by
    layer. Raises :class:`~structlm.hf.perplexity.NonFiniteLogitsError` on a non-finite
    logit."""
    n, w = rows.shape
    if n < 1 or w < 2:
        raise ValueError(f"windows must be (n >= 1, w >= 2), got {tuple(rows.shape)}")
    norm = stream.final_norm()
    batches = [rows[i:i + batch_size] for i in range(0, n, batch_size)]
    inputs = stream.capture(batches)
    for i in tqdm(range(stream.num_layers), desc="perplexity (layers)", unit="layer",
                  disable=not progress):
        stream.run_layer(i, inputs)
    nlls: list[float] = []
    with stream.resident(stream.head) as head:
        for k, (ids, b) in enumerate(zip(batches, inputs, strict=True)):
            hidden = norm(b.hidden)[:, :-1]  # (b, w-1, d)
            logp = chunked_head_logprobs(head, hidden, ids[:, 1:],
                                     f"windows {k * batch_size}..{k * batch_size + len(ids) - 1}")
            nlls += (-logp.double().sum(1)).tolist()  # (b,): one sum per window
            b.hidden = torch.empty(0)
    toks = [w - 1] * n
    nll = math.fsum(nlls) / sum(toks)
    leading = leading_bos(stream.model, rows, bos_token)
    return PerplexityResult(math.exp(nll), nll, sum(toks), n, w, w - 1, leading is not None,
                            nlls, toks, scored_windows_key(rows.cpu(), None), leading)

