"""The planner's models, by job: `roofline` (memory and lower bounds on step time for a model on a mesh),
`mesh` (an EngineConfig's plan, and the mesh for N devices), `memory` (how the engine sizes its KV cache),
`devices` (the accelerator table) and `capacity` (replicas for a request rate, from benchmark results).
`python -m jaxserve.plan` is their command line."""
