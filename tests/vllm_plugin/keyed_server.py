"""The keys of the session's keyed vLLM server (conftest.keyed_server) and the headers that carry them.

One server stands for a hardened deployment (docs/security.md, docs/vllm-plugin.md): vLLM's
client key (`VLLM_API_KEY`), the gates' replica key (`KVGATE_REPLICA_API_KEY_FILE`), the
retention connector (`--kv-transfer-config`, KV pins), priority scheduling
(`--scheduling-policy priority`, `gate.held_priority`) and auto tool choice (the `pythonic`
parser: a request may leave the choice of a tool call to the model). The replica-security, pin and
priority tests share it, so that its configuration starts once per test session.
"""

from __future__ import annotations

import uuid

VLLM_KEY = "vllm-client-key-" + uuid.uuid4().hex[:8]
REPLICA_KEY = "replica-key-" + uuid.uuid4().hex[:8]
CLIENT = {"Authorization": f"Bearer {VLLM_KEY}"}  # what a client of vLLM sends
GATE = {**CLIENT, "X-Kvgate-Replica-Key": REPLICA_KEY}  # what a gate sends to the replica API
