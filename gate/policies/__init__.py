"""Admission policies: pure functions from (a policy's view, readings, settings) to a decision.

A policy is one function, `decide(view, usage, prefix, settings) -> Admit | Wait |
Reject | ProbeFirst`. The gate calls it without a prefix reading first; `ProbeFirst`
means the reading would change the answer, so the gate asks the prefix probe and
decides again with what it got (a second ProbeFirst cannot happen:
`Policy.decide_read`). So the common path (no pressure, or a session that holds a
window) costs one shared usage reading, and a probe is asked only when its answer
matters.

Modules, bottom up:
- `vocabulary`: the decisions (`Admit`, `Wait`, `Reject`, `ProbeFirst`), their reasons
  and causes, and `PREFIX_UNAVAILABLE`;
- `request_body`: the output allowance and the prompt's bound read off a request body;
- `views`: the gate's facts (`GateFacts`) and one view type per policy;
- `pricing`: a turn's price in blocks (exact, bounded, estimated) and the usable blocks;
- `economics`: what holding costs (idle windows' lifetime, the work-conserving rule);
- `watermark`, `working_set`: one module per policy;
- `registry`: `Policy`, `POLICIES` by `gate.policy` name, and the renamed names.
"""
