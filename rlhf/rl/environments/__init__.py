"""environments: multi-turn environments (tools) for the RL rollout loop: the interface (base.py),
the process pool that runs them with timeouts and fault containment (pool.py), and the built-in tools."""
from rlhf.rl.environments.base import Environment, Reply, Step, load_environment
from rlhf.rl.environments.pool import ProcessRunner, make_runner

__all__ = ["Environment", "ProcessRunner", "Reply", "Step", "load_environment", "make_runner"]
