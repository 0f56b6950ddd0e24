"""Episodes: prompts through the engine into episode tensors, group-relative advantages, and the
transport of whole groups from generator to trainer ranks."""
