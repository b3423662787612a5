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


def test_gains_set_on_one_module_are_not_another_s(tmp_path, monkeypatch):
    """LayerNorm templates are abstract (no initializer runs): every gain a module has is
    set from the call's arrays, and a call's gains never reach the next call."""
    b = _backend(monkeypatch, tmp_path)
    x = np.array([[1.0, 2.0, 4.0]], np.float32)
    doubled = b.layer_norm(x, (3,), np.full(3, 2.0, np.float32), np.zeros(3, np.float32), 1e-5)
    plain = b.layer_norm(x, (3,), np.ones(3, np.float32), np.zeros(3, np.float32), 1e-5)
    np.testing.assert_array_equal(doubled.output, 2 * plain.output)
    assert len(b._templates) == 1
