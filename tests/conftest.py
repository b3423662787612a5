import os
import sys

# the test helpers (oracle_backend, broken_backends) import each other by module name
sys.path.insert(0, os.path.dirname(__file__))
