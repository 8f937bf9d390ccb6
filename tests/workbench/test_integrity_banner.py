"""The dashboard's integrity banner (issue 41 section 1): red with the first fault's layer and position when
a recording's health checks found one, hidden on a clean recording; the questions' Q8 says the same."""

from __future__ import annotations

import pytest
import torch

import workbench
from apps.dashboard.components.integrity_banner import IntegrityBanner
from apps.dashboard.follower import DashboardState
from apps.dashboard.views import view_reducers
from engine import load_model
from engine.errors import NumericsError
from engine.session import Session
from engine.tokenizer import Tokenizer
from workbench.questions import integrity_health


def recorded(path, model, fault: bool):
    session = Session(model, Tokenizer.byte_level(), prefill_chunk=16, progress=False)
    layer = next(i for i, block in enumerate(model.model.layers) if hasattr(block, "block_sparse_moe"))
    with pytest.raises(NumericsError) if fault else torch.no_grad():
        with workbench.record(session, trace=path):
            session.append(ids=list(range(20)))
            session.prefill()
            if fault:
                with torch.no_grad():
                    model.model.layers[layer].block_sparse_moe.gate.weight[1, 0] = float("nan")
            session.append(ids=list(range(20, 40)))
            list(session.generate(2, temperature=0, stop_ids=()))
    return layer


def banner_for(path) -> IntegrityBanner:
    state = DashboardState(path, reducers=view_reducers())  # the registered views, the banner's among them
    state.sync()
    return IntegrityBanner(state=state)


def test_banner_names_the_fault_and_hides_on_a_clean_trace(checkpoint_dir, tmp_path):
    model = load_model(checkpoint_dir("tiny", "k3.1", seed=6, dtype=torch.float32))
    recorded(tmp_path / "clean", model, fault=False)
    clean = banner_for(tmp_path / "clean")
    assert clean.banner.visible is False or clean.banner.alert_type == "warning"  # at most frozen-decay warnings
    assert "no faults" in clean.banner.object.replace("\\", "")
    layer = recorded(tmp_path / "bad", model, fault=True)
    bad = banner_for(tmp_path / "bad")
    assert bad.banner.visible and bad.banner.alert_type == "danger"
    text = bad.banner.object.replace("\\", "")  # the Alert's text is Markdown-escaped
    assert f"fault moe.router_nonfinite at layer {layer}, since position 20" in text
    answer = integrity_health(workbench.open_trace(tmp_path / "bad"))
    assert answer.line.startswith(f"Q8 integrity: fault moe.router_nonfinite at layer {layer}")
    assert answer.frame.iloc[0]["check"] == "moe.router_nonfinite"
