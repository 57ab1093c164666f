"""The services a driver composes: each one job, each its own tests.

- `rollout.RolloutService`: router, proxy, harness pool, evaluator pool and shard writer, i.e.
  what runs an execution and records it. The head and `gyre rollout` use the same object.
- `fleet.CellFleet`: the book of cells and the typed commands to their agents (the only code that
  builds a `Command` or reads a `Reply`).
- `training.TrainingDispatch`: ended executions' records until their group is materialized,
  micro-batches, which cell trains which, and the two-phase reduce of a step.
- `ledger.Ledger`: what is written down: ``ledger.jsonl``, ``steps.jsonl``, ``state.json``, and
  what ``--resume`` reads back from them.

None of them decides anything: the coordinator core (`gyre.sched.core`) and the policy do; the
head (`gyre.head`) connects core, policy and services in one loop.
"""
