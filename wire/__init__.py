"""The contract between kvgate's processes, in one place.

kvgate runs in several processes that speak over HTTP: the proxy and its gates, the vLLM
API server with the kvgate plugin, vLLM's engine core, the simulated replica. What they
say to one another is defined here, once, and every side builds and parses with it:

- `routes`: the forwarded routes and the kind of each (`chat`, `messages`, ...), the
  routes forwarded ungated, and the prefix of the replica API only gates may use;
- `probe_api`: the probe API's paths and version, and its typed messages
  (`PrefixQuery`, `KvAnswer`, `PrefixAnswer`) that build, parse with validation, merge;
- `owner_record`: the owner record (claim, renew, release, answer) and its pure record;
- `kv_pins`: KV pins (a turn's pin, its proof, the release) and `pin_book`, the pure
  books both pin-keeping servers share;
- `replica_auth`: the replica key a gate shows and a server checks;
- `errors`: the OpenAI and Anthropic error envelopes;
- `blocks`: block arithmetic both the gate and the engines count with.

Invariant: this package imports nothing of kvgate outside itself and nothing outside the
standard library (tests/test_layering.py). The plugin loads it inside vLLM's environment, where only vLLM's own
dependencies are guaranteed.
"""
