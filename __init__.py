"""normspec: a reference-spec verification and conformance suite for normalization
layers (BatchNorm, LayerNorm, RMSNorm, QK-norm).

Subpackages: `normspec.spec` (the NumPy oracle), `normspec.impls` (backend protocol,
registry and adapters), `normspec.conformance` (checks, runner, CLI) and
`normspec.reports` (the HTML report)."""

__version__ = "0.1.0"
