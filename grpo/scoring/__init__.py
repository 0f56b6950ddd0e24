"""Episodes into rewards: the Scorer and its pool of reward worker processes."""
