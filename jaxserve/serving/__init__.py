"""Serving past one engine: replicas of jaxserve behind a router (`ray/`: Ray Serve). Host only, no jax."""
