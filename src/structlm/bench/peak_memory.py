"""Resident memory of serving a model, measured in a fresh process per model.

One child process per (model, batch) loads the model (the source model by name, or a
folder written by ``structlm share compress``) and runs the benchmark's loop — one prefill
of ``(batch, prompt_len)`` token ids with the KV cache, then ``decode_tokens`` greedy
cached steps. It reports, from ``/proc/self/status``: the resident set after loading,
the peak resident set over loading and running (``VmHWM``: what the machine must have
free), and at the end the resident set split into anonymous memory and file-backed pages
(safetensors weights are memory-mapped: the original model's parameters sit in the page
cache, reclaimable and shared between processes, while factors built in memory are
anonymous). A child of its own means the figures are not the allocator reusing memory
another model's run freed, which an in-process high-water mark mostly sees.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from typing import Any

__all__ = ["measure_peak_memory", "peak_memory_of_run"]


def _status_kib(key: str) -> int:
    with open("/proc/self/status") as fh:
        m = re.search(rf"^{key}:\s+(\d+) kB", fh.read(), re.MULTILINE)
    if m is None:
        raise RuntimeError(f"/proc/self/status has no {key} (peak memory needs Linux)")
    return int(m.group(1))


def peak_memory_of_run(source: str, compressed: str, batch: int, prompt_len: int,
                       decode_tokens: int, threads: int, seed: int = 0) -> dict[str, int]:
    """In *this* process: load, run, read the resident figures (bytes). Call it in a
    fresh process (:func:`measure_peak_memory` does)."""
    import gc

    import torch

    from structlm.bench.greedy import greedy_decode
    from structlm.hf.loading import load_model
    from structlm.share.compress import load_compressed

    torch.set_num_threads(threads)
    model = (load_compressed(compressed) if compressed else load_model(source)).model.eval()
    vocab = int(model.get_input_embeddings().weight.shape[0])
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, prompt_len), generator=gen)  # (B, T)
    gc.collect()
    loaded_kib = _status_kib("VmRSS")
    greedy_decode(model, ids, decode_tokens)
    return {"resident_after_load": loaded_kib * 1024,
            "peak_load_and_run": _status_kib("VmHWM") * 1024,
            "anonymous_after_run": _status_kib("RssAnon") * 1024,
            "file_backed_after_run": _status_kib("RssFile") * 1024}


def measure_peak_memory(source: str, compressed: str, batch: int, prompt_len: int,
                        decode_tokens: int, threads: int, seed: int = 0,
                        timeout: float = 1800.0) -> dict[str, int]:
    """:func:`peak_memory_of_run` in a fresh Python process (``compressed`` = "" for the
    source model itself)."""
    cmd = [sys.executable, "-m", "structlm.bench.peak_memory", "--source", source,
           "--compressed", compressed, "--batch", str(batch), "--prompt-len", str(prompt_len),
           "--decode-tokens", str(decode_tokens), "--threads", str(threads),
           "--seed", str(seed)]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if res.returncode != 0:
        raise RuntimeError(f"peak-memory child failed ({' '.join(cmd)}):\n{res.stderr[-2000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--source", required=True)
    p.add_argument("--compressed", default="")
    p.add_argument("--batch", type=int, required=True)
    p.add_argument("--prompt-len", type=int, required=True)
    p.add_argument("--decode-tokens", type=int, required=True)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    out: dict[str, Any] = peak_memory_of_run(a.source, a.compressed, a.batch, a.prompt_len,
                                             a.decode_tokens, a.threads, a.seed)
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
