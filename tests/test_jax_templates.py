"""The jax adapter builds each Flax module by cloning one built once per configuration
(FlaxBackend._fresh): that changes no result and shares no state between the modules of
one configuration."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("jax")

from normspec.impls.flax_nnx import FlaxBackend  # noqa: E402
from test_jax_executables import _backend, _same_bits, _seeded_calls  # noqa: E402


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_cloned_modules_give_the_bits_of_modules_built_afresh(tmp_path, monkeypatch, dtype):
    """Every entry point, twice over (the second time from the templates), against a
    backend whose every module is built by Flax's constructor, as before templates."""
    monkeypatch.setattr(FlaxBackend, "_fresh", lambda self, key, make, abstract=False: make())
    built = _seeded_calls(_backend(monkeypatch, tmp_path), dtype=dtype)
    monkeypatch.undo()
    b = _backend(monkeypatch, tmp_path)
    first = _seeded_calls(b, dtype=dtype)
    again = _seeded_calls(b, dtype=dtype)
    assert b._templates
    assert _same_bits(built, first) and _same_bits(built, again)


def test_two_layers_of_one_configuration_share_no_state(tmp_path, monkeypatch):
    b = _backend(monkeypatch, tmp_path)

    def layer():
        return b.batch_norm(2, eps=1e-5, momentum=0.1, affine=True, track_running_stats=True,
                            dtype=np.float32)

    trained, fresh = layer(), layer()
    trained.forward(np.array([[9.0, 1.0], [11.0, 3.0]], np.float32))
    assert trained.running_mean.tolist() == pytest.approx([1.0, 0.2])
    assert fresh.running_mean.tolist() == [0.0, 0.0]
    assert fresh.running_var.tolist() == [1.0, 1.0]
    assert layer().running_mean.tolist() == [0.0, 0.0]


def _configurations(b):
    """Calls that differ from one another in one value each of what a template is built
    from (eps, its type, gains given or not, dtype, width, axes, momentum, affine): with
    a value left out of the key, one of them runs on another's module."""
    x = np.array([[1.0, 1.0 + 2**-10, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0 + 2**-9]])
    w, bias = np.linspace(0.5, 2.0, 8), np.linspace(-1.0, 1.0, 8)
    out = []
    for eps in (1e-5, np.float32(1e-5), np.float64(1e-5), 1e-3, 0.0, -0.0):
        for dtype in (np.float64, np.float32):
            xd, wd, bd = x.astype(dtype), w.astype(dtype), bias.astype(dtype)
            out += [b.layer_norm(xd, (8,), wd, bd, eps).output,
                    b.layer_norm(xd, (8,), None, bd, eps).output,
                    b.layer_norm(xd, (8,), wd, None, eps).output,
                    b.layer_norm(xd, (8,), None, None, eps).output,
                    b.layer_norm(xd.reshape(1, 2, 4), (2, 4), wd.reshape(2, 4), None, eps).output,
                    b.layer_norm(xd[:, :4], (4,), None, None, eps).output,
                    b.rms_norm(xd, (8,), wd, eps).output,
                    b.rms_norm(xd, (8,), None, eps).output,
                    b.qk_norm_scores(xd[None], xd[None] * 2, wd, None, eps, 0.5),
                    b.qk_norm_scores(xd[None], xd[None] * 2, None, wd, eps, 0.5)]
        for momentum in (0.1, 0.5):
            for affine in (True, False):
                bn = b.batch_norm(2, eps=eps, momentum=momentum, affine=affine,
                                  track_running_stats=True, dtype=np.float64)
                out += [bn.forward(x.reshape(4, 2)).output, bn.running_mean, bn.running_var]
    return out


@pytest.mark.parametrize("legacy", [False, "1.25"])
def test_every_configuration_gets_its_own_template(tmp_path, monkeypatch, legacy):
    """One backend makes every configuration in turn, its templates kept; each result
    has the bits of a backend that builds every module afresh. Under NumPy's legacy
    printing too, where np.float32(1e-5) prints as 1e-05 (found by a review: a key of
    repr(eps) then shared one template, and the executable cache one executable)."""
    with np.printoptions(legacy=legacy):
        monkeypatch.setattr(FlaxBackend, "_fresh",
                            lambda self, key, make, abstract=False: make())
        built = [np.asarray(a) for a in _configurations(_backend(monkeypatch, tmp_path / "a"))]
        monkeypatch.undo()
        templated = [np.asarray(a) for a in _configurations(_backend(monkeypatch, tmp_path / "b"))]
    assert _same_bits(built, templated)


def test_a_bias_given_to_rms_norm_raises_as_before(tmp_path, monkeypatch):
    """RMSNorm has no bias: a harness that passes one must hear of it, not have it
    ignored (found by a review: fused_add_norm with norm='rms_norm' and a bias)."""
    b = _backend(monkeypatch, tmp_path)
    x = np.ones((2, 4), np.float32)
    with pytest.raises(AttributeError, match="bias"):
        b.fused_add_norm(x, x, "rms_norm", (4,), None, np.ones(4, np.float32), 1e-5)
