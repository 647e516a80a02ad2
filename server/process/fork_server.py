"""What the fork server imports first (supervisor._PRELOAD): there, SIGTERM
is ignored, as the fork server already ignores SIGINT.

The fork server lives as long as the supervisor that started it and holds
each worker's exit status. A SIGTERM sent to every process of the server at
once (systemd stopping a unit, `pkill`) would end it before its workers had
drained, and the supervisor would then read each live worker as dead. It
exits on its own when the supervisor is gone and no worker is left.
A worker it forks takes SIGTERM back first thing (lifeline.start_worker).
Nothing else imports this module.
"""

from __future__ import annotations

import signal

signal.signal(signal.SIGTERM, signal.SIG_IGN)
