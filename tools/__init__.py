"""tools package of tierfs."""
