"""backends package of tierfs."""
