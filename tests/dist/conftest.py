"""Multi-process tests: `harness.run_distributed` is importable from every test module here."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
