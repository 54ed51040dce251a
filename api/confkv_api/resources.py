"""The ConfKVDeployment resource's identity and the annotation keys the agent and the operator share.

The agent writes ``LAST_REMEDIATION_ANNOTATION`` on its pod and posts Events that name the CR; the
operator reads the annotation into the CR status and serves the CR. Both import these constants from
here, so a renamed group or annotation cannot leave one side behind.
"""

from __future__ import annotations

CR_GROUP = "confkv.io"
CR_VERSION = "v1alpha1"
CR_PLURAL = "confkvdeployments"
CR_KIND = "ConfKVDeployment"
CR_API_VERSION = f"{CR_GROUP}/{CR_VERSION}"

#: Written by the agent on its pod: JSON {"time", "alert", "action", "result", "message"}.
LAST_REMEDIATION_ANNOTATION = "confkv.io/last-remediation"
