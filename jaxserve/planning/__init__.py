"""The planner's models, by job: `roofline` (memory and lower bounds on step time for a model on a mesh)
and `capacity` (replicas for a request rate, from benchmark results). `python -m jaxserve.plan` is their
command line."""
