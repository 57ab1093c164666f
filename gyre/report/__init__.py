"""gyre.report: what a run (or a simulated run) recorded, shown: role Gantt charts and
utilisation plots (plots.py); live-run tables and charts (live.py); the metrics sink fed by
gyre.events (metrics.py). Imports no driver (tests/core/test_layering.py)."""
