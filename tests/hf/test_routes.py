"""``explain_routes`` / ``structlm routes``: which path every layer takes, by module."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")

from structlm import AlgebraConfig, convert_, explain_routes
from structlm.cli import main
from structlm.hf.routes import format_routes
from structlm.ops import cpu_kernels
from tiny_models import tiny_llama, tiny_structlm


@pytest.mark.skipif(not cpu_kernels.fused_rows_available(), reason="no C++ compiler")
def test_structlm_model_routes_by_phase_and_module() -> None:
    model = tiny_structlm(algebra="Q2^2").eval()
    rows = explain_routes(model, batch=1, tokens=8, decode_steps=2)
    phases = [r.phase for r in rows]
    assert phases[0] == "prefill" and "decode 1" in phases and "decode 2" in phases
    decode = [r for r in rows if r.phase == "decode 1"]
    assert [(r.module, r.route) for r in decode if r.call == "decode step"] == [
        ("transformer", "decode-stack")]  # every block in one call
    assert not any(r.call == "algebra" for r in decode)  # plan checks are not recorded
    prefill = {(r.module, r.call): r.route for r in rows if r.phase == "prefill"}
    assert prefill[("transformer", "decode step")] == "modules"
    assert prefill[("transformer.h.0.mlp.gate", "algebra")] == "fused-rows"
    table = format_routes(rows)
    assert table.splitlines()[0].startswith("| phase | module |") and "decode-stack" in table


def test_converted_hf_model_routes() -> None:
    model = convert_(tiny_llama(seed=1), AlgebraConfig("Q4", targets="mlp")).eval()
    with torch.no_grad():
        rows = explain_routes(model, batch=2, tokens=5, decode_steps=1)
    mlp = {r.route for r in rows if r.module.endswith("mlp.down_proj")}
    assert mlp and all(r.reason for r in rows)
    # every decision is attributed to the module that made it, never to the model itself
    assert all(r.module and r.module != "(model)" for r in rows)
    with pytest.raises(ValueError, match="batch must be a positive integer, got 0"):
        explain_routes(model, batch=0)


def test_routes_cli_json(tmp_path, capsys) -> None:
    folder = tmp_path / "tiny"
    tiny_llama(seed=2).save_pretrained(folder)
    assert main(["routes", str(folder), "--convert", "Q2^2", "--tokens", "6", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert {"phase", "module", "call", "rows", "route", "reason"} <= set(rows[0])
    assert any(r["module"].endswith("mlp.gate_proj") for r in rows)
