"""Router measures for the `moe.route` probe (pure torch; measured only when requested)."""

from engine.ops.router.entropy import router_entropy

__all__ = ["router_entropy"]
