"""The health rows made on the host (numpy: a CPU recording) and on a device (torch, with no
synchronisation) are the same rows: each family's checker run once on numpy views and once on the
tensors kept in torch, over batches with failing, non-finite and clean rows."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from workbench.recorders.policy import RecordPolicy
from workbench.signals import integrity


class Pending:
    """The recording context's `pend`, keeping rows as numpy columns (what the flush copies)."""

    def __init__(self, host: bool) -> None:
        self.policy = RecordPolicy(name="rows")
        self.rows: list[tuple[str, dict]] = []
        self.host = host

    def pend(self, table, layer, rank, cols, drop_zero=None):
        self.rows.append((table, {k: v.numpy() if isinstance(v, torch.Tensor) else v for k, v in cols.items()}))


def run_both(monkeypatch, checker, fields: dict) -> tuple[list, list]:
    steps = torch.arange(100, 100 + len(fields["positions"]))
    host = Pending(True)
    checker(host, 3, 0, steps, fields)
    # the device path: the same tensors, not turned into numpy (as on a GPU)
    monkeypatch.setattr(integrity, "_on_host", lambda f, s: (f, s))
    device = Pending(False)
    checker(device, 3, 0, steps, fields)
    monkeypatch.undo()
    return host.rows, device.rows


def assert_same_rows(a: list, b: list) -> None:
    assert [t for t, _ in a] == [t for t, _ in b]
    for (_, x), (_, y) in zip(a, b):
        assert x.keys() == y.keys()
        for key in x:
            np.testing.assert_array_equal(np.asarray(x[key]), np.asarray(y[key]), err_msg=key)
            assert np.asarray(x[key]).dtype == np.asarray(y[key]).dtype, key


@pytest.mark.parametrize("fault", ["clean", "nan", "inf", "large", "frozen", "drift"])
def test_kda_rows_on_host_equal_the_device_rows(monkeypatch, fault):
    g = torch.Generator().manual_seed(0)
    n, heads = 9, 4
    norm = torch.rand(n, heads, generator=g) * 10
    frozen = torch.zeros(n, heads)
    drift = torch.full((n, heads), math.nan)
    drift[::4] = torch.rand(len(range(0, n, 4)), heads, generator=g) * 1e-5  # measured rows (chunk ends)
    if fault == "nan":
        norm[5, 2] = math.nan
    elif fault == "inf":
        norm[3, 1] = math.inf
    elif fault == "large":
        norm[6, 3] = 1e6
    elif fault == "frozen":
        frozen[2:, 1] = 3.0
    elif fault == "drift":
        drift[4, 0], drift[8, 2] = 0.5, math.nan
    fields = {"positions": torch.arange(40, 40 + n), "norm": norm, "frozen": frozen, "drift": drift}
    host, device = run_both(monkeypatch, integrity.kda_rows, fields)
    assert_same_rows(host, device)
    failed = {row["check"][0]: int(row["count"][0]) for _, row in host}
    expected = {"clean": 0, "nan": 1, "inf": 1, "large": 1, "frozen": 7, "drift": 2}[fault]
    assert sum(failed.values()) == expected


def test_dsa_and_moe_rows_on_host_equal_the_device_rows(monkeypatch):
    n = 7
    dsa = {"positions": torch.arange(n), "tie_band": torch.tensor([0, 3, 0, 5, 2, 0, 9]),
           "tie_cut": torch.tensor([0, 1, 0, 0, 2, 0, 0])}
    assert_same_rows(*run_both(monkeypatch, integrity.dsa_rows, dsa))
    kth = torch.tensor([0.5, 0.25, -math.inf, 0.75, 0.5, 0.125, 0.5])
    moe = {"positions": torch.arange(n), "logit_sum": torch.tensor([1.0, math.nan, 2.0, 3.0, math.inf, 0.0, 1.0]),
           "kth_choice": kth, "runner_up": torch.tensor([0.25, 0.25, -math.inf, 0.5, 0.5, 0.0, 0.25])}
    host, device = run_both(monkeypatch, integrity.moe_rows, moe)
    assert_same_rows(host, device)
    assert [int(r["count"][0]) for _, r in host] == [2, 2]  # two non-finite logits, two boundary ties


def test_half_precision_fields_are_widened_on_the_host(monkeypatch):
    moe = {"positions": torch.arange(3), "logit_sum": torch.tensor([1.0, 2.0, 3.0], dtype=torch.bfloat16),
           "kth_choice": torch.tensor([0.5, 0.5, 0.25], dtype=torch.bfloat16),
           "runner_up": torch.tensor([0.5, 0.25, 0.25], dtype=torch.bfloat16)}
    host, device = run_both(monkeypatch, integrity.moe_rows, moe)
    assert [int(r["count"][0]) for _, r in host] == [0, 2]
    assert float(host[1][1]["worst"][0]) == float(device[1][1]["worst"][0]) == 0.5
