"""Multi-turn episodes: the environment interface (base.py), the built-in environments, and the
rollout that alternates model turns and environment turns (conversation.py)."""
