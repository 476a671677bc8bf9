"""Rollouts, grading and evaluation around the capture proxy; ``python -m eval --help`` lists the commands.

The pipeline sits flat here (tasks, rollout, score, join, report, runs, procs); the harness CLIs in harness/, the
reference server in upstream/, the rollout service in service/, the CPU demo in demo/, the NeMo Gym agent in
nemo_gym/. docs/architecture.md has the map."""
