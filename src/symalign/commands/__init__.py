"""CLI commands, one module each; each defines ``register(app)``."""
