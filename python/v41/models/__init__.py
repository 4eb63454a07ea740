"""Model code: the reference (oracle) forward and the Engram n-gram hashing it shares with the engine."""
