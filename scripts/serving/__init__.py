"""Talking to a running TorchServe: `torchserve` (the one client every script uses), and the scripts built on it."""
