"""tigon.nn.activation_offload: saved tensors go to host buffers and come back bit for bit.

On the CPU the offloader is told to treat CPU tensors as offloadable (``device_types=("cpu",)``; plain,
synchronous copies): the pack/unpack bookkeeping (views copied once, parameters left, versions,
prefetch of the layer before, buffers pooled) runs as on the GPU. The GPU tests check the overlap (the
copies run on their own stream while the compute stream computes) and the peak memory.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tigon.nn.activation_offload import LayerOffload, LayerScope, OffloadConfig, Offloader, piece_sizes

ON_CPU = OffloadConfig(device_types=("cpu",), min_bytes=0, bucket_bytes=1)


def _held(nbytes):
    """The host bytes a copy of ``nbytes`` takes."""
    return sum(piece_sizes(nbytes, ON_CPU))


class Block(nn.Module):
    """A layer that saves views of one storage (q, k, v of one projection), its input and a weight."""

    def __init__(self, hidden):
        super().__init__()
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.out = nn.Linear(hidden, hidden)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)  # (N, H) views of one (N, 3H) storage
        return x + self.out(torch.sigmoid(q * k) * v)


def _stack(hidden=12, layers=3, device="cpu"):
    torch.manual_seed(0)
    return nn.Sequential(*[Block(hidden) for _ in range(layers)]).to(device)


def _step(model, x, **backward):
    model.zero_grad(set_to_none=True)
    loss = model(x).square().mean()
    loss.backward(**backward)
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


def _offloaded(model, config):
    offloader = Offloader(config)
    changes = [LayerOffload(layer, offloader) for layer in model]
    for change in changes:
        change.apply()
    return offloader, changes


def test_gradients_are_bitwise_the_same_and_buffers_are_reused():
    model, x = _stack(), torch.randn(5, 7, 12, requires_grad=True)
    want = _step(model, x)
    offloader, _ = _offloaded(model, ON_CPU)
    got = _step(model, x)
    assert torch.equal(got[0], want[0])
    assert all(torch.equal(g, w) for g, w in zip(got[1], want[1], strict=True))
    held = offloader.host_bytes
    assert held > 0 and offloader.pool.in_use_bytes == 0  # every buffer back in the pool after the backward
    _step(model, x)
    assert offloader.host_bytes == held  # the second step took the same buffers again


def test_revert_removes_the_scope():
    model, x = _stack(), torch.randn(5, 12)
    offloader, changes = _offloaded(model, ON_CPU)
    for change in changes:
        change.undo()
    _step(model, x)
    assert offloader.host_bytes == 0


def test_second_backward_through_a_retained_graph():
    model, x = _stack(), torch.randn(5, 12)
    want = _step(model, x)
    _offloaded(model, ON_CPU)
    model.zero_grad(set_to_none=True)
    loss = model(x).square().mean()
    loss.backward(retain_graph=True)
    first = [p.grad.clone() for p in model.parameters()]
    loss.backward()
    for g, second, w in zip(first, model.parameters(), want[1], strict=True):
        assert torch.equal(g, w) and torch.equal(second.grad, 2 * w)


def _scope(offloader, layer=None):
    return LayerScope(offloader, layer if layer is not None else nn.Linear(2, 2))


def test_views_of_one_storage_are_copied_once_and_come_back_with_their_geometry():
    offloader = Offloader(ON_CPU)
    base = torch.randn(8, 6)
    scope = _scope(offloader)
    views = [base, base[:, 1:5], base.t(), base.view(6, 8)[2:]]
    handles = [scope.pack(v) for v in views]
    assert offloader.pool.in_use_bytes == _held(base.numel() * base.element_size())
    for handle, view in zip(handles, views, strict=True):
        back = scope.unpack(handle)
        assert torch.equal(back, view) and back.stride() == view.stride() and back.shape == view.shape


def test_a_small_view_of_a_large_storage_copies_its_span_only():
    offloader = Offloader(ON_CPU)
    big = torch.randn(1000)
    scope = _scope(offloader)
    handle = scope.pack(big[100:110])
    assert offloader.pool.in_use_bytes == _held(10 * 4)
    assert torch.equal(scope.unpack(handle), big[100:110])


def test_parameters_views_of_them_and_small_tensors_stay():
    offloader = Offloader(OffloadConfig(device_types=("cpu",), min_bytes=64))
    layer = nn.Linear(8, 8)
    scope = _scope(offloader, layer)
    small = torch.randn(3)
    for t in (layer.weight.detach(), layer.weight.t(), small):
        assert scope.pack(t) is t
    assert offloader.pool.in_use_bytes == 0


def test_a_tensor_written_in_place_between_saves_is_copied_again():
    offloader = Offloader(ON_CPU)
    t = torch.randn(4, 4)
    scope = _scope(offloader)
    first = scope.pack(t)
    before = t.clone()
    t.add_(1)
    second = scope.pack(t)
    assert offloader.pool.in_use_bytes == 2 * _held(t.numel() * 4)
    assert torch.equal(scope.unpack(first), before) and torch.equal(scope.unpack(second), t)


def test_the_first_unpack_of_a_layer_brings_back_the_layer_before():
    offloader = Offloader(ON_CPU)
    a, b = torch.randn(4, 4), torch.randn(4, 4)
    first, second = _scope(offloader), _scope(offloader)
    handle_a, handle_b = first.pack(a), second.pack(b)
    stored_a = handle_a.stored
    assert stored_a.live_copy() is None
    assert torch.equal(second.unpack(handle_b), b)
    prefetched = stored_a.live_copy()
    assert prefetched is not None
    back = first.unpack(handle_a)
    assert torch.equal(back, a) and back.untyped_storage().data_ptr() == prefetched.untyped_storage().data_ptr()


def test_off_without_grad_under_other_hooks_and_for_other_devices():
    model, x = _stack(), torch.randn(5, 12)
    offloader, _ = _offloaded(model, ON_CPU)
    with torch.no_grad():
        model(x)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        model(x).sum().backward()
    assert offloader.host_bytes == 0
    default_model = _stack()
    default, _ = _offloaded(default_model, OffloadConfig())  # CUDA only: a CPU model offloads nothing
    _step(default_model, x)
    assert default.host_bytes == 0


@pytest.mark.parametrize("nbytes", [1, 7, 192, 1000, 4097, 2**20 + 3, 342_733 * 4096 * 2, 3 * 2**33 - 1])
@pytest.mark.parametrize("piece_bits, bucket_bytes", [(4, 1), (4, 1 << 21), (0, 1), (2, 3000)])
def test_pieces_are_powers_of_two_whose_sum_wastes_under_one_granule(nbytes, piece_bits, bucket_bytes):
    config = OffloadConfig(piece_bits=piece_bits, bucket_bytes=bucket_bytes)
    sizes = piece_sizes(nbytes, config)
    granule = max(1 << max(nbytes.bit_length() - 1 - piece_bits, 0), 1 << (bucket_bytes - 1).bit_length())
    assert all(s & (s - 1) == 0 and s >= granule for s in sizes) and sizes == sorted(set(sizes), reverse=True)
    assert nbytes <= sum(sizes) < nbytes + granule and sum(sizes) % granule == 0
    assert len(sizes) <= piece_bits + 1
    if piece_bits == 0:  # one buffer: the next power of two (at least the bucket)
        assert sizes == [max(1 << (nbytes - 1).bit_length(), granule)]


def test_storages_in_several_pieces_come_back_bitwise():
    offloader = Offloader(ON_CPU)
    t = torch.randn(4099, dtype=torch.float64)[3:]  # over half its storage: the storage goes, 32,792 bytes
    odd = torch.randn(1000, 37)[:, 1:30]  # 29 of 37 columns, strided: its storage goes, 148,000 bytes
    scope = _scope(offloader)
    handles = [scope.pack(t), scope.pack(odd)]
    sizes = [piece_sizes(4099 * 8, ON_CPU), piece_sizes(37000 * 4, ON_CPU)]
    assert [len(s) for s in sizes] == [2, 3]  # 32 KiB + 2 KiB; 128 KiB + 16 KiB + 8 KiB
    assert offloader.pool.in_use_bytes == sum(map(sum, sizes))
    back = [scope.unpack(h) for h in handles]
    assert torch.equal(back[0], t) and torch.equal(back[1], odd) and back[1].stride() == odd.stride()


@pytest.mark.parametrize("field, value", [("device_types", ()), ("min_bytes", -1), ("bucket_bytes", 0),
                                          ("min_bytes", 1.5), ("piece_bits", -1), ("piece_bits", True)])
def test_config_checks_its_fields(field, value):
    with pytest.raises(ValueError, match=field):
        OffloadConfig(**{field: value})


# ---------------------------------------------------------------------------------------------- GPU


class CheckpointedMLP(nn.Module):
    """A layer as transformers checkpoints one: an MLP (H -> 4H -> H) inside a non-reentrant checkpoint,
    so that what the layer saves outside the checkpoint is its input (2·H bytes a token against 16·H²
    flops a token forward: the copy hides under the compute from H ≈ 1024 at PCIe-5 and H200 rates)."""

    def __init__(self, hidden):
        super().__init__()
        self.up, self.down = nn.Linear(hidden, 4 * hidden, bias=False), nn.Linear(4 * hidden, hidden, bias=False)

    def forward(self, x):
        mlp = lambda t: t + self.down(torch.relu(self.up(t)))  # noqa: E731
        return torch.utils.checkpoint.checkpoint(mlp, x, use_reentrant=False)


@pytest.mark.gpu
def test_copies_run_on_their_own_stream_overlapping_the_compute():
    """Copies to the host (forward) and back (backward) run on the side stream while the compute stream
    runs the layers' kernels: their time ranges intersect (one stream would serialise them). And the
    memory a step adds drops by most of the layers' saved inputs, at the end of the forward and at the
    step's peak.

    The weights are frozen (the gradient flows to the input only): a layer's weight gradients (8·H² bf16
    values) weigh what its saved input does (2·tokens·H bytes at tokens = 4·H), so with them the
    backward's peak would hold as many gradient bytes as the stock step holds saved inputs. Each step is
    measured from the memory allocated before it (weights, input, and the results kept from earlier
    steps out of the count)."""
    hidden, tokens, layers = 2048, 16384, 12
    torch.manual_seed(0)
    model = nn.Sequential(*[CheckpointedMLP(hidden) for _ in range(layers)]).to("cuda", torch.bfloat16)
    model.requires_grad_(False)
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    saved_inputs = (layers - 1) * tokens * hidden * 2  # the first layer's input is x, allocated before

    def step():
        x.grad = None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        loss = model(x).float().square().mean()
        torch.cuda.synchronize()
        after_forward = torch.cuda.memory_allocated() - before
        loss.backward()
        torch.cuda.synchronize()
        return after_forward, torch.cuda.max_memory_allocated() - before, loss.detach(), x.grad.clone()

    stock_forward, stock_peak, want_loss, want_grad = step()
    offloader, _ = _offloaded(model, OffloadConfig())
    step()  # pins the host buffers
    offloaded_forward, offloaded_peak, got_loss, got_grad = step()
    assert torch.equal(got_loss, want_loss) and torch.equal(got_grad, want_grad)
    # Stock ends the forward holding the layers' inputs; offloaded, none (a copy's source is freed as soon
    # as the forward drops it: the allocator only waits for the copy before handing the block out again).
    assert offloaded_forward < stock_forward - saved_inputs * 3 // 4
    # The backward holds at most two layers' inputs at once (the layer's and the one prefetched).
    assert offloaded_peak < stock_peak - saved_inputs // 2
    assert offloader.host_bytes >= layers * tokens * hidden * 2

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    copies = {"DtoH": [], "HtoD": []}
    compute = []
    for event in prof.events():
        if event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        name = event.name
        kind = "DtoH" if "DtoH" in name or "Device -> Pinned" in name else "HtoD" if "HtoD" in name else None
        if kind is not None:
            copies[kind].append(event)
        elif "emcpy" not in name and "emset" not in name:
            compute.append(event)
    assert len(copies["DtoH"]) >= layers and len(copies["HtoD"]) >= layers and compute

    def overlaps(a, b):
        return a.time_range.start < b.time_range.end and b.time_range.start < a.time_range.end

    for kind in ("DtoH", "HtoD"):
        overlapped = [c for c in copies[kind] if any(overlaps(c, k) for k in compute)]
        assert len(overlapped) >= len(copies[kind]) // 2, kind


def test_host_memory_that_runs_out_is_a_clear_error_and_the_pool_stays_as_it_was(monkeypatch):
    """A new host buffer the host cannot give (cudaHostAlloc failing, here the allocation raising): a
    RuntimeError that names the switch, what is held and what to change; the buffers taken from the pool go
    back and its figures are unchanged."""
    from tigon.nn.activation_offload import HostPool

    pool = HostPool(ON_CPU)
    pool.give(pool.take(1024))  # one pooled 1 KiB buffer
    before = (pool.host_bytes, pool.in_use_bytes, {size: len(b) for size, b in pool.free.items() if b})

    def refusing(nbytes, pin):
        raise RuntimeError("CUDA error: out of memory")

    monkeypatch.setattr(HostPool, "allocate", staticmethod(refusing))
    with pytest.raises(RuntimeError, match=r"offload_activations: the host could not give .* GiB .*keep_attention"):
        pool.take(1024 + 512)  # the pooled 1 KiB and a new 512 B
    assert (pool.host_bytes, pool.in_use_bytes, {size: len(b) for size, b in pool.free.items() if b}) == before
    monkeypatch.undo()
    assert [b.numel() for b in pool.take(1024)] == [1024]
