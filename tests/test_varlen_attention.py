"""Variable-length attention on the unpadded path (`model.unpadded`, `pretrain.model.padding.varlen_attention`):
flash attention's kernel over the packed tokens, each row one sequence, a local layer's band as its window. The
kernel is CUDA-only: on a CPU the path runs on a per-sequence reference of the kernel's documented contract (q, k,
v [T, N, D], cumulative row starts, an inclusive (left, right) window), which checks everything around it (row
starts, rotary positions, windows, the output projection, gradients) against the padded encoder; where CUDA is,
the real kernel is checked against the padded encoder in bf16. Attention dropout runs in the kernel too (aten's
flash forward): an exact reading of the probabilities it drops, and of what its backward drops, is checked on the
reference here and on the kernel where CUDA is."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from helpers import BASE, TOKENS, loss_and_grads, make_batch

from objectives import build_objectives
from pretrain.model import encoder as encoder_module
from pretrain.model import padding
from pretrain.model.pretraining import PretrainingModel

CASES = {
    "global": dict(),
    "local_rope_prenorm": dict(
        norm_placement="pre", position_embedding="rope", activation="geglu", local_attention=8, global_every=2
    ),
}
LENGTHS = [(30, 17, 24, 9), (8, 11, 25, 3, 7)]


def reference_varlen(q, k, v, cu_q, cu_k, max_q, max_k, *, window_size=(-1, -1), dropout_p=0.0):
    """The kernel's contract, one sequence at a time: query i of a sequence sees its keys j with
    i - left <= j <= i + right (-1: no limit); dropout on the attention probabilities, as SDPA's."""
    left, right = window_size
    out = torch.empty_like(q)
    for s, e in zip(cu_q[:-1].tolist(), cu_q[1:].tolist()):
        i = torch.arange(e - s, device=q.device)
        allowed = torch.ones(e - s, e - s, dtype=torch.bool, device=q.device)
        if left >= 0:
            allowed &= i[None, :] >= i[:, None] - left
        if right >= 0:
            allowed &= i[None, :] <= i[:, None] + right
        qkv = (t[s:e].transpose(0, 1) for t in (q, k, v))
        y = F.scaled_dot_product_attention(*qkv, attn_mask=allowed, dropout_p=dropout_p)
        out[s:e] = y.transpose(0, 1)
    return out


def reference_flash(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, is_causal, debug_mask, *, apply_dropout=True, **kw):
    """aten's flash forward, as `varlen_attention` calls it with dropout: (output, logsumexp, philox state, -, -)."""
    assert not is_causal and not debug_mask
    window = (kw["window_size_left"], kw["window_size_right"])
    out = reference_varlen(q, k, v, cu_q, cu_k, max_q, max_k, window_size=window, dropout_p=dropout_p * apply_dropout)
    return out, None, None, None, None


@pytest.fixture
def reference_kernel(monkeypatch):
    """The varlen path taken on this CPU, on the references; records (window, dropout) of each call. The dropout
    path's reference leaves dropout out, so that a run with it can be compared with the padded encoder's."""
    calls = []

    def kernel(*args, **kwargs):
        calls.append((kwargs["window_size"], 0.0))
        return reference_varlen(*args, **kwargs)

    def flash(*args, **kwargs):
        calls.append(((kwargs["window_size_left"], kwargs["window_size_right"]), args[7]))
        return reference_flash(*args, apply_dropout=False, **kwargs)

    monkeypatch.setattr(padding, "_varlen_attn", lambda: kernel)
    monkeypatch.setattr(padding, "_flash_forward", lambda: flash)
    monkeypatch.setattr(encoder_module, "varlen_usable", lambda q, dropout_p: True)
    return calls


def _build(options: dict) -> PretrainingModel:
    torch.manual_seed(0)
    cfg = replace(BASE, **{"hidden_dropout": 0.0, "attention_dropout": 0.0, **options})
    model = PretrainingModel(cfg, build_objectives({"mlm": {}}, TOKENS))
    with torch.no_grad():  # off the init (zero biases and unit norms would hide mistakes)
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    return model


@pytest.mark.parametrize("case", CASES)
def test_varlen_attention_gives_the_padded_encoders_loss_and_gradients(case, reference_kernel):
    padded = _build(CASES[case])
    unpadded = _build(dict(CASES[case], unpadded=True))
    unpadded.load_state_dict(padded.state_dict())
    for seed, lengths in enumerate(LENGTHS):
        batch = make_batch(lengths=lengths, seed=seed)
        loss_p, grads_p = loss_and_grads(padded, batch)
        calls = len(reference_kernel)
        loss_u, grads_u = loss_and_grads(unpadded, batch)
        assert len(reference_kernel) - calls == BASE.num_layers  # every layer ran on the packed tokens
        assert torch.allclose(loss_u, loss_p, rtol=1e-5, atol=1e-6), (case, seed, loss_u.item(), loss_p.item())
        wrong = {
            n: (grads_u[n] - g).abs().max().item()
            for n, g in grads_p.items()
            if not torch.allclose(grads_u[n], g, rtol=1e-4, atol=1e-6)
        }
        assert not wrong, f"{case}, batch {seed}: gradients differ from the padded encoder: {wrong}"
    windows = {window for window, _ in reference_kernel}
    assert windows == ({(-1, -1), (4, 4)} if case.startswith("local") else {(-1, -1)})  # window 8: 4 either side


def test_attention_dropout_runs_in_the_kernel_while_training(reference_kernel):
    """With attention dropout, training takes aten's flash forward (torch's varlen_attn has no dropout), with the
    layer's dropout and every argument as the kernel without it: the reference, leaving dropout out, gives the
    padded encoder's loss and gradients without attention dropout. Evaluation takes the kernel without dropout."""
    padded = _build(CASES["local_rope_prenorm"])
    unpadded = _build(dict(CASES["local_rope_prenorm"], unpadded=True, attention_dropout=0.1))
    unpadded.load_state_dict(padded.state_dict())
    batch = make_batch(lengths=LENGTHS[1], seed=1)
    loss_p, grads_p = loss_and_grads(padded, batch)
    loss_u, grads_u = loss_and_grads(unpadded.train(), batch)
    assert sorted(set(reference_kernel)) == [((-1, -1), 0.1), ((4, 4), 0.1)]
    assert len(reference_kernel) == BASE.num_layers
    assert torch.allclose(loss_u, loss_p, rtol=1e-5, atol=1e-6)
    assert all(torch.allclose(grads_u[n], g, rtol=1e-4, atol=1e-6) for n, g in grads_p.items())
    reference_kernel.clear()
    unpadded.eval()(batch)
    assert {dropout for _, dropout in reference_kernel} == {0.0} and len(reference_kernel) == BASE.num_layers


def check_dropped_attention(device: torch.device, dtype: torch.dtype, window: int, p: float = 0.25) -> None:
    """Attention dropout through `varlen_attention`, read exactly: with q = k = 0 every allowed key of query i gets
    1 / n_i, and with v's row j the one-hot of j's position, output row i is query i's row of attention probabilities
    after dropout. So each entry is 0 outside the sequence and the window, and 0 or 1 / (n_i (1 - p)) inside, about
    a fraction p of them 0; and v's gradient for an all-ones output gradient is the column sums of those same
    probabilities, which holds only if the backward drops what the forward dropped."""
    lengths, heads, dim = [20, 7, 33], 2, 64
    mask = torch.zeros(len(lengths), max(lengths), dtype=torch.bool)
    for row, n in enumerate(lengths):
        mask[row, :n] = True
    packed = padding.Packed.from_mask(mask.to(device), dtype, num_tokens=sum(lengths))
    pos = torch.cat([torch.arange(n) for n in lengths]).to(device)  # [T] position in its sequence
    q = torch.zeros(len(pos), heads, dim, device=device, dtype=dtype, requires_grad=True)
    k = torch.zeros_like(q, requires_grad=True)
    v = F.one_hot(pos, dim)[:, None, :].expand(-1, heads, -1).to(dtype).clone().requires_grad_(True)  # [T, N, D]
    torch.manual_seed(3)
    out = padding.varlen_attention(q, k, v, packed, window, p)  # [T, N, D]
    out.backward(torch.ones_like(out))
    torch.manual_seed(3)
    assert torch.equal(padding.varlen_attention(q, k, v, packed, window, p), out)  # the seed decides the mask
    assert not torch.equal(padding.varlen_attention(q, k, v, packed, window, p), out)

    out, grad_v, half = out.float(), v.grad.float(), window // 2 if window else max(lengths)
    kept = []
    for s, n in zip(torch.tensor([0, *lengths]).cumsum(0).tolist(), lengths):
        i = torch.arange(n, device=device)
        allowed = (i[None, :] - i[:, None]).abs() <= half  # [n, n]
        probs = out[s : s + n, :, :n].transpose(0, 1)  # [N, n queries, n keys]
        assert out[s : s + n, :, n:].abs().max() == 0  # nothing past the sequence
        assert probs[:, ~allowed].abs().max() == 0 if (~allowed).any() else True  # nothing outside the window
        full = 1 / (allowed.sum(1, keepdim=True).float() * (1 - p))  # [n, 1]
        on = probs[:, allowed]  # [N, allowed pairs]
        dropped = on == 0
        assert torch.allclose(on[~dropped], full.expand_as(allowed)[allowed].expand_as(on)[~dropped], rtol=2e-2)
        kept.append(~dropped)
        columns = probs.sum(1)  # [N, n keys]: what each key's value received
        assert torch.allclose(grad_v[s : s + n, :, 0].T, columns, rtol=2e-2, atol=1e-3), "backward's mask differs"
    kept = torch.cat([x.flatten() for x in kept]).float()
    assert abs((1 - kept.mean().item()) - p) < 5 * (p * (1 - p) / kept.numel()) ** 0.5, 1 - kept.mean().item()
    assert torch.isfinite(q.grad).all() and torch.isfinite(k.grad).all()


@pytest.mark.parametrize("window", [0, 8])
def test_dropped_attention_check_on_the_reference(window, monkeypatch):
    """`check_dropped_attention` on this CPU, through the reference of the kernel's contract (SDPA's dropout): the
    check itself is right before it meets the CUDA kernel below."""
    monkeypatch.setattr(padding, "_flash_forward", lambda: reference_flash)
    check_dropped_attention(torch.device("cpu"), torch.float32, window)


def test_the_kernel_is_used_only_where_it_runs(monkeypatch):
    q = torch.randn(10, 2, 16)
    assert not padding.varlen_usable(q, 0.0)  # a CPU tensor
    # what q looks like on a GPU (all varlen_usable reads of it): without dropout torch's varlen_attn must be there,
    # with it aten's flash forward
    cuda = SimpleNamespace(is_cuda=True, dtype=torch.bfloat16, shape=(10, 2, 16))
    for varlen, flash in [(None, None), (object(), None), (None, object()), (object(), object())]:
        monkeypatch.setattr(padding, "_varlen_attn", lambda v=varlen: v)
        monkeypatch.setattr(padding, "_flash_forward", lambda f=flash: f)
        assert padding.varlen_usable(cuda, 0.0) == (varlen is not None)
        assert padding.varlen_usable(cuda, 0.1) == (flash is not None)
        assert not padding.varlen_usable(SimpleNamespace(**{**vars(cuda), "dtype": torch.float32}), 0.0)
        assert not padding.varlen_usable(SimpleNamespace(**{**vars(cuda), "shape": (10, 2, 12)}), 0.0)  # head dim % 8
    monkeypatch.undo()
    if torch.cuda.is_available() and padding._varlen_attn() is not None:
        # this torch has the varlen kernel: dropout must run in it too, not fall back to re-padding in silence
        assert padding._flash_forward() is not None
        assert padding.varlen_usable(q.cuda().bfloat16(), 0.0) and padding.varlen_usable(q.cuda().bfloat16(), 0.1)
        assert not padding.varlen_usable(q.cuda(), 0.0)  # fp32


@pytest.mark.skipif(not torch.cuda.is_available(), reason="flash attention's varlen kernel needs CUDA")
@pytest.mark.parametrize("case", CASES)
def test_the_cuda_kernel_gives_the_padded_encoders_loss(case):
    if padding._varlen_attn() is None:
        pytest.skip("this torch has no torch.nn.attention.varlen")
    padded = _build(CASES[case]).cuda()
    unpadded = _build(dict(CASES[case], unpadded=True)).cuda()
    unpadded.load_state_dict(padded.state_dict())
    for seed, lengths in enumerate(LENGTHS):
        batch = make_batch(lengths=lengths, seed=seed).to("cuda")
        with torch.autocast("cuda", torch.bfloat16):
            loss_p, grads_p = loss_and_grads(padded, batch)
            loss_u, grads_u = loss_and_grads(unpadded, batch)
        # the reference first: a padded local layer's fully masked padding rows are what the test below checks
        assert torch.isfinite(loss_p), f"{case}, batch {seed}: the PADDED reference's loss is {loss_p.item()}"
        assert torch.allclose(loss_u, loss_p, rtol=2e-2, atol=2e-2), (case, seed, loss_u.item(), loss_p.item())
        for name, g in grads_p.items():
            assert torch.allclose(grads_u[name], g, rtol=5e-2, atol=5e-2), (case, seed, name)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="flash attention's varlen kernel needs CUDA")
@pytest.mark.parametrize("window", [0, 8])
def test_the_cuda_kernel_drops_exactly_what_it_should(window):
    if padding._varlen_attn() is None:
        pytest.skip("this torch has no torch.nn.attention.varlen")
    assert padding._flash_forward() is not None  # else dropout would re-pad in silence
    check_dropped_attention(torch.device("cuda"), torch.bfloat16, window)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA's attention kernels")
def test_padding_far_from_every_real_token_stays_finite_on_cuda():
    """A local layer's padding query further than the window from every real token has no key to see: a fully masked
    row. SDPA gives zeros there on the CPU; some CUDA kernels have given NaN, which the next layer would carry into
    real tokens (a zero weight times NaN). The padded path, bf16, a short row among long ones: loss and gradients
    finite."""
    model = _build(CASES["local_rope_prenorm"]).cuda()
    batch = make_batch(lengths=(30, 3, 24), seed=0).to("cuda")
    with torch.autocast("cuda", torch.bfloat16):
        loss, grads = loss_and_grads(model, batch)
    assert torch.isfinite(loss), loss
    assert all(torch.isfinite(g).all() for g in grads.values()), [n for n, g in grads.items() if not g.isfinite().all()]
