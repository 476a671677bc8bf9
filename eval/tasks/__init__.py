"""Tasks: what a task is and where it comes from (SWE-bench 5.x instances, and the folders and repos behind ours).

load.py: ``load_tasks`` (the toy suite, the generated family, local instance files), ``validate``, ``save_tasks``
and ``checkout`` (a task's repository at its base commit); instances.py: what load.py and family.py share (the fixed
git identity, the commit hash without git, the eval script, a repository written from files); family.py: the
generated task family, made from a seed at run time; cli.py: ``python -m eval tasks`` (list, validate, export the
family); toy/: the shipped toy suite, one folder per task (repo/, gold and test patches, task.json)."""
