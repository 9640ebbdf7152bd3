"""llama.cpp as a peer arm of the generation benchmark: what CPU users run instead.

A built-in model's original GGUF (:func:`structlm.hf.loading.builtin_gguf`, 4-bit) is
re-quantised once with ``llama_cpp.llama_model_quantize`` (``allow_requantize``) to

* ``f32`` — exactly the de-quantised weights ``load_model`` gives the dense arm, so
  llama.cpp computes the same function (the benchmark checks that its greedy tokens equal
  the dense arm's and reports how many agree);
* ``q8_0`` / ``f16`` — for context: what CPU users run, not the same function.

The files are cached under ``$STRUCTLM_CACHE/gguf`` keyed on the source file's content
(sha256) and the llama.cpp version, written atomically. ``llama-cpp-python`` is an
optional extra (``pip install -e ".[peers]"``, it builds llama.cpp from source, ~3 min on
2 cores): without it the benchmark skips these arms and says so.

:class:`LlamaCppLM` wraps a loaded file with the slice of the ``transformers``
``generate`` API the benchmark calls (batch 1, greedy or the paper's sampling), so the
peer runs in the same timed loop, interleaved with the other arms.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import torch

from structlm.atomic import atomic_path
from structlm.settings import cache_dir

__all__ = ["LLAMACPP_VARIANTS", "PEER_ARMS", "LlamaCppLM", "gguf_variant", "greedy_agreement",
           "llama_cpp_available", "peer_arms", "require_llama_cpp"]

LLAMACPP_VARIANTS = {"f32": "LLAMA_FTYPE_ALL_F32", "f16": "LLAMA_FTYPE_MOSTLY_F16",
                     "q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0"}
"""Variant name -> the ``llama_ftype`` constant it is quantised to."""

PEER_ARMS = tuple(f"llamacpp-{variant}" for variant in LLAMACPP_VARIANTS)
"""The benchmarks' names of the llama.cpp arms (``peers`` of ``bench generate`` and
``bench share``)."""

_INSTALL = 'pip install -e ".[peers]" (or: pip install llama-cpp-python)'


def llama_cpp_available() -> bool:
    """Whether ``llama-cpp-python`` is installed (importable without importing it)."""
    return importlib.util.find_spec("llama_cpp") is not None


def require_llama_cpp() -> ModuleType:
    """The ``llama_cpp`` module.

    Raises:
        RuntimeError: it is not installed, with the command that installs it.
    """
    if not llama_cpp_available():
        raise RuntimeError(f"the llama.cpp arm needs llama-cpp-python: {_INSTALL}")
    import llama_cpp

    return llama_cpp


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 24), b""):
            digest.update(chunk)
    return digest.hexdigest()


def gguf_variant(source: Path, variant: str, threads: int = 2) -> Path:
    """``source`` re-quantised to ``variant`` (a key of :data:`LLAMACPP_VARIANTS`), made
    once and cached by content.

    Raises:
        ValueError: an unknown variant or a missing source file.
        RuntimeError: llama.cpp is absent or its quantiser fails.
    """
    if variant not in LLAMACPP_VARIANTS:
        raise ValueError(f"llama.cpp variant {variant!r}: expected one of "
                         f"{sorted(LLAMACPP_VARIANTS)}")
    source = Path(source)
    if not source.is_file():
        raise ValueError(f"GGUF source {str(source)!r} is not a file")
    llama_cpp = require_llama_cpp()
    key = hashlib.sha256(f"{_file_sha256(source)}|{llama_cpp.__version__}".encode())
    dest = cache_dir("gguf") / f"{source.stem}-{key.hexdigest()[:16]}-{variant}.gguf"
    if dest.exists():
        return dest
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, LLAMACPP_VARIANTS[variant])
    params.allow_requantize = True
    params.nthread = threads
    print(f"re-quantising {source.name} to {variant} for llama.cpp (once: cached as {dest})")
    with atomic_path(dest, ".gguf") as tmp:
        with _native_stderr_silenced():  # the quantiser logs every tensor
            rc = llama_cpp.llama_model_quantize(str(source).encode(), str(tmp).encode(),
                                                params)
        if rc != 0:
            raise RuntimeError(f"llama_model_quantize({source.name} -> {variant}) failed with "
                               f"code {rc}")
    return dest


@contextlib.contextmanager
def _native_stderr_silenced() -> Iterator[None]:
    """File descriptor 2 sent to ``/dev/null`` inside (native code's logging)."""
    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


@contextlib.contextmanager
def _extra_buffer_types(enabled: bool) -> Iterator[None]:
    """Models loaded inside get ``use_extra_bufts = enabled``: llama.cpp's weight repacking
    (AMX / interleaved layouts of quantised weights on the CPU). ``llama_cpp.Llama`` takes
    no argument for it, so its default-parameters function is wrapped while it loads.

    Off by default: on CPUs that report AMX-INT8 (this VM's Xeon) the AMX matmul of a q8_0
    model segfaults in llama.cpp 0.3.36 (ggml-org/llama.cpp#20824); ``f32`` weights are
    never repacked, so the switch changes nothing for the same-function arm."""
    import llama_cpp.llama as llama_module

    lib = llama_module.llama_cpp
    default = lib.llama_model_default_params

    def params() -> Any:
        p = default()
        p.use_extra_bufts = enabled
        return p

    lib.llama_model_default_params = params
    try:
        yield
    finally:
        lib.llama_model_default_params = default


class LlamaCppLM:
    """A GGUF file on llama.cpp behind the part of ``generate`` the benchmark uses.

    Args:
        path: the GGUF file.
        label: the arm's name in reports (e.g. ``llama.cpp f32``).
        threads: llama.cpp threads (decode and prompt).
        n_ctx: context length (prompt + new tokens must fit).
        repack: llama.cpp's extra buffer types (weight repacking, AMX); see
            :func:`_extra_buffer_types` for why it is off by default.
    """

    def __init__(self, path: Path, label: str, threads: int, n_ctx: int = 2048,
                 repack: bool = False) -> None:
        llama_cpp = require_llama_cpp()
        self.label, self.path, self.n_ctx, self.repack = label, Path(path), n_ctx, repack
        with _extra_buffer_types(repack):
            self.llm = llama_cpp.Llama(model_path=str(path), n_ctx=n_ctx,
                                       n_batch=min(n_ctx, 512), n_threads=threads,
                                       n_threads_batch=threads, verbose=False)
        self.config = SimpleNamespace(algebra="dense")  # what the report's column reads

    def _prompt(self, input_ids: torch.Tensor, new_tokens: int) -> list[int]:
        """The ids of a ``(1, T)`` prompt, refused unless it is one sequence that fits the
        context with ``new_tokens`` more."""
        if input_ids.ndim != 2 or input_ids.shape[0] != 1:
            raise ValueError(f"the llama.cpp arm decodes one sequence, got input_ids of "
                             f"shape {tuple(input_ids.shape)}")
        prompt = [int(t) for t in input_ids[0]]
        if len(prompt) + new_tokens > self.n_ctx:
            raise ValueError(f"{len(prompt)} prompt + {new_tokens} new tokens exceed the "
                             f"llama.cpp context of {self.n_ctx}")
        return prompt

    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
                 max_new_tokens: int, do_sample: bool = False, eos_token_id: Any = "model",
                 pad_token_id: Any = None, temperature: float = 1.0, top_p: float = 1.0,
                 top_k: int = 50) -> torch.Tensor:
        """``input_ids`` ``(1, T)`` followed by the new ids: ``(1, T + n)``.

        Greedy (``do_sample=False``) or top-k / top-p / temperature sampling seeded from
        torch's generator (the benchmark seeds it per prompt). ``eos_token_id=None``: no
        token stops generation (the fixed mode); otherwise the model's EOS stops it after
        being emitted, as in ``transformers``. The prompt is always evaluated from scratch
        (llama.cpp's prompt-prefix reuse would skip the prefill the other arms pay).
        """
        del attention_mask, pad_token_id  # batch 1, no padding
        prompt = self._prompt(input_ids, max_new_tokens)
        stop = self.llm.token_eos() if eos_token_id == "model" else eos_token_id
        stops = set(stop) if isinstance(stop, (list, tuple)) else {stop} - {None}
        if do_sample:
            self.llm.set_seed(int(torch.randint(0, 2**31 - 1, ()).item()))
            kw = dict(temp=temperature, top_p=top_p, top_k=top_k, min_p=0.0)
        else:
            kw = dict(temp=0.0)
        self.llm.reset()  # no prefix reuse: the prompt is evaluated again
        new: list[int] = []
        for token in self.llm.generate(prompt, repeat_penalty=1.0, **kw):
            new.append(int(token))
            if len(new) >= max_new_tokens or token in stops:
                break
        return torch.tensor([prompt + new], dtype=torch.long)

    def timed_greedy_steps(self, input_ids: torch.Tensor, steps: int
                           ) -> tuple[float, list[int]]:
        """Seconds of ``steps`` greedy decode steps after an untimed prompt evaluation of
        ``input_ids`` ``(1, T)``, and the ``steps`` new tokens: the decode loop of
        ``bench share`` (each step: the argmax of the last logits, then one token
        evaluated; no sampler, as the other arms' greedy steps)."""
        prompt = self._prompt(input_ids, steps)
        import numpy as np

        llama_cpp, llm = require_llama_cpp(), self.llm
        vocab = llm.n_vocab()

        def last_logits() -> np.ndarray:  # (vocab,): the last evaluated token's
            return np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1),
                                         shape=(vocab,))

        llm.reset()
        llm.eval(prompt)  # the prefill, untimed
        new: list[int] = []
        t0 = time.perf_counter()
        for _ in range(steps):
            token = int(last_logits().argmax())
            new.append(token)
            llm.eval([token])
        return time.perf_counter() - t0, new

    def close(self) -> None:
        """Free llama.cpp's model and context."""
        self.llm.close()


def greedy_agreement(reference: Any, peer: Any, tokenizer: Any, prompt: str,
                     new_tokens: int) -> tuple[int, int]:
    """How many of the first ``new_tokens`` greedy tokens ``peer`` produces equal the
    ``reference`` model's, counting up to the first difference: ``(equal, new_tokens)``."""
    ids = tokenizer(prompt, return_tensors="pt")
    kw = dict(max_new_tokens=new_tokens, do_sample=False, eos_token_id=None,
              pad_token_id=tokenizer.eos_token_id)
    with torch.no_grad():
        ref = reference.generate(**ids, **kw)[0, ids["input_ids"].shape[1]:].tolist()
    got = peer.generate(**ids, **kw)[0, ids["input_ids"].shape[1]:].tolist()
    equal = 0
    for a, b in zip(ref, got, strict=False):
        if a != b:
            break
        equal += 1
    return equal, new_tokens


def peer_arms(model: str, variants: tuple[str, ...], threads: int, n_ctx: int,
              reference: Any, tokenizer: Any, check_prompt: str | None, check_tokens: int,
              reference_name: str = "the dense arm"
              ) -> tuple[dict[str, LlamaCppLM], dict[str, str], list[str]]:
    """The llama.cpp arms ``variants`` (``f32``, ``q8_0``, ...) of built-in ``model``.

    Returns the arms by report name (``llama.cpp f32``), for each the greedy agreement
    with ``reference`` on ``check_prompt`` (``"128/128"``: equal new tokens up to the first
    difference, of ``check_tokens``; ``check_prompt=None``: no check here, the caller
    checks), and notes for the report — with llama.cpp absent, no arms and a note saying
    how to install it. An arm that fails to build closes the ones built before it.
    """
    if not variants:
        return {}, {}, []
    if not llama_cpp_available():
        note = (f"llama.cpp arms {list(variants)} skipped: llama-cpp-python is not installed "
                f"({_INSTALL})")
        print(note)
        return {}, {}, [note]
    from structlm.hf.loading import builtin_gguf

    source = builtin_gguf(model)
    arms: dict[str, LlamaCppLM] = {}
    agreement: dict[str, str] = {}
    llama_cpp = require_llama_cpp()
    notes = [f"llama.cpp: llama-cpp-python {llama_cpp.__version__}, {threads} threads, the "
             f"GGUF {source.name} re-quantised to each variant (allow_requantize); weight "
             "repacking (extra buffer types, AMX) off: its AMX q8_0 matmul segfaults on "
             "AMX-INT8 CPUs in this version (ggml-org/llama.cpp#20824)"]
    try:
        for variant in variants:
            arm = LlamaCppLM(gguf_variant(source, variant, threads), f"llama.cpp {variant}",
                             threads, n_ctx)
            arms[arm.label] = arm
            same = ("the same weights" if variant == "f32" else
                    f"{variant} weights, not the same function")
            if check_prompt is None:
                notes.append(f"{arm.label}: {same}")
                continue
            equal, total = greedy_agreement(reference, arm, tokenizer, check_prompt,
                                            check_tokens)
            agreement[arm.label] = f"{equal}/{total}"
            notes.append(f"{arm.label} ({same}): {equal} of the first {total} greedy tokens "
                         f"equal {reference_name}'s on the first prompt")
    except BaseException:
        for built in arms.values():
            built.close()
        raise
    return arms, agreement, notes
