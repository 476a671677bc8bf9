"""Sessions: running a harness session somewhere and collecting what it left.

rollout.py: ``python -m eval rollout``, tasks x samples through the capture proxy into the run folder's sessions
table; ray_rollout.py: the same round spread over a Ray cluster (``--ray``); runtime.py: where a session runs
(``RUNTIMES``: local, docker); containers.py: the Docker CLI as the runtimes and the image builder call it;
relay.py: the byte relay a container with no network reaches its proxy through (standard library only: it also runs
by path inside the container); images.py: ``python -m eval images``, the images sessions and grading run in;
procs.py: free ports, the loopback services (reference server, ``mitmdump``), stopping a process tree."""
