"""Checks shared by the LM tests (on the path via ``pythonpath = ["tests"]``)."""

from __future__ import annotations

import torch


def assert_left_padding_matches_alone(model: torch.nn.Module) -> None:
    """Greedy ``generate`` on a left-padded batch of two prompts gives each row the logits
    the prompt gets alone: types follow absolute positions, not cache slots."""
    long, short = torch.randint(1, 512, (9,)), torch.randint(1, 512, (4,))
    batch, mask = torch.zeros(2, 9, dtype=torch.long), torch.zeros(2, 9, dtype=torch.long)
    batch[0], mask[0] = long, 1
    batch[1, 5:], mask[1, 5:] = short, 1
    kw = dict(max_new_tokens=6, do_sample=False, return_dict_in_generate=True,
              output_logits=True, pad_token_id=0)
    both = model.generate(batch, attention_mask=mask, **kw)
    for row, prompt in ((0, long), (1, short)):
        alone = model.generate(prompt[None], attention_mask=torch.ones(1, len(prompt),
                                                                       dtype=torch.long), **kw)
        torch.testing.assert_close(torch.stack(both.logits, 1)[row],
                                   torch.stack(alone.logits, 1)[0], rtol=1e-4, atol=1e-4)
