"""normspec.conformance: the checks (one module per family in checks/), the tolerance
table, assertion helpers, Hypothesis strategies, runner, results schema, CLI, bench and
pytest plugin. It reaches backends only through normspec.impls' protocol and registry."""
