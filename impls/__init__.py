"""normspec.impls: the backend protocol (protocol.py), the registry (registry.py) and one
adapter file per built-in backend. No adapter imports normspec.spec: a backend that
consulted the oracle would be checking itself. Known deviations: deviations/<name>.toml."""
