"""gyre.report: plots of what a run (or a simulated run) recorded: role Gantt charts with regime shares, utilisation, sensitivity tornado; live-run tables (live.py)."""
