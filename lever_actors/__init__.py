"""lever-actors: flash-backed speculative decoding with an actor runtime."""
__version__ = "0.1.0"
