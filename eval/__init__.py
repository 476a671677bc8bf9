"""Rollouts, grading and evaluation around the capture proxy; ``python -m eval --help`` lists the commands.

By job: the pipeline's steps after a session sit flat here (score, join, report, runs, stats; errors); what a task
is and where it comes from in tasks/ (load, instances, family, cli, the toy/ suite); running a harness session
somewhere and collecting it in sessions/ (rollout, ray_rollout, runtime, containers, relay, images, procs); the
harness CLIs in harness/, the reference server in upstream/, the rollout service in service/, the RL loop (and the
demo, its cpu preset) in loop/, the NeMo Gym agent in nemo_gym/. docs/architecture.md has the map."""
