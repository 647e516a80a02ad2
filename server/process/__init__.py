"""A server's life: the supervisor that starts, restarts and stops the
worker processes, one worker, and what ties them together. Which module
does what: docs/design.md, "server/"."""
