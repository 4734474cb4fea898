"""`_common.released`: activations freed after the forward and rebuilt before the backward reads them."""
import pytest
import torch
from torch.utils.checkpoint import checkpoint

from hubfuse._common.released import (OBSERVES_ONLY, can_release, release_until_backward, saved_tensor_hooks_active,
                                     write_alias)


def test_saved_tensor_hooks_query_follows_torch():
    """A torch-private access of the op packages (the other: tests/test_sdpa_private.py): fails when torch
    renames or changes it."""
    assert not saved_tensor_hooks_active() and can_release()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        assert saved_tensor_hooks_active() and not can_release()

    def observe(t):
        return t

    setattr(observe, OBSERVES_ONLY, True)
    with torch.autograd.graph.saved_tensors_hooks(observe, lambda t: t):
        assert not saved_tensor_hooks_active() and can_release()
    seen = []
    x = torch.randn(3, requires_grad=True)
    checkpoint(lambda t: (seen.append(saved_tensor_hooks_active()), t.sin())[1], x, use_reentrant=False)
    assert seen == [True]
    with torch.no_grad():
        assert not can_release()


def _step(release: bool, calls: list):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 7, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(7, dtype=torch.float64, generator=g, requires_grad=True)
    h = x.exp()                     # rebuilt from x
    y = h * w                       # saves h (and w)
    out = y.tanh()
    if release:
        def rebuild(h_out):
            calls.append(h_out.shape)
            torch.exp(x.detach(), out=write_alias(h_out))
        release_until_backward([y], (h,), rebuild)
        assert h.untyped_storage().nbytes() == 0
    version = h._version
    out.sum().backward()
    assert h._version == version  # the rebuild wrote through an alias: autograd's in-place check holds
    return x.grad, w.grad, h


def test_release_rebuilds_bit_for_bit_once():
    calls = []
    gx, gw, h = _step(True, calls)
    rx, rw, _ = _step(False, [])
    assert calls == [h.shape] and h.untyped_storage().nbytes() == h.numel() * h.element_size()
    assert torch.equal(gx, rx) and torch.equal(gw, rw)


def test_release_rebuild_that_writes_wrong_values_changes_the_gradient():
    """The check above can fail: a rebuild that does not restore the values changes w's gradient."""
    x = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    w = torch.randn(3, dtype=torch.float64, requires_grad=True)
    h = x.exp()
    y = h * w
    release_until_backward([y], (h,), lambda h_out: write_alias(h_out).fill_(1.0))
    y.sum().backward()
    assert not torch.allclose(w.grad, x.detach().exp().sum(0))
    assert torch.equal(w.grad, torch.full((3,), 4.0, dtype=torch.float64))


def test_release_rejects_shared_storage_and_missing_anchor():
    x = torch.randn(6, 4, requires_grad=True)
    h = x * 2
    with pytest.raises(ValueError, match="shares its storage"):
        release_until_backward([h], (h[1:],), lambda t: None)
    assert h.untyped_storage().nbytes() == h.numel() * h.element_size()  # nothing freed
    with pytest.raises(ValueError, match="no anchor has an autograd node"):
        release_until_backward([x.detach()], (h,), lambda t: None)
    assert h.untyped_storage().nbytes() == h.numel() * h.element_size()


def test_rebuild_writing_in_place_is_caught_by_autograd():
    """Why rebuilds write through `write_alias`: an in-place torch op on the saved tensor moves its version."""
    x = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    w = torch.randn(3, dtype=torch.float64, requires_grad=True)
    h = x.exp()
    y = h * w
    release_until_backward([y], (h,), lambda h_out: torch.exp(x.detach(), out=h_out))
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


def test_release_switch(monkeypatch):
    """HUBFUSE_RELEASE_ACTIVATIONS: 1 (default) may release, 0 never does, anything else is a clear error."""
    from hubfuse._common import released

    monkeypatch.delenv(released.RELEASE_SWITCH, raising=False)
    assert released.can_release()
    monkeypatch.setenv(released.RELEASE_SWITCH, "0")
    assert not released.can_release()
    monkeypatch.setenv(released.RELEASE_SWITCH, "1")
    assert released.can_release()
    with torch.no_grad():
        assert not released.can_release()
    monkeypatch.setenv(released.RELEASE_SWITCH, "yes")
    with pytest.raises(ValueError, match="HUBFUSE_RELEASE_ACTIVATIONS must be 0 or 1"):
        released.can_release()
