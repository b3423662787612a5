"""Numba's cache of normspec's kernels follows every kernel source file: an edit of the
half-precision codec alone (inlined into the row kernels) must recompile them, where
Numba's own key (the defining file) would keep running the old conversions. Other
code's numba caches keep Numba's own locators."""

from __future__ import annotations

import shutil
import sys
import types

import pytest

numba = pytest.importorskip("numba")


def test_the_stamp_covers_every_kernel_file(tmp_path):
    from normspec.impls import _numba_jit

    folder = tmp_path / "impls"
    shutil.copytree(_numba_jit.HERE, folder, ignore=shutil.ignore_patterns("__pycache__"))
    before = _numba_jit.kernel_sources_stamp(str(folder))
    assert before == _numba_jit.kernel_sources_stamp()
    codec = folder / "_numba_codec.py"
    codec.write_text(codec.read_text() + "\n# an edit of the codec alone\n")
    assert _numba_jit.kernel_sources_stamp(str(folder)) != before
    (folder / "torch_nn.py").write_text("# not a kernel file\n")
    assert _numba_jit.kernel_sources_stamp(str(folder)) != before  # (the codec edit)


def test_normspec_kernels_use_the_stamped_locator_and_other_code_does_not(tmp_path):
    from normspec.impls import _numba_fused, _numba_jit, _numba_rows

    assert _numba_jit.LOCATORS_INSTALLED
    for kernel in (_numba_rows.ln_fwd, _numba_fused.half_add_norm_fwd):
        locator = kernel._cache._impl.locator
        assert isinstance(locator, _numba_jit._WholeKernelStamp)
        assert locator.get_source_stamp() == ("normspec kernel sources",
                                              _numba_jit.kernel_sources_stamp())
    source = tmp_path / "users_kernels.py"
    source.write_text("from numba import njit\n\n@njit(cache=True)\ndef add(a, b):\n"
                      "    return a + b\n")
    sys.path.insert(0, str(tmp_path))
    try:
        module = __import__("users_kernels")
        assert isinstance(module, types.ModuleType)
        locator = module.add._cache._impl.locator
        assert not isinstance(locator, _numba_jit._WholeKernelStamp)
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("users_kernels", None)


def test_the_locators_install_under_numba_0_60_class_names(monkeypatch):
    """Numba 0.60 names its locator classes with a leading underscore
    (`_InTreeCacheLocator`); the package allows numba>=0.60, where the stamped locators
    were once silently not installed (stale kernels after an edit of the codec alone)."""
    from normspec.impls import _numba_jit
    from numba.core import caching

    names = ("UserProvidedCacheLocator", "InTreeCacheLocator", "UserWideCacheLocator")
    bases = [getattr(caching, n, None) or getattr(caching, "_" + n) for n in names]
    for name, base in zip(names, bases, strict=True):
        monkeypatch.delattr(caching, name, raising=False)
        monkeypatch.setattr(caching, "_" + name, base, raising=False)
    numba_own = [c for c in caching.CacheImpl._locator_classes
                 if not issubclass(c, _numba_jit._WholeKernelStamp)]
    monkeypatch.setattr(caching.CacheImpl, "_locator_classes", list(numba_own))
    assert _numba_jit._install_locators()
    installed = caching.CacheImpl._locator_classes[:3]
    assert [c.__mro__[2] for c in installed] == bases
    assert all(issubclass(c, _numba_jit._WholeKernelStamp) for c in installed)
    assert caching.CacheImpl._locator_classes[3:] == numba_own
