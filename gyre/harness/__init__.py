"""gyre.harness: task suites, the black-box harness runner, the evaluator and the reference harness.

Modules: ``tasks`` (NL2RepoBench suites), ``runner`` (executions, workspaces, limits),
``evaluator`` (scoring retained workspaces), ``reference_agent`` (a harness run as its own process),
``proc`` (process-group and environment helpers).
"""
