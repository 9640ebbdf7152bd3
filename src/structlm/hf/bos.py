"""One BOS decision per model, used by every way of scoring text.

A model is scored as it reads text: a tokenizer that puts its BOS token before every
input (Gemma's, LLaMA-2's) trained a model that expects it, and a window without it
scores several times worse; a tokenizer that puts none (SmolLM2's, GPT-2's, Qwen's) gets
none. :func:`decide_bos` makes that decision once, from the tokenizer's own convention
(:func:`structlm.hf.text.window_prefix`) and the user's flag:

* no flag (``requested=None``): BOS in front of every window exactly when the convention
  puts it there;
* ``--bos`` (``True``): BOS in front of every window (once: where the convention already
  puts it, nothing changes); refused when the tokenizer has no BOS token;
* ``--no-bos`` (``False``): no BOS, **honoured with a warning** where the convention puts
  one (the perplexity is then not the one the model is used at; the record says so).

Every sampling mode applies the same decision: windows drawn across documents start with
:meth:`BosDecision.prefix` (window length unchanged), a token stream (``--sampling head``)
gets :attr:`BosDecision.bos_id` put in front of every window by
:func:`structlm.hf.perplexity.perplexity`. Each perplexity record states whether BOS was
the first input of every scored window, and which id, from the ids actually scored.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from structlm.hf.text import window_prefix

__all__ = ["BosDecision", "decide_bos"]


@dataclass(frozen=True)
class BosDecision:
    """Whether BOS goes in front of every scored window, and why."""

    bos_id: int | None
    """The id put first in every scored window; ``None``: no BOS."""
    convention: bool
    """Whether the tokenizer's own convention puts BOS before every input."""
    requested: bool | None
    """The user's flag: ``True`` (``--bos``), ``False`` (``--no-bos``), ``None`` (none)."""
    reason: str
    """One sentence: what was decided and why (for the record)."""
    warning: str = ""
    """Non-empty when the decision departs from the model's convention."""
    tokenizer_prefix: list[int] = field(default_factory=list)
    """What the tokenizer puts before every input (:func:`window_prefix`)."""

    @property
    def applied(self) -> bool:
        """Whether every scored window starts with BOS."""
        return self.bos_id is not None

    def prefix(self) -> list[int]:
        """The ids every window drawn across documents starts with: the tokenizer's
        prefix with BOS first exactly when the decision applies it."""
        rest = self.tokenizer_prefix[1:] if self.convention else list(self.tokenizer_prefix)
        return ([self.bos_id] if self.bos_id is not None else []) + rest

    def as_dict(self) -> dict[str, Any]:
        """The decision as recorded beside a perplexity."""
        return {"bos_id": self.bos_id, "convention": self.convention,
                "requested": self.requested, "reason": self.reason,
                **({"warning": self.warning} if self.warning else {})}


def decide_bos(tokenizer: Any, requested: bool | None = None, model: str = "the model",
               flag: str = "--bos") -> BosDecision:
    """The BOS decision for a model read through ``tokenizer`` (module docstring).

    ``requested``: the user's flag (``None``: not given); ``model`` names the model in
    messages; ``flag`` is the option that asked for BOS.

    Raises:
        ValueError: ``requested`` is True and the tokenizer has no BOS token, or
            ``requested`` is not a bool or None.
    """
    if requested is not None and not isinstance(requested, bool):
        raise ValueError(f"requested must be True, False or None, got {requested!r}")
    prefix = window_prefix(tokenizer)
    bos = getattr(tokenizer, "bos_token_id", None) if tokenizer is not None else None
    bos = None if bos is None else int(bos)
    convention = bos is not None and prefix[:1] == [bos]
    if requested is None:
        reason = (f"BOS {bos} in front of every window: the tokenizer of {model} puts it "
                  "before every input" if convention else
                  f"no BOS: the tokenizer of {model} puts none before its inputs")
        return BosDecision(bos if convention else None, convention, None, reason,
                           tokenizer_prefix=prefix)
    if requested:
        if bos is None:
            raise ValueError(f"{flag}: the tokenizer of {model} has no BOS token "
                             "(bos_token is not set): leave out the flag")
        reason = (f"BOS {bos} in front of every window ({flag}; the tokenizer of {model} "
                  "puts it there too)" if convention else
                  f"BOS {bos} in front of every window, as {flag} asks (the tokenizer of "
                  f"{model} puts none before its inputs)")
        return BosDecision(bos, convention, True, reason, tokenizer_prefix=prefix)
    if not convention:
        return BosDecision(None, False, False, f"no BOS, as asked (the tokenizer of {model} "
                           "puts none before its inputs either)", tokenizer_prefix=prefix)
    negative = "--no-" + flag[2:] if flag.startswith("--") else f"{flag}=False"
    reason = (f"no BOS, as {negative} asks, although the tokenizer of {model} puts BOS "
              f"{bos} before every input")
    warning = (f"{reason}: the model is scored on text as it never reads it, and the "
               "perplexity is not comparable with one scored with BOS (usually much higher)")
    return BosDecision(None, True, False, reason, warning, prefix)
