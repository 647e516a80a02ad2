"""A server's life: its options (options.py), the supervisor that starts,
restarts and stops the worker processes (supervisor.py, restarts.py,
lifeline.py), one worker (worker.py), the ports they share (sockets.py),
what the container allows (cgroup.py, descriptors.py) and logging (logs.py)."""
