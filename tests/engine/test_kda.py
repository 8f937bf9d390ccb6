"""KDA core oracles: our recurrent and chunked forms against fla's naive references and each other.

- `kda_recurrent` == `fla.ops.kda.naive.naive_recurrent_kda` (outputs and final state).
- `kda_chunked` == `kda_recurrent` for odd lengths, with and without an initial state, for K3's
  bounded gate (g in (-5, 0)) and for steep Kimi-Linear decays (-exp(A_log) softplus(z), A up to 16),
  chunk sizes 16 and 64, and `group_tokens` smaller than T (the sequential hand-off between groups).
- `kda_chunked` == `fla.ops.kda.naive.naive_chunk_kda` (T a multiple of 64, as fla requires).
- The layer (`KimiDeltaAttention` with a `KDAState`): a sequence fed in pieces (37 + 1 + 1 + 50)
  equals the same sequence at once, outputs and final state (conv tail included).

All fp32, relative error <= 1e-5.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from fla.ops.kda.naive import naive_chunk_kda, naive_recurrent_kda

from engine import load_model
from engine.cache import KDAState
from engine.ops.kda.reference import kda_chunked, kda_recurrent
from tests.helpers import assert_close

pytestmark = pytest.mark.usefixtures("nan_poison")  # unwritten outputs of ops and kernels fail loudly
SEED = 42


def make_inputs(T: int, gate: str, *, B: int = 2, H: int = 3, K: int = 16, V: int = 12,
                with_state: bool = False, seed: int = SEED) -> dict[str, torch.Tensor | None]:
    """Random KDA inputs. `gate`: `bounded` (K3: lb * sigmoid) or `steep` (Kimi-Linear softplus)."""
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    k = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    v = torch.randn(B, T, H, V, generator=gen)
    z = torch.randn(B, T, H, K, generator=gen)
    if gate == "bounded":
        # spread z so decays span the whole (-5, 0) range: near-0 (long memory) and near -5
        g = -5.0 * torch.sigmoid(3.0 * z - 1.0)
    elif gate == "steep":
        a = torch.exp(torch.log(torch.empty(H, 1).uniform_(1.0, 16.0, generator=gen)))
        g = -a * F.softplus(2.0 * z - 1.0)
    else:
        raise ValueError(gate)
    beta = torch.sigmoid(torch.randn(B, T, H, generator=gen))
    state = torch.randn(B, H, K, V, generator=gen) * 0.5 if with_state else None
    return {"q": q, "k": k, "v": v, "g": g, "beta": beta, "initial_state": state}


# ---- recurrent form vs fla ------------------------------------------------------------------

@pytest.mark.parametrize("with_state", [False, True], ids=["zero-state", "initial-state"])
@pytest.mark.parametrize("gate", ["bounded", "steep"])
@pytest.mark.parametrize("T", [1, 5, 63, 130])
def test_recurrent_matches_fla_naive_recurrent(T: int, gate: str, with_state: bool) -> None:
    x = make_inputs(T, gate, with_state=with_state)
    o, S = kda_recurrent(**x)
    o_ref, S_ref = naive_recurrent_kda(x["q"], x["k"], x["v"], x["g"], x["beta"],
                                       initial_state=x["initial_state"], output_final_state=True)
    assert_close(o, o_ref, "output")
    assert_close(S, S_ref, "final state")


def test_recurrent_custom_scale_matches_fla() -> None:
    x = make_inputs(17, "bounded", with_state=True)
    o, S = kda_recurrent(**x, scale=0.3)
    o_ref, S_ref = naive_recurrent_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], scale=0.3,
                                       initial_state=x["initial_state"], output_final_state=True)
    assert_close(o, o_ref, "output")
    assert_close(S, S_ref, "final state")


# ---- chunked form vs recurrent form ---------------------------------------------------------

CHUNK_CASES = [
    # (T, chunk_size, group_tokens)
    (1, 64, 2048),
    (5, 16, 2048),
    (63, 64, 2048),
    (65, 64, 2048),
    (130, 16, 32),  # groups of 2 chunks: several sequential group hand-offs
    (200, 64, 64),  # one chunk per group, ragged last chunk
    (200, 16, 2048),
]


@pytest.mark.parametrize("with_state", [False, True], ids=["zero-state", "initial-state"])
@pytest.mark.parametrize("gate", ["bounded", "steep"])
@pytest.mark.parametrize(("T", "chunk", "group"), CHUNK_CASES,
                         ids=[f"T{t}-C{c}-G{g}" for t, c, g in CHUNK_CASES])
def test_chunked_matches_recurrent(T: int, chunk: int, group: int, gate: str, with_state: bool) -> None:
    x = make_inputs(T, gate, with_state=with_state)
    o_ref, S_ref = kda_recurrent(**x)
    o, S = kda_chunked(**x, chunk_size=chunk, group_tokens=group)
    assert o.shape == o_ref.shape and S.shape == S_ref.shape
    assert_close(o, o_ref, "output")
    assert_close(S, S_ref, "final state")


def test_chunked_with_extreme_decays_stays_finite() -> None:
    """Decays of -60 per channel in one token: the sub-block factoring must not overflow."""
    x = make_inputs(70, "steep", with_state=True)
    x["g"] = x["g"] * 4.0
    o_ref, S_ref = kda_recurrent(**x)
    o, S = kda_chunked(**x)
    assert torch.isfinite(o).all() and torch.isfinite(S).all()
    assert_close(o, o_ref, "output")
    assert_close(S, S_ref, "final state")


@pytest.mark.parametrize("with_state", [False, True], ids=["zero-state", "initial-state"])
@pytest.mark.parametrize("gate", ["bounded", "steep"])
def test_chunked_matches_fla_naive_chunk(gate: str, with_state: bool) -> None:
    x = make_inputs(128, gate, with_state=with_state)
    o, S = kda_chunked(**x, chunk_size=64)
    o_ref, S_ref = naive_chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"],
                                   initial_state=x["initial_state"], output_final_state=True, chunk_size=64)
    assert_close(o, o_ref, "output")
    assert_close(S, S_ref, "final state")


# ---- the layer with a KDAState --------------------------------------------------------------

@pytest.mark.parametrize("variant", ["k3.1", "kimi-linear"])
def test_layer_in_pieces_equals_at_once(variant: str) -> None:
    """37 + 1 + 1 + 50 tokens through one KDA layer == 89 tokens at once (chunked and recurrent paths)."""
    model = load_model(f"preset:tiny:{variant}", seed=SEED)
    layer_idx = model.config.kda_layers[1]
    attn = model.model.layers[layer_idx].self_attn
    gen = torch.Generator().manual_seed(SEED)
    x = torch.randn(2, 89, model.config.hidden_size, generator=gen)
    with torch.no_grad():
        whole_state = KDAState.zeros(model.config, batch=2)
        whole = attn(x, whole_state)
        piece_state = KDAState.zeros(model.config, batch=2)
        pieces, start = [], 0
        for n in (37, 1, 1, 50):
            pieces.append(attn(x[:, start:start + n], piece_state))
            start += n
    assert_close(torch.cat(pieces, dim=1), whole, "layer output")
    assert_close(piece_state.recurrent, whole_state.recurrent, "recurrent state")
    assert_close(piece_state.conv, whole_state.conv, "conv tail")
    # without a state the layer is the same full causal forward
    with torch.no_grad():
        assert_close(attn(x), whole, "stateless output")


@pytest.mark.parametrize("tokens", [1, 3, 16, 17, 64])
def test_short_conv_taps_equal_the_depthwise_conv(tokens: int) -> None:
    """Short inputs (decode) take the multiply-sum path, long ones conv1d: both equal the float64
    causal depthwise conv over [tail, x], and hand on the same tail."""
    from engine.layers.kda import SHORT_CONV_TAPS_MAX_T, ShortConv

    g = torch.Generator().manual_seed(tokens)
    conv = ShortConv(24, 4)
    with torch.no_grad():
        conv.weight.copy_(torch.randn(conv.weight.shape, generator=g))
    x, tail = torch.randn(2, tokens, 24, generator=g), torch.randn(2, 24, 3, generator=g)
    out, new_tail = conv(x, tail)
    padded = torch.cat((tail, x.transpose(1, 2)), -1).double()
    want = torch.stack([(padded[:, :, t:t + 4] * conv.weight.double()[:, 0]).sum(-1) for t in range(tokens)], -1)
    assert_close(out, torch.nn.functional.silu(want).transpose(1, 2), 1e-6)
    assert torch.equal(new_tail, padded[:, :, -3:].float())
    assert (tokens <= SHORT_CONV_TAPS_MAX_T) == (tokens in (1, 3, 16))
