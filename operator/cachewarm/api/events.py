"""What a reconcile or an admission has to say, as a Kubernetes Event on the object it
concerns: the type every step returns and the controller posts (KubeClient.post_event)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Event:
    type: str  # Normal | Warning
    reason: str  # constants.Reason
    message: str
