"""Renderings of a program: looped pseudocode of its schedule, the paper's Hopper derivation,
pictures of diagrams and of streamed programs."""
