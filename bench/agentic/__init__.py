"""The multi-turn agentic benchmark (`kvgate bench agentic`, docs/bench.md).

Modules, one job each: `workload` (deterministic sessions), `ceiling` (infinite-cache
hit rate), `driver` (agent clients over HTTP), `processes` (replica and proxy
subprocesses), `scrape` (replica counters), `runner` (one run per mode), `report`
(aggregation and table), `plots`, `sweep`, `regimes` (presets), `cli`.
"""
