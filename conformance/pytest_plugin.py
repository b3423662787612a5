"""pytest plugin (entry point pytest11): run normspec's conformance checks inside a
user's own test suite with `pytest --normspec-backend module:factory`."""


def pytest_addoption(parser):
    group = parser.getgroup("normspec")
    group.addoption("--normspec-backend", action="append", default=[],
                    help="backend name or module:factory to check against the normspec oracle")
