"""gyre.report: tables and plots of what a run (or a simulated run) recorded."""
