"""The global load balancer: replica registry, health checks, sticky hashing, failover.

`Replica` is the object the proxy and the gates receive (it has `.name` and `.url`);
`ReplicaRegistry` owns the set of replicas and their health; `Balancer` picks a
replica for a session (rendezvous or bounded_load) or for an anonymous request
(least loaded).
"""

from kvgate.balancer.balancer import Balancer
from kvgate.balancer.registry import Replica, ReplicaRegistry

__all__ = ["Balancer", "Replica", "ReplicaRegistry"]
