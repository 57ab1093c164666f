"""gyre.harness: task suites, the black-box harness runner, the evaluator and the reference harness.

Modules: ``tasks`` (NL2RepoBench suites, read as published), ``tasks_cli`` (``gyre tasks``),
``runner`` (executions, workspaces, limits), ``sandbox`` (what a harness and an evaluation see,
and in which runtime: the task's image or bubblewrap on the host), ``runtimes`` (one module per
runtime: bwrap, Apptainer/Singularity, enroot, podman/docker), ``sandbox_init`` (the first
program inside an instance: the proxy relay and the command runner), ``evaluator`` (scoring
retained workspaces in the task environment), ``scoring`` (NL2RepoBench's official rules),
``reference_agent`` / ``answer_agent`` (harnesses run as their own processes), ``proc``
(process-group and environment helpers).
"""
