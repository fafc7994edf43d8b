"""Models in and out: make the tiny pair, fetch the demo pair, package an archive, render docs/models.md's matrix."""
