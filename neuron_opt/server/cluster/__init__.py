"""`serve --data-parallel N`: N engine replicas behind one OpenAI endpoint, as a Ray Serve application.

    HTTP client -> Ray Serve proxy -> `Router` (1 replica, FastAPI, no CPU) -> `EngineReplica` x N

One concept a module (imports run down this list):
- board.py: the `MetricsBoard` actor: each replica's latest metrics and facts, and the LoRA adapter set.
- routing.py: which replica a request goes to (Serve's `RequestRouter`: prefix affinity, else least loaded).
- prometheus.py: the replicas' metrics merged with a `replica` label, and the router's routing metrics.
- replica.py: `EngineReplica`, the single-process server's engine and `OpenAIServing` as a Serve deployment.
- answers.py: the router's own errors and a failed stream's last events, in each API's shape.
- router.py: `Router`, the HTTP ingress: bounds, key, forwarding, retries, faults, drain, the adapter routes.

Ray does what Ray is for: placement (each replica asks for its cores: `neuron_cores = tp` on Neuron, which makes
Ray set NEURON_RT_VISIBLE_CORES for it; CPUs on the cpu/eager backends), routing (on Serve's `RequestRouter` API),
restarts (the Serve controller replaces a dead or unhealthy replica), streaming and cancellation through
`DeploymentHandle`s. docs/scale_out.md states the contracts.
"""
