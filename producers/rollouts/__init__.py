"""rollstream.producers.rollouts: the rollout service (jobs, INIT/RUN/EVAL stage workers over
Kafka), its sandboxes, agents, evaluators and task suites."""
